from __future__ import annotations

import json

import pydantic
import pytest

from lockstep.core import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_MATCHED_STR,
    FINISH_MATCHED_TOKEN,
    TokenLogprob,
)
from lockstep.entrypoints import sglang_fields
from lockstep.entrypoints.errors import format_validation_error
from lockstep.entrypoints.generate_request import GenerateReqInput
from lockstep.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionRequest,
    DeltaMessage,
)
from lockstep.entrypoints.openai.serving import (
    _without_null_usage,
    chat_logprobs,
    completion_logprobs,
    finish_of,
    usage_of,
)
from lockstep.entrypoints.tokenizer_manager import GenerateOutput, RequestError
from lockstep.sampling_params import SamplingParams
from lockstep.utils.http import ErrorResponse, dumps, error_body

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}

BAD_INPUTS = [
    # /generate: prompts
    (GenerateReqInput, {}, "exactly one of text or input_ids"),
    (GenerateReqInput, {"text": "a", "input_ids": [1]}, "exactly one of text or input_ids"),
    (GenerateReqInput, {"text": 5}, "text: must be a string or a non-empty list of strings, got 5"),
    (GenerateReqInput, {"text": []}, "text: must not be empty"),
    (GenerateReqInput, {"text": ["a", 3]}, "text[1]: must be a string, got 3"),
    (GenerateReqInput, {"input_ids": []}, "input_ids: must not be empty"),
    (GenerateReqInput, {"input_ids": [1, -2]}, "input_ids[1]: must be >= 0, got -2"),
    (GenerateReqInput, {"input_ids": [[1], []]}, "input_ids[1]: must not be empty"),
    (GenerateReqInput, {"input_ids": "1 2 3"}, "input_ids: must be a list of token ids"),
    (GenerateReqInput, {"input_ids": [1.5]}, "input_ids[0]: must be an integer, got 1.5"),
    # /generate: sampling params
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"temperature": -1}},
        "sampling_params.temperature: must be >= 0, got -1",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"temperature": float("nan")}},
        "sampling_params.temperature: must be a finite number, got nan",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"top_p": 0}},
        "sampling_params.top_p: must be > 0, got 0",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"top_p": 1.5}},
        "sampling_params.top_p: must be <= 1, got 1.5",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"top_k": 0}},
        "sampling_params.top_k: must be -1 (disabled) or >= 1, got 0",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"min_p": 2}},
        "sampling_params.min_p: must be <= 1",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"frequency_penalty": 3}},
        "sampling_params.frequency_penalty: must be <= 2, got 3",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"presence_penalty": -2.5}},
        "sampling_params.presence_penalty: must be >= -2",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"repetition_penalty": 0}},
        "sampling_params.repetition_penalty: must be > 0",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        "sampling_params.max_new_tokens: must be >= 0, got -1",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}},
        "sampling_params: min_new_tokens (5) must be <= max_new_tokens (4)",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"stop": [""]}},
        "sampling_params.stop[0]: must not be empty",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"stop": ["x"] * 17}},
        "sampling_params.stop: must have at most 16 items",
    ),
    (  # a stop's length bounds the scheduler's per-token search (issue 21)
        GenerateReqInput,
        {"text": "a", "sampling_params": {"stop": ["x" * 1025]}},
        "sampling_params.stop[0]: must have at most 1024 characters",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"stop_regex": "a" * 1025}},
        "sampling_params.stop_regex[0]: must have at most 1024 characters",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"stop": 3}},
        "sampling_params.stop: must be a string or a list of strings",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"stop_token_ids": [-1]}},
        "sampling_params.stop_token_ids[0]: must be >= 0",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"n": 0}},
        "sampling_params.n: must be >= 1",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"n": 17}},
        "sampling_params.n: must be <= 16",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"regex": "a+", "ebnf": 'root ::= "a"'}},
        "sampling_params: Only one of regex, json_schema, or ebnf can be set.",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"max_tokens": 5}},
        "sampling_params.max_tokens: unknown field",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"seed": 2**64}},
        "sampling_params.seed: must be <=",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": {"ignore_eos": "maybe"}},
        "sampling_params.ignore_eos: must be a boolean",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": 7},
        "sampling_params: must be an object or a list",
    ),
    (
        GenerateReqInput,
        {"text": ["a", "b"], "sampling_params": [{}, {"temperature": -0.5}]},
        "sampling_params[1].temperature: must be >= 0, got -0.5",
    ),
    # /generate: batch consistency and other fields
    (
        GenerateReqInput,
        {"text": ["a", "b"], "sampling_params": [{}]},
        "sampling_params: a list must have one entry per prompt; got 1 for 2 prompts",
    ),
    (
        GenerateReqInput,
        {"text": "a", "sampling_params": [{}]},
        "sampling_params: a list must have one entry",
    ),
    (
        GenerateReqInput,
        {"text": ["a", "b"], "rid": ["x"]},
        "rid: a list must have one entry per prompt",
    ),
    (
        GenerateReqInput,
        {"text": ["a", "b"], "rid": ["x", "x"]},
        "rid: the rids of a batch must be distinct",
    ),
    (GenerateReqInput, {"text": "a", "rid": ""}, "rid: must not be empty"),
    (
        GenerateReqInput,
        {"text": "a", "top_logprobs_num": 21, "return_logprob": True},
        "top_logprobs_num: must be <= 20",
    ),
    (
        GenerateReqInput,
        {"text": "a", "top_logprobs_num": 2},
        "top_logprobs_num: requires return_logprob",
    ),
    (GenerateReqInput, {"text": "a", "logprob_start_len": -2}, "logprob_start_len: must be >= -1"),
    (GenerateReqInput, {"text": "a", "video_data": "http://x/y.mp4"},
     'video_data: "http://x/y.mp4" is not supported by this server (no video'),
    (GenerateReqInput, {"text": ["a", "b"], "image_data": ["x"]},
     "image_data: a batch of 2 prompts needs a list with one entry"),
    (GenerateReqInput, {"text": "a", "image_data": [["x"]]},
     "image_data: for a single prompt, a string or a list of strings"),
    (GenerateReqInput, {"text": "a", "imagedata": "x"}, "imagedata: unknown field"),
    (GenerateReqInput, {"text": "a", "sampling_params": {"stream_interval": 4}},
     "sampling_params: stream_interval: 4 is not supported by this server (every token is "
     "streamed); omit it or send 1"),
    (GenerateReqInput, [1, 2], "request body: must be an object"),
    # /v1/completions
    (CompletionRequest, {}, "prompt: is required"),
    (CompletionRequest, {"prompt": []}, "prompt: must not be empty"),
    (CompletionRequest, {"prompt": [[1, 2], [-1]]}, "prompt[1][0]: must be >= 0"),
    (CompletionRequest, {"prompt": {"text": "a"}}, "prompt: must be a string, a list of strings"),
    (CompletionRequest, {**COMPLETION, "max_tokens": -1}, "max_tokens: must be >= 0, got -1"),
    (CompletionRequest, {**COMPLETION, "logprobs": 6}, "logprobs: must be <= 5, got 6"),
    (CompletionRequest, {**COMPLETION, "suffix": "}"}, 'suffix: "}" is not supported'),
    (CompletionRequest, {**COMPLETION, "best_of": 3}, "best_of (3): only best_of equal to n (1)"),
    (
        CompletionRequest,
        {**COMPLETION, "logit_bias": {"50256": -101}},
        "logit_bias.50256: must be >= -100, got -101",
    ),
    (CompletionRequest, {**COMPLETION, "logit_bias": {"x": 1}}, "logit_bias: keys must be token ids"),
    (
        CompletionRequest,
        {**COMPLETION, "temperature": float("inf")},
        "temperature: must be a finite number",
    ),
    (CompletionRequest, {**COMPLETION, "n": 100}, "n: must be <= 16, got 100"),
    (
        CompletionRequest,
        {**COMPLETION, "stream_options": {"include_usage": True}},
        "stream_options: only allowed when stream is true",
    ),
    (
        CompletionRequest,
        {**COMPLETION, "stream": True, "stream_options": {"usage": True}},
        "stream_options.usage: unknown field",
    ),
    (
        CompletionRequest,
        {**COMPLETION, "min_tokens": 20},
        "min_tokens (20) must be <= max_tokens (16)",
    ),
    (
        CompletionRequest,
        {**COMPLETION, "top_k": -5},
        "top_k: must be -1 (disabled) or >= 1, got -5",
    ),
    (CompletionRequest, {**COMPLETION, "frobnicate": 1}, "frobnicate: unknown field"),
    # /v1/chat/completions
    (ChatCompletionRequest, {}, "messages: is required"),
    (ChatCompletionRequest, {"messages": []}, "messages: must not be empty"),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "developer", "content": "x"}]},
        "messages[0].role: must be 'system', 'user', 'assistant' or 'tool', got 'developer'",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "tool", "content": "x"}]},
        "messages[0]: tool_call_id: a tool message needs one, and only a tool message",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user"}]},
        "messages[0]: content is required for a user message",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": 5}]},
        "messages[0].content: must be a string or a list of content parts, got 5",
    ),
    (
        ChatCompletionRequest,
        {
            "messages": [
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "u"}}]}
            ]
        },
        "messages[0].content[0]: has type 'input_audio'; only 'text', 'image_url' parts are supported",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "x", "tool_calls": [{
            "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
        "messages[0]: tool_calls: only an assistant message makes tool calls",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "assistant", "tool_calls": [{}]}]},
        "messages[0].tool_calls[0].id: is required",
    ),
    (
        ChatCompletionRequest,
        {**CHAT, "top_logprobs": 3},
        "top_logprobs: requires logprobs to be true",
    ),
    (
        ChatCompletionRequest,
        {**CHAT, "logprobs": True, "top_logprobs": 21},
        "top_logprobs: must be <= 20",
    ),
    (
        ChatCompletionRequest,
        {**CHAT, "response_format": {"type": "structural_tag"}},
        "response_format",
    ),
    (
        ChatCompletionRequest,
        {**CHAT, "tools": [{"type": "function", "function": {"description": "f"}}]},
        "tools[0].function.name: is required",
    ),
    (
        ChatCompletionRequest,
        {**CHAT, "tool_choice": "sometimes"},
        "tool_choice: must be 'none', 'auto' or 'required', got 'sometimes'",
    ),
    (
        ChatCompletionRequest,
        {**CHAT, "max_tokens": 5, "max_completion_tokens": 6},
        "max_tokens and max_completion_tokens disagree",
    ),
    (
        ChatCompletionRequest,
        {**CHAT, "max_completion_tokens": 2, "min_tokens": 3},
        "min_tokens (3) must be <= max_tokens (2)",
    ),
    (
        ChatCompletionRequest,
        {**CHAT, "presence_penalty": 2.5},
        "presence_penalty: must be <= 2, got 2.5",
    ),
    (ChatCompletionRequest, {**CHAT, "stop": ["a", ""]}, "stop[1]: must not be empty"),
    (ChatCompletionRequest, {**CHAT, "seed": "abc"}, "seed: must be an integer, got 'abc'"),
]


@pytest.mark.parametrize(("model", "payload", "expected"), BAD_INPUTS)
def test_bad_input_is_rejected_with_a_message_naming_the_field(model, payload, expected):
    with pytest.raises(pydantic.ValidationError) as info:
        model.model_validate(payload)
    message = format_validation_error(info.value)
    assert expected in message, message
    assert "Value error," not in message and "[type=" not in message


def test_json_nan_is_rejected_too():
    with pytest.raises(pydantic.ValidationError) as info:
        GenerateReqInput.model_validate_json('{"text": "a", "sampling_params": {"top_p": NaN}}')
    assert "sampling_params.top_p: must be a finite number" in format_validation_error(info.value)


def test_several_errors_in_one_sentence():
    with pytest.raises(pydantic.ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "a", "n": 0, "top_p": 0, "echo": "x"})
    message = format_validation_error(info.value)
    assert (
        message.count(";") == 2
        and "n: must be >= 1" in message
        and "echo: must be a boolean" in message
    )


def test_sampling_defaults():
    sp = SamplingParams()
    assert sp.max_new_tokens == 128 and sp.min_new_tokens == 0
    assert sp.temperature == 1.0 and sp.top_p == 1.0 and sp.top_k == -1 and sp.min_p == 0.0
    assert sp.frequency_penalty == sp.presence_penalty == 0.0 and sp.repetition_penalty == 1.0
    assert sp.stop == [] and sp.stop_token_ids == [] and sp.n == 1 and sp.seed is None
    assert sp.skip_special_tokens and sp.spaces_between_special_tokens
    assert not sp.ignore_eos and not sp.no_stop_trim


def test_null_means_default_but_null_max_new_tokens_means_unbounded():
    sp = SamplingParams(temperature=None, stop=None, max_new_tokens=None)
    assert sp.temperature == 1.0 and sp.stop == [] and sp.max_new_tokens is None
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_generate_single_text_defaults():
    req = GenerateReqInput.model_validate({"text": "Hello"})
    assert not req.is_batch and req.batch_size == 1
    assert req.stream is False and req.return_logprob is False
    assert req.logprob_start_len == -1 and req.top_logprobs_num == 0
    (single,) = req.normalize()
    assert single.input_text == "Hello" and single.input_ids is None
    assert single.sampling_params == SamplingParams() and len(single.rid) == 32


def test_generate_batch_fan_out_with_per_item_params_and_n():
    req = GenerateReqInput.model_validate(
        {
            "input_ids": [[1, 2], [3]],
            "rid": ["a", "b"],
            "sampling_params": [{"n": 2, "seed": 7, "max_new_tokens": 4}, {"temperature": 0}],
            "return_logprob": [True, False],
            "top_logprobs_num": 3,
        }
    )
    assert req.is_batch and req.batch_size == 2
    out = req.normalize()
    assert [r.rid for r in out] == ["a-0", "a-1", "b"]
    assert [r.input_ids for r in out] == [[1, 2], [1, 2], [3]]
    assert [(r.prompt_index, r.sample_index) for r in out] == [(0, 0), (0, 1), (1, 0)]
    assert [r.sampling_params.n for r in out] == [1, 1, 1]
    assert [r.sampling_params.seed for r in out] == [7, 8, None]
    assert out[0].sampling_params.max_new_tokens == 4 and out[2].sampling_params.temperature == 0
    assert [r.return_logprob for r in out] == [True, True, False]
    assert all(r.top_logprobs_num == 3 for r in out)


def test_generate_batch_shares_one_sampling_params_dict():
    req = GenerateReqInput.model_validate(
        {"text": ["x", "y", "z"], "sampling_params": {"n": 2, "temperature": 0.5}}
    )
    out = req.normalize()
    assert len(out) == 6 and [r.input_text for r in out] == ["x", "x", "y", "y", "z", "z"]
    assert len({r.rid for r in out}) == 6
    assert all(r.sampling_params.temperature == 0.5 and r.sampling_params.n == 1 for r in out)


def test_generate_single_rid_with_n_and_colliding_rids():
    out = GenerateReqInput.model_validate(
        {"text": "q", "rid": "r", "sampling_params": {"n": 3}}
    ).normalize()
    assert [r.rid for r in out] == ["r-0", "r-1", "r-2"]
    clash = GenerateReqInput.model_validate(
        {"text": ["a", "b"], "rid": ["r", "r-1"], "sampling_params": [{"n": 2}, {}]}
    )
    with pytest.raises(ValueError, match="collide"):
        clash.normalize()


def test_completion_defaults_and_sampling_params():
    req = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": [1, 2, 3],
            "stop": "END",
            "top_k": 20,
            "seed": 1,
            "temperature": None,
        }
    )
    assert req.max_tokens == 16 and req.n == 1 and req.logprobs is None and req.echo is False
    sp = req.to_sampling_params()
    assert sp.max_new_tokens == 16 and sp.stop == ["END"] and sp.top_k == 20 and sp.seed == 1
    assert sp.temperature == 1.0
    # best_of equal to n, an empty suffix and an empty logit_bias are harmless.
    CompletionRequest.model_validate(
        {**COMPLETION, "n": 2, "best_of": 2, "suffix": "", "logit_bias": {}}
    )
    for prompt in ("a", ["a", "b"], [1], [[1], [2, 3]]):
        assert CompletionRequest.model_validate({"prompt": prompt}).prompt == prompt


def test_chat_defaults_and_sampling_params():
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "s"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ],
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "response_format": {"type": "text"},
            "tool_choice": "none",
            "tools": [],
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "stop_token_ids": [106],
        }
    )
    assert req.messages_as_dicts() == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]
    sp = req.to_sampling_params()
    assert sp.max_new_tokens == 9 and sp.min_p == 0.1 and sp.repetition_penalty == 1.1
    assert sp.ignore_eos and sp.stop_token_ids == [106] and sp.skip_special_tokens
    assert req.stream_options.include_usage
    plain = ChatCompletionRequest.model_validate(CHAT)
    assert plain.to_sampling_params().max_new_tokens is None  # until stop or context end
    assert plain.logprobs is False and plain.top_logprobs is None
    assert (
        ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 3})
        .to_sampling_params()
        .max_new_tokens
        == 3
    )


def _output(rid: str, prompt: int, completion: int, **kw) -> GenerateOutput:
    return GenerateOutput(rid, "", [], "", [], prompt, completion, 0, kw.pop("finish", None),
                          0.0, **kw)


def test_openai_output_path_shapes():
    """The functions that turn generate outputs into OpenAI's shapes, on hand-made outputs."""
    hi, there = TokenLogprob(-0.5, 7, " hi"), TokenLogprob(-1.0, 8, " thé")
    lp = completion_logprobs([hi, there], [[hi], [there, hi]], top_n=2, offset=3)
    assert lp.tokens == [" hi", " thé"] and lp.token_logprobs == [-0.5, -1.0]
    assert lp.text_offset == [3, 6]  # characters, from the offset the stream has reached
    assert lp.top_logprobs == [{" hi": -0.5}, {" thé": -1.0, " hi": -0.5}]
    assert completion_logprobs([hi], [[hi]], top_n=0).top_logprobs == [None]

    chat = chat_logprobs([there], [[there]]).model_dump()["content"][0]
    assert chat["bytes"] == list(" thé".encode()) and chat["top_logprobs"][0]["token"] == " thé"

    # Prompt tokens once per prompt (not per sample), completion tokens of every sample.
    singles = GenerateReqInput(text=["a", "b"], sampling_params={"n": 2}).normalize()
    finals = [_output(s.rid, 5 + s.prompt_index, 3) for s in singles]
    finals[0].cached_tokens, finals[1].cached_tokens = 4, 5  # the second sample's is not counted
    assert usage_of(singles, finals).model_dump() == {
        "prompt_tokens": 11, "completion_tokens": 12, "total_tokens": 23,
        "prompt_tokens_details": {"cached_tokens": 4}}

    assert finish_of(_output("r", 1, 1)) == (None, None)
    assert finish_of(_output("r", 1, 1, finish=FINISH_MATCHED_STR("\n"))) == ("stop", "\n")
    assert finish_of(_output("r", 1, 1, finish=FINISH_MATCHED_TOKEN(2))) == ("stop", 2)
    assert finish_of(_output("r", 1, 1, finish=FINISH_LENGTH(4))) == ("length", None)

    # A stream chunk: no usage key until the usage chunk, a delta holds only what it sets.
    chunk = ChatCompletionStreamResponse(
        id="c", model="m",
        choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant"))])
    data = _without_null_usage(chunk)
    assert "usage" not in data and data["choices"][0]["delta"] == {"role": "assistant"}
    assert data["object"] == "chat.completion.chunk"


def test_meta_info_is_sglangs_shape():
    out = _output("r1", 3, 2, finish=FINISH_ABORT("bad", 400), dp_rank=1,
                  output_token_logprobs=[TokenLogprob(-0.1, 5, "x")], input_token_logprobs=[])
    meta = out.meta_info()
    assert meta["finish_reason"] == {"type": "abort", "message": "bad", "status_code": 400}
    assert meta["dp_rank"] == 1 and "output_top_logprobs" not in meta
    assert json.loads(dumps(meta))["output_token_logprobs"] == [[-0.1, 5, "x"]]
    assert _output("r", 1, 1).meta_info()["finish_reason"] is None
    assert "dp_rank" not in _output("r", 1, 1).meta_info()


def test_error_body_has_openai_shape():
    body = error_body("temperature: must be >= 0, got -1", 400, param="temperature")
    assert body == {
        "error": {
            "message": "temperature: must be >= 0, got -1",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": 400,
        }
    }
    assert error_body("boom", 500)["error"]["type"] == "server_error"
    assert error_body("no key", 401)["error"]["type"] == "authentication_error"
    assert ErrorResponse.model_validate(json.loads(json.dumps(body))).error.code == 400


def test_incremental_stream_sends_each_logprob_once():
    from lockstep.entrypoints.fanout import meta_delta as _meta_delta

    outs, ins = [TokenLogprob(-0.1, 1)], [TokenLogprob(None, 5), TokenLogprob(-2.0, 6)]
    item = _output("r", 2, 1, output_token_logprobs=outs, input_token_logprobs=ins)
    sent: dict[str, int] = {}
    first = _meta_delta(item.meta_info(), sent)
    outs.append(TokenLogprob(-0.2, 2))  # the request's own lists grow with each output
    second = _meta_delta(item.meta_info(), sent)
    assert first["output_token_logprobs"] == [(-0.1, 1, None)] and len(first["input_token_logprobs"]) == 2
    assert second["output_token_logprobs"] == [(-0.2, 2, None)]
    assert second["input_token_logprobs"] == [] and second["prompt_tokens"] == 2


# ---------------------------------------------------------------------------------------------
# SGLang 0.5's request fields (lockstep.entrypoints.sglang_fields)

ROUTES = [(GenerateReqInput, sglang_fields.GENERATE, {"text": "a"}),
          (CompletionRequest, sglang_fields.COMPLETIONS, COMPLETION),
          (ChatCompletionRequest, sglang_fields.CHAT, CHAT)]


@pytest.mark.parametrize(("model", "table", "_body"), ROUTES)
def test_the_field_table_names_exactly_the_served_fields(model, table, _body):
    """SERVED in the table <=> a field of lockstep's model: the table cannot drift from the code."""
    served = {k for k, rule in table.items() if rule == sglang_fields.SERVED}
    assert served == set(model.model_fields)
    sp = {k for k, r in sglang_fields.SAMPLING_PARAMS.items() if r == sglang_fields.SERVED}
    assert sp == set(SamplingParams.__dataclass_fields__)


@pytest.mark.parametrize(("model", "table", "body"), ROUTES)
def test_every_sglang_field_at_its_default_is_accepted(model, table, body):
    off = {k: (r.values[0] if r.values else None) for k, r in table.items()
           if isinstance(r, sglang_fields.Off)}
    req = model.model_validate({**body, **off})
    assert req == model.model_validate(body)
    sp_off = {k: (r.values[0] if r.values else None)
              for k, r in sglang_fields.SAMPLING_PARAMS.items() if isinstance(r, sglang_fields.Off)}
    assert GenerateReqInput.model_validate({"text": "a", "sampling_params": sp_off}).sampling_params \
        == SamplingParams()


def test_sglang_router_bodies_are_accepted():
    """sglang-router rebuilds each request from its own struct, with these fields at their defaults."""
    GenerateReqInput.model_validate({
        "text": "a", "model": None, "log_metrics": True, "return_hidden_states": False,
        "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False,
        "return_flat_raw_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False})
    ChatCompletionRequest.model_validate({
        **CHAT, "continue_final_message": False, "separate_reasoning": True,
        "stream_reasoning": True, "return_hidden_states": False})
    CompletionRequest.model_validate({**COMPLETION, "return_hidden_states": False})


@pytest.mark.parametrize(("model", "payload", "expected"), [
    (GenerateReqInput, {"text": "a", "return_hidden_states": True},
     "return_hidden_states: true is not supported by this server (no hidden states); omit it or "
     "send false"),
    (GenerateReqInput, {"text": "a", "return_hidden_states": 0}, "return_hidden_states: 0 is not"),
    (GenerateReqInput, {"text": "a", "log_metrics": False}, "log_metrics: false is not supported"),
    (GenerateReqInput, {"text": "a", "return_flat_raw_top_logprobs_b64": True},
     "return_flat_raw_top_logprobs_b64: true is not supported by this server (no flat raw "
     "logprobs); omit it or send false"),
    (GenerateReqInput, {"text": "a", "lora_id": "x"}, 'lora_id: "x" is not supported by this '
     "server (adapters are named by lora_path); omit it"),
    (GenerateReqInput, {"text": ["a", "b"], "lora_path": ["x"]},
     "lora_path: a list must have one entry per prompt; got 1 for 2 prompts"),
    (ChatCompletionRequest, {**CHAT, "continue_final_message": True},
     "continue_final_message: true is not supported"),
    (CompletionRequest, {**COMPLETION, "return_hidden_states": "last"},
     'return_hidden_states: "last" is not supported'),
    (CompletionRequest, {**COMPLETION, "return_hidden_state": False},
     "return_hidden_state: unknown field"),
])
def test_a_value_lockstep_cannot_honour_is_refused_by_name(model, payload, expected):
    with pytest.raises(pydantic.ValidationError) as info:
        model.model_validate(payload)
    assert expected in format_validation_error(info.value)


def test_one_sampling_params_type_from_the_body_to_the_scheduler():
    """The OpenAI requests build lockstep.sampling_params.SamplingParams themselves, OpenAI's names mapped."""
    sp = CompletionRequest.model_validate(
        {**COMPLETION, "max_tokens": 5, "min_tokens": 2, "logit_bias": {"7": 3.5},
         "json_schema": '{"type": "object"}'}).to_sampling_params()
    assert type(sp) is SamplingParams
    assert (sp.max_new_tokens, sp.min_new_tokens, sp.logit_bias) == (5, 2, {"7": 3.5})
    assert sp.constraint.kind == "json_schema"
    gen = GenerateReqInput.model_validate(
        {"text": "a", "sampling_params": {"sampling_seed": 4, "logit_bias": {"7": -100}}})
    assert type(gen.sampling_params) is SamplingParams and gen.sampling_params.seed == 4


def test_fan_out_refuses_too_many_generations_before_building_any():
    req = GenerateReqInput.model_validate({"text": ["a", "b", "c"], "sampling_params": {"n": 2}})
    with pytest.raises(RequestError, match="fans out into 6 generations"):
        req.normalize(limit=5)
    assert len(req.normalize(limit=6)) == 6


def test_completion_prompts_build_single_requests_directly():
    for prompt, want in (("a", [("a", None)]), (["a", "b"], [("a", None), ("b", None)]),
                         ([1, 2], [(None, [1, 2])]), ([[1], [2, 3]], [(None, [1]), (None, [2, 3])])):
        assert CompletionRequest.model_validate({"prompt": prompt}).prompts() == want

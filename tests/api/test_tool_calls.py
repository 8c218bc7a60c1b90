"""Tool calling: tools rendered into the prompt the way each family was trained, and the
OpenAI function-calling flow against a live server."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import openai
import pydantic
import pytest
from transformers import AutoTokenizer

from lockstep.entrypoints.errors import format_validation_error
from lockstep.entrypoints.openai.chat_templates import (
    BUILTIN_CHAT_TEMPLATES,
    ChatTemplateError,
    render_chat,
)
from lockstep.entrypoints.openai.protocol import ChatCompletionRequest
from lockstep.entrypoints.openai.tool_calls import (
    ToolCallStream,
    ToolPlan,
    ToolRequestError,
    finish_reason,
    plan_tools,
    template_message,
)
from lockstep.testing.live_server import LiveServer
from lockstep.testing.tiers import marks
from lockstep.testing.tiny_models import make_tiny_model


@functools.cache
def _tok() -> Any:
    """A real tokenizer to render with (its own bos/eos are overridden where a test needs)."""
    return AutoTokenizer.from_pretrained(make_tiny_model("qwen2"))


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
WEATHER_JSON = ('{"type": "function", "function": {"name": "get_weather", "description": '
                '"Current weather in a city", "parameters": {"type": "object", "properties": '
                '{"city": {"type": "string"}}, "required": ["city"]}}}')
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo", "metric": True}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "-3"},
]


# ---------------------------------------------------------------------------------------------
# Rendering


def test_chatml_renders_tools_and_history_as_qwen_does() -> None:
    out = render_chat(_tok(), BUILTIN_CHAT_TEMPLATES["chatml"], HISTORY, tools=[WEATHER])
    assert out == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist "
        "with the user query.\n\nYou are provided with function signatures within <tools></tools> "
        f"XML tags:\n<tools>\n{WEATHER_JSON}\n</tools>\n\nFor each function call, return a json "
        "object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Oslo", "metric": true}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp": 20}\n</tool_response>\n<tool_response>\n-3\n'
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_llama3_renders_tools_and_history_as_llama_3_1_does() -> None:
    out = render_chat(_tok(), BUILTIN_CHAT_TEMPLATES["llama3"], HISTORY, tools=[WEATHER],
                      extra_context={"bos_token": "<|begin_of_text|>"})
    assert out.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please "
        "respond with a JSON for a function call with its proper arguments that best answers the "
        'given prompt.\n\nRespond in the format {"name": function name, "parameters": dictionary '
        'of argument name and its value}.Do not use variables.\n\n{\n    "type": "function",\n')
    assert out.endswith(
        '    }\n}\n\nWeather in Paris and Oslo?<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "parameters": {"city": "Oslo", "metric": true}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 20}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n-3<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_gemma_renders_tools_in_the_first_user_turn_and_calls_as_python() -> None:
    out = render_chat(_tok(), BUILTIN_CHAT_TEMPLATES["gemma"], HISTORY, tools=[WEATHER],
                      extra_context={"bos_token": "<bos>"})
    assert out.startswith("<bos><start_of_turn>user\nBe brief.\n\nYou have access to functions.")
    assert f"[\n{WEATHER_JSON}\n]\n\nWeather in Paris and Oslo?<end_of_turn>\n" in out
    assert out.endswith(
        '<start_of_turn>model\n[get_weather(city="Paris"), get_weather(city="Oslo", '
        'metric=True)]<end_of_turn>\n<start_of_turn>user\n```tool_output\n{"temp": 20}\n```\n'
        "```tool_output\n-3\n```<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match="alternate"):
        render_chat(_tok(), BUILTIN_CHAT_TEMPLATES["gemma"], HISTORY[:2] + HISTORY[1:2],
                    tools=[WEATHER])


@pytest.mark.parametrize("name", sorted(BUILTIN_CHAT_TEMPLATES))
def test_without_tools_the_templates_are_unchanged(name: str) -> None:
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
             {"role": "user", "content": "Bye"}]
    template = BUILTIN_CHAT_TEMPLATES[name]
    assert (render_chat(_tok(), template, plain, tools=None)
            == render_chat(_tok(), template, plain, tools=[]))
    assert "function" not in render_chat(_tok(), template, plain)


# ---------------------------------------------------------------------------------------------
# Checking tools and tool_choice (the route turns ToolRequestError into a 400)


def _tool(name: str, parameters: Any = None) -> dict:
    function: dict = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _plan(tools: Any, choice: Any, parser: str | None, parallel: bool | None = None
          ) -> ToolPlan | None:
    """A request's tools checked as the route checks them: shapes by the request model, the
    rest by plan_tools; either way one message naming the problem."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    body.update({k: v for k, v in (("tools", tools), ("tool_choice", choice),
                                   ("parallel_tool_calls", parallel)) if v is not None})
    try:
        req = ChatCompletionRequest.model_validate(body)
    except pydantic.ValidationError as e:
        raise ToolRequestError(format_validation_error(e)) from None
    return plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, parser)


@pytest.mark.parametrize("tools,choice,parser,message", [
    ([{"type": "function", "function": {"description": "x"}}], "auto", "qwen25",
     r"tools\[0\]\.function\.name: .*required"),
    ([_tool("f", {"type": "object", "properties": []})], "auto", "qwen25",
     r"tools\[0\]\.function\.parameters is not a JSON schema"),
    ([_tool("f", {"type": "bogus"})], "auto", "qwen25", "not a JSON schema"),
    ([_tool("f", "a string")], "auto", "qwen25", r"tools\[0\]\.function\.parameters"),
    ([_tool("f", {"type": "string"})], "auto", "qwen25", "must describe an object"),
    ([_tool("bad name!")], "auto", "qwen25", r"tools\[0\]\.function\.name"),
    ([_tool("f"), _tool("f")], "auto", "qwen25", "'f' is given twice"),
    ([{"type": "retrieval"}], "auto", "qwen25", r"tools\[0\]\.type"),
    ([_tool("f")], {"type": "function", "function": {"name": "g"}}, "qwen25",
     r"'g' is not among tools \(f\)"),
    (None, "required", "qwen25", "tool_choice 'required' needs tools"),
    ([], {"type": "function", "function": {"name": "g"}}, "qwen25", "no tools are given"),
    ([_tool("f")], "auto", None, "--tool-call-parser"),
    ([_tool("f")], None, None, "--tool-call-parser"),
    ([_tool("f")], "sometimes", "qwen25", "tool_choice"),
    ([_tool("f", {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}})],
     "required", None, "tool_choice 'required' forces .* cannot be enforced: .*look-around"),
])
def test_bad_tool_requests_name_the_problem(tools, choice, parser, message) -> None:
    with pytest.raises(ToolRequestError, match=message):
        _plan(tools, choice, parser)


def test_plans() -> None:
    assert _plan([_tool("f")], "none", None) is None  # no tools reach the model
    assert _plan(None, "auto", None) is None
    plan = _plan([_tool("f", {"type": "object", "properties": {"a": {"type": "integer"}}}),
                  _tool("g")], "required", None, parallel=False)
    assert plan is not None and plan.mode == "required" and not plan.parallel
    assert plan.tools[1] == {"type": "function", "function": {"name": "g"}}
    schema = json.loads(plan.json_schema() or "")
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [
        {"const": "f"}, {"const": "g"}]
    assert schema["items"]["anyOf"][1]["properties"]["arguments"] == {
        "type": "object", "properties": {}, "additionalProperties": False}
    named = _plan([_tool("f", {"type": "object"})],
                  {"type": "function", "function": {"name": "f"}}, None)
    assert named is not None and json.loads(named.json_schema() or "") == {"type": "object"}
    auto = _plan([_tool("f")], "auto", "llama3")
    assert auto is not None and auto.json_schema() is None and auto.parser_name == "llama3"


def test_stream_deltas_have_openai_shape_and_respect_parallel_false() -> None:
    plan = _plan([_tool("f"), _tool("g")], "auto", "qwen25", parallel=False)
    assert plan is not None
    stream = ToolCallStream(plan)
    content, calls = stream.feed('Hi<tool_call>{"name": "f", "arguments": {"a"')
    assert content == "Hi"
    assert [c.model_dump(exclude_none=True) for c in calls] == [
        {"index": 0, "id": calls[0].id, "type": "function",
         "function": {"name": "f", "arguments": '{"a"'}}]
    content, calls = stream.feed(': 1}}</tool_call><tool_call>{"name": "g", "arguments": {}}'
                                 "</tool_call>")
    assert content == ""
    assert [c.model_dump(exclude_none=True) for c in calls] == [
        {"index": 0, "function": {"arguments": ": 1}"}}]
    assert stream.finish() == ("", []) and stream.has_calls
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length"


def test_history_arguments_become_objects_for_templates() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    out = template_message(2, {"role": "assistant", "content": "", "tool_calls": [call]})
    assert out["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    for bad in ("[1", "[1]", '"x"'):
        call["function"]["arguments"] = bad
        with pytest.raises(ToolRequestError,
                           match=r"messages\[2\]\.tool_calls\[0\]\.function\.arguments must"):
            template_message(2, {"role": "assistant", "tool_calls": [call]})


# ---------------------------------------------------------------------------------------------
# A live server: the official openai client's function-calling flow

WEATHER_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["tz"],
    "properties": {"tz": {"type": "string", "enum": ["UTC", "CET", "PST"]}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                      "parameters": TIME_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
MODEL = "tiny-qwen"
ASK = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]


def _valid_call(call: Any) -> dict[str, Any]:
    """The call's arguments, checked against its function's schema."""
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema_rs.validate(SCHEMAS[call.function.name], arguments)
    return arguments


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[dict], str | None]:
    """A streamed reply put back together: content, calls (id, name, arguments), finish."""
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            assert not (delta.content and delta.tool_calls)
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.id is not None:  # a new call opens with its id, type and name
                    assert d.index == len(calls) and d.type == "function" and d.function.name
                    calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
                else:
                    assert d.index == len(calls) - 1 and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.fixture(scope="module")
@marks("server")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # Qwen2 family: its Qwen-style (ChatML) template renders the tools, and qwen25 parses "auto".
    srv = LiveServer("--model-path", str(make_tiny_model("qwen2")), "--chat-template", "chatml",
                     "--served-model-name", MODEL, "--max-total-tokens", "8192", log_dir=tmp_path_factory.mktemp("tools"),
                     startup_timeout=180)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tiny_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_function_calling_round_trip(client: openai.OpenAI) -> None:
    model = MODEL
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                           tool_choice=named, max_tokens=64, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    _valid_call(choice.message.tool_calls[0])
    call = choice.message.tool_calls[0]
    # The same request streamed: the same call, in OpenAI's delta order.
    content, calls, finish = _streamed(client, model=model, messages=ASK, tools=TOOLS,
                                       tool_choice=named, max_tokens=64, temperature=0)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)]
    # The call's result goes back as a tool message, and the model answers.
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    second = client.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                            max_tokens=8, temperature=0)  # "auto"
    answer = second.choices[0]
    assert answer.message.tool_calls is None and isinstance(answer.message.content, str)
    assert answer.finish_reason in ("stop", "length")
    # The tools and the history (the call and its result) were rendered into the prompt.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_required_gives_valid_calls_streamed_or_not(client: openai.OpenAI) -> None:
    # A random model, forced into the call array, makes a handful of calls before it closes it.
    for parallel in (True, False):
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400,
            temperature=0, parallel_tool_calls=parallel)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and all(map(_valid_call, choice.message.tool_calls))
        assert parallel or len(choice.message.tool_calls) == 1
        assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)
        if parallel:
            continue  # streaming is compared on the shorter, single-call reply
        content, calls, finish = _streamed(
            client, model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
            max_tokens=400, temperature=0, parallel_tool_calls=parallel)
        assert finish == "tool_calls" and not content
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_auto_reads_the_call_the_model_writes(client: openai.OpenAI) -> None:
    """Under "auto" the server's parser (qwen25, the Qwen family's) turns the model's
    <tool_call> markup into tool_calls; SGLang's regex makes the random model write it."""
    written = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Lima", "days": 2}}\n</tool_call>')
    kwargs: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                  temperature=0, extra_body={"regex": re.escape(written)})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = [(c.function.name, _valid_call(c)) for c in choice.message.tool_calls]
    assert calls == [("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Lima", "days": 2})]
    content, streamed, finish = _streamed(client, **kwargs)
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls
    # parallel_tool_calls false: the first call only.
    one = client.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_time"]


def test_auto_and_none(client: openai.OpenAI) -> None:
    """Under "auto" the parser reads the reply (a random model writes text); streamed and not
    agree. "none" keeps the tools out of the prompt."""
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=12,
                                         temperature=0)
    choice = out.choices[0]
    content, calls, finish = _streamed(client, model=MODEL, messages=ASK, tools=TOOLS,
                                       max_tokens=12, temperature=0)
    assert (content or None, finish) == (choice.message.content, choice.finish_reason)
    assert calls == [] and choice.message.tool_calls is None
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                          tool_choice="none", max_tokens=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < out.usage.prompt_tokens


@pytest.mark.parametrize("changes,message", [
    ({"tools": [{"type": "function", "function": {"parameters": WEATHER_SCHEMA}}]},
     "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "parameters is not a JSON schema"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_stock"}}},
     "'get_stock' is not among tools"),
    ({"tools": None, "tool_choice": "required"}, "'required' needs tools"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{tz"}}]}]},
     "arguments must be a JSON object"),
    # Nested past the interpreter's stack: a 400 as well (json.loads raised RecursionError: 500).
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_time", "arguments": "[" * 5000 + "]" * 5000}}]}]},
     "arguments must be a JSON object"),
])
def test_bad_tool_input_is_400(client: openai.OpenAI, changes: dict, message: str) -> None:
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **changes}
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(**{k: v for k, v in body.items() if v is not None})
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1).choices


# ---------------------------------------------------------------------------------------------
# Gemma 3 270M, named (a family with no call format of its own)


@pytest.fixture(scope="module")
def real_client(real_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.mark.real_model
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_time"}}])
def test_forced_calls_on_the_real_model_validate(real_client: openai.OpenAI,
                                                 tool_choice: Any) -> None:
    out = real_client.chat.completions.create(
        model=real_client.models.list().data[0].id, messages=[{"role": "user", "content": "What time is it in Berlin?"}],
        tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=60,
        temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1
    _valid_call(choice.message.tool_calls[0])
    if isinstance(tool_choice, dict):
        assert choice.message.tool_calls[0].function.name == "get_time"


@pytest.mark.real_model
def test_auto_without_a_parser_names_the_flag(real_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        real_client.chat.completions.create(model=real_client.models.list().data[0].id, messages=ASK, tools=TOOLS, max_tokens=4)

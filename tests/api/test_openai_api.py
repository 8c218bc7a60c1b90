"""The official `openai` client against a live server on Gemma 3 270M (named, not the default).

Generations are kept to a few tokens: on a small CPU every token of the real model costs."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import requests
from transformers import AutoTokenizer

from lockstep.testing.live_server import LiveServer

pytestmark = pytest.mark.real_model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(real_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tok(real_server: LiveServer):
    info = requests.get(real_server.url + "/get_model_info", timeout=30).json()
    return AutoTokenizer.from_pretrained(Path(info["tokenizer_path"]))


def test_models_list(client, real_server):
    models = client.models.list().data
    assert len(models) == 1 and models[0].object == "model" and models[0].id
    assert client.models.retrieve(models[0].id).id == models[0].id


def test_completion_plain_and_usage(client, model, tok):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.index == 0 and choice.text
    assert choice.finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == len(tok(PROMPT).input_ids)  # with <bos>
    n_out = len(tok(choice.text, add_special_tokens=False).input_ids)
    if choice.finish_reason == "length":
        assert out.usage.completion_tokens == 6
    assert abs(out.usage.completion_tokens - n_out) <= 1  # re-tokenizing may merge differently
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # The same greedy generation over the native API: same text, same token count.
    native = requests.post(out_url(client) + "/generate", json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
        timeout=300).json()
    assert native["text"] == choice.text
    assert native["meta_info"]["completion_tokens"] == out.usage.completion_tokens


def out_url(client: openai.OpenAI) -> str:
    return str(client.base_url).rstrip("/").removesuffix("/v1")


def test_completion_n2_and_batch(client, model, tok):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=2,
                                    temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == len(tok(PROMPT).input_ids)  # the prompt counts once
    batch = client.completions.create(model=model, prompt=[PROMPT, "1, 2, 3,"], max_tokens=3,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in batch.choices) == [0, 1]
    assert batch.usage.completion_tokens == 6
    assert batch.usage.prompt_tokens == len(tok(PROMPT).input_ids) + len(tok("1, 2, 3,").input_ids)


def test_completion_stop(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    text = full.choices[0].text
    words = text.split()
    assert len(words) >= 2, text
    stop = " " + words[1]
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_completion_logprobs(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert out.usage.completion_tokens == 4
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy picks the top-1
        assert top.get(token, logprob) == pytest.approx(logprob, abs=1e-4)


def test_completion_echo(client, model, tok):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                    echo=True)
    assert out.choices[0].text.startswith(PROMPT) and len(out.choices[0].text) > len(PROMPT)
    with_lp = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                        echo=True, logprobs=1)
    lp = with_lp.choices[0].logprobs
    n_prompt = len(tok(PROMPT).input_ids)
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert with_lp.choices[0].text == out.choices[0].text


def test_completion_stream(client, model):
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()


def _gemma_prompt(messages: list[dict]) -> str:
    """Gemma's official chat format, written out here as an independent oracle."""
    out = "<bos>"
    for m in messages:
        role = "model" if m["role"] == "assistant" else m["role"]
        out += f"<start_of_turn>{role}\n{m['content'].strip()}<end_of_turn>\n"
    return out + "<start_of_turn>model\n"


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_plain_and_usage(client, model, tok):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6,
                                         temperature=0, user="test-user")
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content is not None and choice.finish_reason in ("stop", "length")
    expected = len(tok(_gemma_prompt(MESSAGES), add_special_tokens=False).input_ids)
    assert out.usage.prompt_tokens == expected
    assert 0 < out.usage.completion_tokens <= 6
    assert out.usage.total_tokens == expected + out.usage.completion_tokens


def test_chat_stream(client, model):
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_seed_reproducible_at_temperature(client, model):
    def sample(seed: int) -> str:
        return client.completions.create(model=model, prompt="My favourite animal is",
                                         max_tokens=4, temperature=0.8, seed=seed).choices[0].text

    first, again = sample(1234), sample(1234)
    assert first == again
    assert len({first, sample(1), sample(2)}) > 1  # the seed matters


def test_openai_errors(client, model):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="a", max_tokens=1)
    assert "no-such-model" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="a", max_tokens=1, temperature=-1)
    assert "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[], max_tokens=1)

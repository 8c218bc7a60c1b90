"""The server a new user starts (`lockstep serve`, no flags) serves SmolLM2-135M-Instruct, renders
chats with the GGUF's own template, and answers a plain question sensibly."""

from __future__ import annotations

import gguf
import jinja2
import openai
import pytest
import requests

from lockstep.model_loader.packaged import DEFAULT_MODEL, PACKAGED_MODELS
from lockstep.testing.live_server import LiveServer

pytestmark = pytest.mark.real_model
QUESTION = "What is the capital of France? Answer in one sentence."


def reader_token_id(reader: gguf.GGUFReader, token: str) -> int:
    return reader.fields["tokenizer.ggml.tokens"].contents().index(token)


@pytest.fixture(scope="module")
def client(default_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def test_default_model_identity(default_server):
    info = requests.get(default_server.url + "/server_info", timeout=30).json()
    assert info["served_model_name"] == DEFAULT_MODEL == "smollm2-135m-instruct"
    assert info["model_path"] == str(PACKAGED_MODELS[DEFAULT_MODEL].path())
    model = requests.get(default_server.url + "/model_info", timeout=30).json()
    assert model["model_type"] == "llama"
    assert requests.get(default_server.url + "/v1/models", timeout=30).json()["data"][0]["id"] \
        == DEFAULT_MODEL


def test_the_chat_prompt_is_the_ggufs_own_template(client, default_server):
    """The prompt the server builds is the GGUF's `tokenizer.chat_template` rendered (read here
    with gguf and jinja2, not through lockstep): SmolLM2's ChatML with its default system turn."""
    reader = gguf.GGUFReader(PACKAGED_MODELS[DEFAULT_MODEL].path())
    template = reader.fields["tokenizer.chat_template"].contents()
    assert "<|im_start|>" in template
    messages = [{"role": "user", "content": QUESTION}]
    prompt = jinja2.Environment().from_string(template).render(messages=messages,
                                                                add_generation_prompt=True)
    tokens = requests.post(default_server.url + "/tokenize", json={"prompt": prompt},
                           timeout=30).json()["tokens"]
    out = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=1,
                                         temperature=0)
    assert out.usage.prompt_tokens == len(tokens)
    assert tokens[0] == reader_token_id(reader, "<|im_start|>")  # no <bos> before the template's


def test_the_default_model_answers_a_chat_question(client):
    out = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": QUESTION}], max_tokens=60,
        temperature=0)
    answer = out.choices[0].message.content
    assert "Paris" in answer, answer
    assert out.choices[0].finish_reason == "stop", answer  # one sentence, then its end of turn


def test_the_default_model_streams_an_answer(client):
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
        max_tokens=40, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 3 and "4" in "".join(pieces), pieces


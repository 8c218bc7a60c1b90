"""Reasoning models: --reasoning-parser splits the thinking block into `reasoning_content`,
complete and streamed (stream_reasoning, separate_reasoning as SGLang defines them);
chat_template_kwargs reach the chat template (Qwen3's enable_thinking); tool calls after the
block still parse.

The live tests serve a tiny random-weight Qwen3 under a Qwen3-style template (a `<think>` block
that enable_thinking false closes in the prompt); its output is random, so a regex constraint
forces the reply whose split is checked."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from lockstep.entrypoints.openai.reasoning_parser import (
    REASONING_PARSERS,
    ReasoningParser,
    reasoning_format,
)
from lockstep.testing.live_server import LiveServer
from lockstep.testing.tiers import marks
from lockstep.testing.tiny_models import make_tiny_model

QWEN3 = reasoning_format("qwen3")


def streamed(parser: ReasoningParser, text: str, step: int) -> tuple[str, str, list]:
    pieces = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)]
    pieces.append(parser.finish())
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces), pieces


# ---------------------------------------------------------------------------------------------
# The parser


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("text", [
    "<think>\nabc</think>\n\nhello", "<think>abc", "hello", "<thin", "", "  <think>a</think>",
    "a</thin", "abc<tool_call>\n{}\n</tool_call>", "<think>a<b</think>c</think>d"])
def test_stream_cut_anywhere_equals_parse(text, inside):
    whole = ReasoningParser(QWEN3, inside).parse(text)
    for step in (1, 2, 3, 7):
        for stream_reasoning in (True, False):
            r, c, _ = streamed(ReasoningParser(QWEN3, inside, stream_reasoning), text, step)
            assert ((r or None), c) == whole, (text, step, stream_reasoning)


def test_split_rules():
    parse = ReasoningParser(QWEN3, inside=False).parse
    assert parse("<think>\nabc</think>\n\nhello") == ("\nabc", "\n\nhello")
    assert parse("hello <think>x</think>") == (None, "hello <think>x</think>")  # not at the start
    assert parse("<think>cut off by max_tokens") == ("cut off by max_tokens", "")
    forced = ReasoningParser(QWEN3, inside=True).parse
    assert forced("abc</think>hello") == ("abc", "hello")  # the prompt opened the block
    assert forced("<think>abc</think>hello") == ("abc", "hello")
    # Qwen3 may open a tool call without closing the block: the call stays in content
    assert forced("plan<tool_call>{}") == ("plan", "<tool_call>{}")
    r1 = reasoning_format("deepseek-r1")
    assert ReasoningParser(r1, r1.starts_inside(None, "")).parse("abc</think>x") == ("abc", "x")
    kimi = ReasoningParser(REASONING_PARSERS["kimi"], False).parse
    assert kimi("◁think▷a◁/think▷b") == ("a", "b")


def test_markers_never_leak_into_a_delta():
    _, _, pieces = streamed(ReasoningParser(QWEN3, False), "<think>ab</think>cd", 1)
    for r, c in pieces:
        assert not ({"<", "/", ">"} & set(r + c)), pieces
    _, _, pieces = streamed(ReasoningParser(QWEN3, False, stream_reasoning=False),
                           "<think>abc</think>d", 1)
    assert [p for p in pieces if p[0]] == [("abc", "")]  # one piece when the block ends


def test_when_a_reply_starts_inside():
    assert QWEN3.starts_inside(None, "...assistant\n")  # Qwen3 thinks unless told not to
    assert not QWEN3.starts_inside({"enable_thinking": False}, "...assistant\n")
    kimi = REASONING_PARSERS["kimi"]
    assert not kimi.starts_inside(None, "x") and kimi.starts_inside(None, "x ◁think▷\n")
    assert reasoning_format("deepseek-r1").starts_inside({"enable_thinking": False}, "")
    with pytest.raises(ValueError, match="qwen3"):
        reasoning_format("qwen4")


# ---------------------------------------------------------------------------------------------
# A live server

# ChatML with Qwen3's switch: enable_thinking false closes an empty block in the prompt.
QWEN3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def literal(text: str) -> str:
    """`text` as a regex that matches only it (llguidance's syntax: escape only metacharacters)."""
    return "".join("\\" + ch if ch in "\\.^$|?*+()[]{}" else ch for ch in text)


@pytest.fixture(scope="module")
@marks("server")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    logs = tmp_path_factory.mktemp("reasoning")
    template = Path(logs) / "qwen3.jinja"
    template.write_text(QWEN3_TEMPLATE)
    srv = LiveServer("--model-path", str(make_tiny_model("qwen3")), "--chat-template",
                     str(template), "--reasoning-parser", "qwen3", "--max-total-tokens", "8192",
                     log_dir=logs, startup_timeout=180)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def chat(client: openai.OpenAI, forced: str, **body):
    return client.chat.completions.create(
        model="default", messages=ASK, max_tokens=80, extra_body={"regex": literal(forced),
                                                                   **body.pop("extra", {})},
        **body)


def stream_parts(client: openai.OpenAI, forced: str, **body) -> tuple[list[str], str, list]:
    reasoning, content, calls = [], "", []
    for chunk in chat(client, forced, stream=True, **body):
        for choice in chunk.choices:
            delta = choice.delta
            if getattr(delta, "reasoning_content", None):
                reasoning.append(delta.reasoning_content)
            content += delta.content or ""
            calls += delta.tool_calls or []
    return reasoning, content, calls


def test_reasoning_content_in_reply_and_stream(client):
    reply = chat(client, "<think>abc</think>hello")
    msg = reply.choices[0].message
    assert (msg.reasoning_content, msg.content) == ("abc", "hello")
    assert reply.choices[0].finish_reason == "stop"
    reasoning, content, _ = stream_parts(client, "<think>abc</think>hello")
    assert ("".join(reasoning), content) == ("abc", "hello")
    # stream_reasoning false: the whole block in one delta, once it has ended
    reasoning, content, _ = stream_parts(client, "<think>abcdef</think>hi",
                                         extra={"stream_reasoning": False})
    assert (reasoning, content) == (["abcdef"], "hi")


def test_separate_reasoning_false_keeps_it_in_content(client):
    msg = chat(client, "<think>abc</think>hello", extra={"separate_reasoning": False})
    assert msg.choices[0].message.content == "<think>abc</think>hello"
    assert getattr(msg.choices[0].message, "reasoning_content", None) is None
    reasoning, content, _ = stream_parts(client, "<think>abc</think>hello",
                                         extra={"separate_reasoning": False})
    assert (reasoning, content) == ([], "<think>abc</think>hello")


def test_enable_thinking_reaches_the_template(client):
    on = chat(client, "abc</think>hello")
    off = chat(client, "hello", extra={"chat_template_kwargs": {"enable_thinking": False}})
    # Thinking (Qwen3's default): the reply starts inside the block without writing <think>.
    assert (on.choices[0].message.reasoning_content, on.choices[0].message.content) == (
        "abc", "hello")
    # Off: the template closed an empty block in the prompt; the reply is all content.
    assert off.choices[0].message.content == "hello"
    assert off.choices[0].message.reasoning_content is None
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


def test_tool_call_after_reasoning(client):
    forced = ('<think>need the weather</think>\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    reply = chat(client, forced, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.message.reasoning_content == "need the weather"
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    reasoning, content, calls = stream_parts(client, forced, tools=TOOLS)
    assert "".join(reasoning) == "need the weather" and not content.strip()
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(c.function.arguments for c in calls)) == {"city": "Paris"}


def test_json_constrained_reply_is_content(client):
    """Qwen3 thinks by default, but a JSON constraint holds from the first token: the reply is
    the JSON, not a reasoning block that never ends."""
    short = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
             "required": ["city"]}  # the random model's string ends within max_tokens
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": short}}
    reply = client.chat.completions.create(model="default", messages=ASK, max_tokens=60,
                                           response_format=fmt)
    msg = reply.choices[0].message
    assert msg.reasoning_content is None and json.loads(msg.content).keys() == {"city"}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": short}}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model="default", messages=ASK, max_tokens=60,
                                           tools=tools, tool_choice=named)
    [call] = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments).keys() == {"city"}


def test_bad_chat_template_kwargs_are_400(client):
    for kwargs, words in (({"tokenize": True}, "tokenize"), ([1], "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="default", messages=ASK, max_tokens=4,
                                           extra_body={"chat_template_kwargs": kwargs})
        assert words in str(err.value)

"""Tool calling: tools rendered into the prompt the way each family was trained, and the
OpenAI function-calling flow against a live server."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from lockstep.entrypoints.chat_templates import (
    BUILTIN_CHAT_TEMPLATES,
    ChatTemplateError,
    render_chat,
)
from lockstep.entrypoints.tool_calls import (
    ToolCallStream,
    ToolRequestError,
    finish_reason,
    plan_tools,
    template_message,
)

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
    out = render_chat(BUILTIN_CHAT_TEMPLATES["chatml"], HISTORY, tools=[WEATHER])
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
    out = render_chat(BUILTIN_CHAT_TEMPLATES["llama3"], HISTORY, tools=[WEATHER],
                      bos_token="<|begin_of_text|>")
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
    out = render_chat(BUILTIN_CHAT_TEMPLATES["gemma"], HISTORY, tools=[WEATHER],
                      bos_token="<bos>")
    assert out.startswith("<bos><start_of_turn>user\nBe brief.\n\nYou have access to functions.")
    assert f"[\n{WEATHER_JSON}\n]\n\nWeather in Paris and Oslo?<end_of_turn>\n" in out
    assert out.endswith(
        '<start_of_turn>model\n[get_weather(city="Paris"), get_weather(city="Oslo", '
        'metric=True)]<end_of_turn>\n<start_of_turn>user\n```tool_output\n{"temp": 20}\n```\n'
        "```tool_output\n-3\n```<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match="alternate"):
        render_chat(BUILTIN_CHAT_TEMPLATES["gemma"], HISTORY[:2] + HISTORY[1:2], tools=[WEATHER])


@pytest.mark.parametrize("name", sorted(BUILTIN_CHAT_TEMPLATES))
def test_without_tools_the_templates_are_unchanged(name: str) -> None:
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
             {"role": "user", "content": "Bye"}]
    template = BUILTIN_CHAT_TEMPLATES[name]
    assert render_chat(template, plain, tools=None) == render_chat(template, plain, tools=[])
    assert "function" not in render_chat(template, plain)


@pytest.mark.parametrize("name", sorted(BUILTIN_CHAT_TEMPLATES))
def test_builtins_render_the_same_under_transformers(name: str, tiny_model_dirs: dict) -> None:
    """transformers' apply_chat_template is the oracle for the template environment."""
    tok = PreTrainedTokenizerFast.from_pretrained(tiny_model_dirs["qwen2"])
    template = BUILTIN_CHAT_TEMPLATES[name]
    ours = render_chat(template, HISTORY, tools=[WEATHER], bos_token=tok.bos_token)
    theirs = tok.apply_chat_template(HISTORY, tools=[WEATHER], chat_template=template,
                                     tokenize=False, add_generation_prompt=True)
    assert ours == theirs


# ---------------------------------------------------------------------------------------------
# Checking tools and tool_choice (the route turns ToolRequestError into a 400)


def _tool(name: str, parameters: dict | None = None) -> dict:
    function: dict = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


@pytest.mark.parametrize("tools,choice,parser,message", [
    ([{"type": "function", "function": {"description": "x"}}], "auto", "qwen25",
     r"tools\[0\]\.function\.name is required"),
    ([_tool("f", {"type": "object", "properties": []})], "auto", "qwen25",
     r"tools\[0\]\.function\.parameters is not a JSON schema"),
    ([_tool("f", {"type": "bogus"})], "auto", "qwen25", "not a JSON schema"),
    ([_tool("f", "a string")], "auto", "qwen25", "parameters must be a JSON schema object"),
    ([_tool("f", {"type": "string"})], "auto", "qwen25", "must describe an object"),
    ([_tool("f"), _tool("f")], "auto", "qwen25", "'f' is given twice"),
    ([{"type": "retrieval"}], "auto", "qwen25", r"tools\[0\]\.type must be 'function'"),
    ([_tool("f")], {"type": "function", "function": {"name": "g"}}, "qwen25",
     r"'g' is not among tools \(f\)"),
    (None, "required", "qwen25", "tool_choice 'required' needs tools"),
    ([], {"type": "function", "function": {"name": "g"}}, "qwen25", "no tools are given"),
    ([_tool("f")], "auto", None, "--tool-call-parser"),
    ([_tool("f")], None, None, "--tool-call-parser"),
    ([_tool("f")], "sometimes", "qwen25", "tool_choice must be"),
])
def test_bad_tool_requests_name_the_problem(tools, choice, parser, message) -> None:
    with pytest.raises(ToolRequestError, match=message):
        plan_tools(tools, choice, None, parser)


def test_plans() -> None:
    assert plan_tools([_tool("f")], "none", None, None) is None  # no tools reach the model
    assert plan_tools(None, "auto", None, None) is None
    plan = plan_tools([_tool("f", {"type": "object", "properties": {"a": {"type": "integer"}}}),
                       _tool("g")], "required", False, None)
    assert plan is not None and plan.mode == "required" and not plan.parallel
    schema = json.loads(plan.json_schema() or "")
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [
        {"const": "f"}, {"const": "g"}]
    assert schema["items"]["anyOf"][1]["properties"]["arguments"] == {
        "type": "object", "properties": {}}
    named = plan_tools([_tool("f", {"type": "object"})], {"type": "function",
                                                           "function": {"name": "f"}}, None, None)
    assert named is not None and json.loads(named.json_schema() or "") == {"type": "object"}
    auto = plan_tools([_tool("f")], "auto", None, "llama3")
    assert auto is not None and auto.json_schema() is None and auto.parser_name == "llama3"


def test_stream_deltas_have_openai_shape_and_respect_parallel_false() -> None:
    plan = plan_tools([_tool("f"), _tool("g")], "auto", False, "qwen25")
    assert plan is not None
    stream = ToolCallStream(plan)
    content, calls = stream.feed('Hi<tool_call>{"name": "f", "arguments": {"a"')
    assert content == "Hi"
    assert calls == [{"index": 0, "id": calls[0]["id"], "type": "function",
                      "function": {"name": "f", "arguments": '{"a"'}}]
    content, calls = stream.feed(': 1}}</tool_call><tool_call>{"name": "g", "arguments": {}}'
                                 "</tool_call>")
    assert (content, calls) == ("", [{"index": 0, "function": {"arguments": ": 1}"}}])
    assert stream.finish() == ("", []) and stream.has_calls
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length"


def test_history_arguments_become_objects_for_templates() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    out = template_message(2, {"role": "assistant", "content": None, "tool_calls": [call]})
    assert out["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    bad = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}
    with pytest.raises(ToolRequestError,
                       match=r"messages\[2\]\.tool_calls\[0\]\.function\.arguments must be"):
        template_message(2, {"role": "assistant", "tool_calls": [bad]})

"""The built-in chat templates, one per family lockstep serves, tools included.

Each reproduces its family's official format: without tools exactly as before, and with `tools`
(OpenAI's {"type": "function", "function": {...}} objects, as transformers passes them) the way
the family's instruct models were trained to see them, including assistant turns that made calls
(`tool_calls`, with arguments as objects) and the `tool` messages that answer them.
"""

from __future__ import annotations

# Gemma has no system role: the official template puts the system text at the top of the first
# user turn, separated by a blank line, and strips each turn's content. Gemma 3 has no tool
# tokens; Google's function-calling guide for it puts the functions in the first user turn and
# asks for a Python list of calls, which is what lockstep's `pythonic` parser reads. Tool results
# go back in a user turn as ```tool_output blocks, as in that guide.
_GEMMA = r"""
{%- macro py(v) -%}
  {%- if v is true -%}True{%- elif v is false -%}False{%- elif v is none -%}None
  {%- else -%}{{- v | tojson -}}{%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set ns = namespace(prefix="", turns=messages, last="model", open=false) -%}
{%- if messages and messages[0].role == "system" -%}
  {%- set ns.prefix = messages[0].content ~ "\n\n" -%}
  {%- set ns.turns = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
  {%- set ns.prefix = ns.prefix ~ "You have access to functions. If you decide to invoke any of the function(s), you MUST put it in the format of\n[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n\nYou SHOULD NOT include any other text in the response if you call a function\n[\n" -%}
  {%- for tool in tools -%}
    {%- set ns.prefix = ns.prefix ~ (tool | tojson) ~ ("\n" if loop.last else ",\n") -%}
  {%- endfor -%}
  {%- set ns.prefix = ns.prefix ~ "]\n\n" -%}
{%- endif -%}
{%- for m in ns.turns -%}
  {%- if m.role == "tool" and ns.open -%}
    {{- "\n```tool_output\n" ~ (m.content | trim) ~ "\n```" -}}
  {%- else -%}
    {%- if ns.open -%}{{- "<end_of_turn>\n" -}}{%- set ns.open = false -%}{%- endif -%}
    {%- set role = "model" if m.role == "assistant" else ("user" if m.role == "tool" else m.role) -%}
    {%- if (role == "user") == (ns.last == "user") -%}
      {{- raise_exception("Conversation roles must alternate user/assistant/user/assistant/... after an optional system message") -}}
    {%- endif -%}
    {{- "<start_of_turn>" ~ role ~ "\n" -}}
    {%- if loop.first -%}{{- ns.prefix -}}{%- endif -%}
    {%- if m.role == "tool" -%}
      {{- "```tool_output\n" ~ (m.content | trim) ~ "\n```" -}}
      {%- set ns.open = true -%}
    {%- else -%}
      {{- m.content | trim -}}
      {%- if m.role == "assistant" and m.tool_calls -%}
        {{- ("\n" if m.content | trim else "") ~ "[" -}}
        {%- for tc in m.tool_calls -%}
          {%- set f = tc.function if tc.function is defined else tc -%}
          {{- f.name ~ "(" -}}
          {%- for k, v in f.arguments.items() -%}
            {{- k ~ "=" ~ py(v) ~ ("" if loop.last else ", ") -}}
          {%- endfor -%}
          {{- ")" ~ ("" if loop.last else ", ") -}}
        {%- endfor -%}
        {{- "]" -}}
      {%- endif -%}
      {{- "<end_of_turn>\n" -}}
    {%- endif -%}
    {%- set ns.last = role -%}
  {%- endif -%}
{%- endfor -%}
{%- if ns.open -%}{{- "<end_of_turn>\n" -}}{%- endif -%}
{%- if add_generation_prompt -%}
  {{- "<start_of_turn>model\n" -}}
{%- endif -%}
"""

# Llama 3 (Instruct) format; the BOS comes with the first message, contents are stripped. With
# tools, Llama 3.1's JSON tool format: an ipython environment in the system turn, the functions
# (JSON, indent 4) in the first user turn, calls as {"name": ..., "parameters": ...} and results
# in ipython turns.
_LLAMA3 = r"""
{%- set ns = namespace(turns=messages, system="") -%}
{%- if tools -%}
  {%- if messages and messages[0].role == "system" -%}
    {%- set ns.system = messages[0].content | trim -%}
    {%- set ns.turns = messages[1:] -%}
  {%- endif -%}
  {%- if not ns.turns or ns.turns[0].role != "user" -%}
    {{- raise_exception("with tools, the conversation must start with a user message (after an optional system message)") -}}
  {%- endif -%}
  {{- bos_token ~ "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" ~ ns.system ~ "<|eot_id|>" -}}
  {{- "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n" -}}
  {%- for tool in tools -%}
    {{- (tool | tojson(indent=4)) ~ "\n\n" -}}
  {%- endfor -%}
  {{- (ns.turns[0].content | trim) ~ "<|eot_id|>" -}}
  {%- set ns.turns = ns.turns[1:] -%}
{%- endif -%}
{%- for m in ns.turns -%}
  {%- if loop.first and not tools -%}{{- bos_token -}}{%- endif -%}
  {%- if m.role == "assistant" and m.tool_calls -%}
    {{- "<|start_header_id|>assistant<|end_header_id|>\n\n" -}}
    {%- for tc in m.tool_calls -%}
      {%- set f = tc.function if tc.function is defined else tc -%}
      {{- "{\"name\": \"" ~ f.name ~ "\", \"parameters\": " ~ (f.arguments | tojson) ~ "}" ~ ("" if loop.last else "; ") -}}
    {%- endfor -%}
    {{- "<|eot_id|>" -}}
  {%- elif m.role == "tool" or m.role == "ipython" -%}
    {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" ~ (m.content | trim) ~ "<|eot_id|>" -}}
  {%- else -%}
    {{- "<|start_header_id|>" ~ m.role ~ "<|end_header_id|>\n\n" ~ (m.content | trim) ~ "<|eot_id|>" -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- "<|start_header_id|>assistant<|end_header_id|>\n\n" -}}
{%- endif -%}
"""

# ChatML as Qwen uses it; content is kept verbatim. With tools, Qwen3's (and Qwen2.5's, less its
# default system line) format: the functions inside <tools></tools> in the system turn, calls in
# <tool_call></tool_call> tags, results as <tool_response> blocks in a user turn.
_CHATML = r"""
{%- if tools -%}
  {{- "<|im_start|>system\n" -}}
  {%- if messages and messages[0].role == "system" -%}{{- messages[0].content ~ "\n\n" -}}{%- endif -%}
  {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" -}}
  {%- for tool in tools -%}
    {{- "\n" ~ (tool | tojson) -}}
  {%- endfor -%}
  {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == "system" and loop.first and tools -%}
  {%- elif m.role == "assistant" and m.tool_calls -%}
    {{- "<|im_start|>assistant\n" ~ m.content -}}
    {%- for tc in m.tool_calls -%}
      {%- set f = tc.function if tc.function is defined else tc -%}
      {%- if m.content or not loop.first -%}{{- "\n" -}}{%- endif -%}
      {{- "<tool_call>\n{\"name\": \"" ~ f.name ~ "\", \"arguments\": " ~ (f.arguments if f.arguments is string else (f.arguments | tojson)) ~ "}\n</tool_call>" -}}
    {%- endfor -%}
    {{- "<|im_end|>\n" -}}
  {%- elif m.role == "tool" -%}
    {%- if loop.first or messages[loop.index0 - 1].role != "tool" -%}{{- "<|im_start|>user" -}}{%- endif -%}
    {{- "\n<tool_response>\n" ~ m.content ~ "\n</tool_response>" -}}
    {%- if loop.last or messages[loop.index0 + 1].role != "tool" -%}{{- "<|im_end|>\n" -}}{%- endif -%}
  {%- else -%}
    {{- "<|im_start|>" ~ m.role ~ "\n" ~ m.content ~ "<|im_end|>\n" -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- "<|im_start|>assistant\n" -}}
{%- endif -%}
"""

BUILTIN_CHAT_TEMPLATES: dict[str, str] = {"gemma": _GEMMA, "llama3": _LLAMA3, "chatml": _CHATML}

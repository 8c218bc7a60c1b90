"""The tool-calling part of /v1/chat/completions: checking `tools` and `tool_choice`, what the
prompt and the sampler get, and turning the generated text into `tool_calls`.

`tool_choice` "auto" lets the model choose and the server's parser (--tool-call-parser, or the
model family's format) reads its reply. "required" and a named function are forced by a JSON
schema on the output (the structured-output machinery), in a format of lockstep's own that the
schema fixes: an array of {"name", "arguments"} calls, or the named function's arguments object
alone. "none" keeps the tools out of the prompt altogether.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema_rs

from lockstep.function_call import TOOL_CALL_PARSERS, ToolCallParser, make_parser
from lockstep.function_call.core import ParseResult, StreamDelta
from lockstep.function_call.forced import CallArrayParser, NamedArgumentsParser

# OpenAI's rule for function names.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolRequestError(ValueError):
    """A tools / tool_choice / message problem the client must fix (a 400 naming it)."""


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["auto", "required", "named"]
    tools: tuple[dict[str, Any], ...]  # as the chat template receives them
    parameters: Mapping[str, dict[str, Any]]  # by function name
    parallel: bool
    forced_name: str | None = None
    parser_name: str | None = None  # "auto" only

    @property
    def names(self) -> list[str]:
        return list(self.parameters)

    def json_schema(self) -> str | None:
        """The output constraint that forces a call, or None under "auto"."""
        if self.mode == "named" and self.forced_name is not None:
            return json.dumps(self.parameters[self.forced_name])
        if self.mode == "required":
            calls = [{"type": "object", "additionalProperties": False,
                      "properties": {"name": {"const": name}, "arguments": schema},
                      "required": ["name", "arguments"]}
                     for name, schema in self.parameters.items()]
            array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                array["maxItems"] = 1
            return json.dumps(array)
        return None

    def new_parser(self) -> ToolCallParser:
        if self.mode == "named" and self.forced_name is not None:
            return NamedArgumentsParser([self.forced_name])
        if self.mode == "required":
            return CallArrayParser(self.names)
        return make_parser(self.parser_name or "", self.names)


def plan_tools(tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               parser_name: str | None) -> ToolPlan | None:
    """Checks a request's tool fields; None when no tools reach the model. ToolRequestError
    names what is wrong."""
    checked = [_check_tool(i, t) for i, t in enumerate(tools or [])]
    parameters: dict[str, dict[str, Any]] = {}
    for tool in checked:
        name = tool["function"]["name"]
        if name in parameters:
            raise ToolRequestError(f"tools: the function name {name!r} is given twice")
        parameters[name] = tool["function"].get("parameters") or _EMPTY_PARAMETERS
    mode, forced = _check_choice(tool_choice, bool(checked))
    if mode == "none" or not checked:
        return None
    if mode == "named" and forced not in parameters:
        raise ToolRequestError(
            f"tool_choice: the function {forced!r} is not among tools ({', '.join(parameters)})")
    if mode == "auto" and parser_name is None:
        raise ToolRequestError(
            "tool_choice 'auto' needs a tool-call parser, and this model's family has no default "
            "one: start the server with --tool-call-parser "
            f"({', '.join(sorted(TOOL_CALL_PARSERS))}), or use tool_choice 'required' or a "
            "named function, which need none")
    return ToolPlan(mode=mode, tools=tuple(checked), parameters=parameters,
                    parallel=parallel_tool_calls is not False, forced_name=forced,
                    parser_name=parser_name if mode == "auto" else None)


def _check_tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping):
        raise ToolRequestError(f"{where} must be an object")
    if tool.get("type") != "function":
        raise ToolRequestError(f"{where}.type must be 'function'")
    if set(tool) - {"type", "function"}:
        raise ToolRequestError(f"{where}: unknown fields {sorted(set(tool) - {'type', 'function'})}")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ToolRequestError(f"{where}.function must be an object")
    unknown = set(function) - _FUNCTION_KEYS
    if unknown:
        raise ToolRequestError(f"{where}.function: unknown fields {sorted(unknown)}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ToolRequestError(f"{where}.function.name is required")
    if not _NAME.fullmatch(name):
        raise ToolRequestError(
            f"{where}.function.name {name!r} must be 1-64 letters, digits, '_' or '-'")
    if not isinstance(function.get("description", ""), str):
        raise ToolRequestError(f"{where}.function.description must be a string")
    if function.get("strict"):
        raise ToolRequestError(
            f"{where}.function.strict is not supported; tool_choice 'required' or a named "
            "function forces the arguments to match the schema")
    out: dict[str, Any] = {"name": name}
    if function.get("description"):
        out["description"] = function["description"]
    if function.get("parameters") is not None:
        out["parameters"] = _check_parameters(where, function["parameters"])
    return {"type": "function", "function": out}


def _check_parameters(where: str, parameters: Any) -> dict[str, Any]:
    if not isinstance(parameters, Mapping):
        raise ToolRequestError(f"{where}.function.parameters must be a JSON schema object")
    try:
        jsonschema_rs.meta.validate(dict(parameters))
    except (jsonschema_rs.ValidationError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ToolRequestError(f"{where}.function.parameters is not a JSON schema: {first}") from None
    if parameters.get("type", "object") != "object":
        raise ToolRequestError(f"{where}.function.parameters must describe an object "
                               f"(type 'object'), not {parameters.get('type')!r}")
    return dict(parameters)


def _check_choice(choice: Any, have_tools: bool
                  ) -> tuple[Literal["none", "auto", "required", "named"], str | None]:
    if choice is None:
        return ("auto" if have_tools else "none"), None
    if choice in ("none", "auto"):
        return choice, None
    if choice == "required":
        if not have_tools:
            raise ToolRequestError("tool_choice 'required' needs tools")
        return "required", None
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ToolRequestError("tool_choice.function.name is required")
        if not have_tools:
            raise ToolRequestError(f"tool_choice names the function {name!r}, but no tools are given")
        return "named", name
    raise ToolRequestError("tool_choice must be 'none', 'auto', 'required' or "
                           '{"type": "function", "function": {"name": ...}}')


# ---------------------------------------------------------------------------------------------
# Messages


def template_message(i: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as chat templates expect it: tool-call arguments as objects, not JSON text."""
    out = dict(message)
    calls = message.get("tool_calls")
    if calls is None:
        out.pop("tool_calls", None)
        return out
    if message.get("role") != "assistant":
        raise ToolRequestError(f"messages[{i}].tool_calls: only assistant messages make calls")
    converted = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ToolRequestError(f"{where}.function.name is required")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                arguments = None
        if not isinstance(arguments, Mapping):
            raise ToolRequestError(f"{where}.function.arguments must be a JSON object")
        converted.append({**call, "function": {**function, "arguments": dict(arguments)}})
    out["tool_calls"] = converted
    return out


# ---------------------------------------------------------------------------------------------
# Output


def openai_tool_calls(result: ParseResult, limit: int | None) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in result.calls[:limit]]


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """A reply that ends in calls finishes with "tool_calls" (a cut-off one stays "length")."""
    return "tool_calls" if has_calls and reason == "stop" else reason


class ToolCallStream:
    """One choice's stream through its parser: content deltas and OpenAI tool_call deltas."""

    def __init__(self, plan: ToolPlan) -> None:
        self.parser = plan.new_parser()
        self.limit = None if plan.parallel else 1
        self.has_calls = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return self._shape(self.parser.feed(text) if text else StreamDelta())

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._shape(self.parser.finish())

    def _shape(self, delta: StreamDelta) -> tuple[str, list[dict[str, Any]]]:
        out = []
        for c in delta.calls:
            if self.limit is not None and c.index >= self.limit:
                continue  # parallel_tool_calls false: only the first call counts
            self.has_calls = True
            item: dict[str, Any] = {"index": c.index}
            if c.id is not None:
                item.update(id=c.id, type="function",
                            function={"name": c.name, "arguments": c.arguments})
            else:
                item["function"] = {"arguments": c.arguments}
            out.append(item)
        return delta.content, out

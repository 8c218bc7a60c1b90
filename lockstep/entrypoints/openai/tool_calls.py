"""The tool-calling part of /v1/chat/completions: checking `tools` and `tool_choice`, what the
prompt and the sampler get, and the generated text as `tool_calls`. Under "auto" the server's
parser (--tool-call-parser, or the family's format) reads the reply; "required" and a named
function are forced by a JSON schema on the output (an array of {"name", "arguments"} calls, or
the named function's arguments alone); "none" keeps the tools out of the prompt."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema_rs

from lockstep.constrained.constraint import Constraint, ConstraintError, validate_constraint
from lockstep.entrypoints.openai.protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from lockstep.function_call.core import StreamDelta, ToolCallParser
from lockstep.function_call.forced import CallArrayParser, NamedArgumentsParser
from lockstep.function_call.registry import TOOL_CALL_PARSERS, make_parser

# A function without parameters takes an empty object (the grammar allows no keys at all).
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                     "additionalProperties": False}


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
            return json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": calls},
                               **({} if self.parallel else {"maxItems": 1})})
        return None

    def new_parser(self) -> ToolCallParser:
        if self.mode == "named" and self.forced_name is not None:
            return NamedArgumentsParser([self.forced_name])
        if self.mode == "required":
            return CallArrayParser(self.names)
        return make_parser(self.parser_name or "", self.names)


def plan_tools(tools: Sequence[Tool] | None, tool_choice: str | NamedToolChoice | None,
               parallel_tool_calls: bool | None, parser_name: str | None) -> ToolPlan | None:
    """Checks a request's tools and tool_choice together (their shapes are already checked);
    None when no tools reach the model. ToolRequestError names what is wrong."""
    parameters: dict[str, dict[str, Any]] = {}
    rendered = []
    for i, tool in enumerate(tools or []):
        f = tool.function
        if f.name in parameters:
            raise ToolRequestError(f"tools: the function name {f.name!r} is given twice")
        if f.parameters is not None:
            _check_parameters(f"tools[{i}].function.parameters", f.parameters)
        parameters[f.name] = f.parameters if f.parameters is not None else _EMPTY_PARAMETERS
        rendered.append({"type": "function", "function": f.model_dump(
            exclude_none=True, exclude={"strict"})})
    mode, forced = _check_choice(tool_choice, bool(parameters))
    if mode == "none" or not parameters:
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
    plan = ToolPlan(mode=mode, tools=tuple(rendered), parameters=parameters,
                    parallel=parallel_tool_calls is not False, forced_name=forced,
                    parser_name=parser_name if mode == "auto" else None)
    if (schema := plan.json_schema()) is not None:
        try:
            validate_constraint(Constraint("json_schema", schema))
        except ConstraintError as e:
            what = f"the function {forced!r}" if forced else "'required'"
            raise ToolRequestError(
                f"tool_choice {what} forces the arguments to match the parameters schema, and "
                f"this one cannot be enforced: {e}") from None
    return plan


def _check_parameters(where: str, parameters: dict[str, Any]) -> None:
    try:
        jsonschema_rs.meta.validate(parameters)
    except (jsonschema_rs.ValidationError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ToolRequestError(f"{where} is not a JSON schema: {first}") from None
    if parameters.get("type", "object") != "object":
        raise ToolRequestError(f"{where} must describe an object (type 'object'), "
                               f"not {parameters.get('type')!r}")


def _check_choice(choice: str | NamedToolChoice | None, have_tools: bool
                  ) -> tuple[Literal["none", "auto", "required", "named"], str | None]:
    if choice is None:
        return ("auto" if have_tools else "none"), None
    if isinstance(choice, NamedToolChoice):
        if not have_tools:
            raise ToolRequestError(
                f"tool_choice names the function {choice.function.name!r}, but no tools are given")
        return "named", choice.function.name
    if choice == "required" and not have_tools:
        raise ToolRequestError("tool_choice 'required' needs tools")
    return choice, None  # type: ignore[return-value]


def template_message(i: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as chat templates expect it: tool-call arguments as objects, not JSON text."""
    if not (calls := message.get("tool_calls")):
        return dict(message)
    converted = []
    for j, call in enumerate(calls):
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"] or "{}")
        except (ValueError, RecursionError):  # RecursionError: nested past the interpreter's stack
            arguments = None
        if not isinstance(arguments, dict):
            raise ToolRequestError(
                f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")
        converted.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": converted}


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """A reply that ends in calls finishes with "tool_calls" (a cut-off one stays "length")."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def complete_reply(plan: ToolPlan | None, text: str, reason: str | None
                   ) -> tuple[str | None, list[ToolCall] | None, str | None]:
    """A whole reply: its content, its calls (None without any) and its finish reason."""
    if plan is None:
        return text, None, reason
    result = plan.new_parser().parse(text)
    calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in result.calls[:None if plan.parallel else 1]]
    if not calls:
        return text, None, reason
    return result.content, calls, finish_reason(reason, True)


class ToolCallStream:
    """One choice's stream through its parser: content deltas and OpenAI tool_call deltas."""

    def __init__(self, plan: ToolPlan) -> None:
        self.parser = plan.new_parser()
        self.limit = None if plan.parallel else 1
        self.has_calls = False

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        return self._shape(self.parser.feed(text) if text else StreamDelta())

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        return self._shape(self.parser.finish())

    def _shape(self, delta: StreamDelta) -> tuple[str, list[DeltaToolCall]]:
        out = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id is not None else None,
                             function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
               for c in delta.calls  # parallel_tool_calls false: only the first call counts
               if self.limit is None or c.index < self.limit]
        self.has_calls = self.has_calls or bool(out)
        return delta.content, out

"""A Responses request as the chat completion lockstep already serves, and a chat choice as
Responses output items: the one place that maps the two APIs onto each other, so the route
runs the chat path (template, tool-call parsing, grammars, reasoning parser) and no copy of it.

Items are kept as JSON objects (what the store holds and /input_items lists), each with an id."""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from lockstep.entrypoints.errors import format_validation_error
from lockstep.entrypoints.openai.protocol import ChatCompletionChoice, ChatCompletionRequest
from lockstep.entrypoints.openai.responses.protocol import (
    FunctionTool,
    IncompleteDetails,
    NamedFunctionChoice,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputTextPart,
    ResponsesRequest,
    Status,
    TextFormatJsonObject,
    TextFormatJsonSchema,
)
from lockstep.entrypoints.tokenizer_manager import RequestError

Item = dict[str, Any]

# The id prefixes OpenAI gives each kind.
PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
          "reasoning": "rs", "response": "resp"}


def new_id(kind: str) -> str:
    return f"{PREFIX[kind]}_{uuid.uuid4().hex}"


def input_items(req: ResponsesRequest) -> list[Item]:
    """The request's input as items with ids (a string input is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "id": new_id("message"), "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": req.input}]}]
    items = []
    for item in req.input:
        data = item.model_dump(mode="json", by_alias=True, exclude_none=True)
        data.setdefault("id", new_id(data["type"]))
        items.append(data)
    return items


def _text(content: str | Sequence[Item]) -> str:
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def chat_messages(instructions: str | None, items: Sequence[Item]) -> list[dict[str, Any]]:
    """Chat messages for the conversation `items`: a function_call joins the assistant turn
    before it (one turn, several calls); reasoning items stay out, as chat templates leave out
    the thinking of earlier turns."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item["output"])})
    return messages


def _tool_choice(choice: str | NamedFunctionChoice | None) -> Any:
    if isinstance(choice, NamedFunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, TextFormatJsonObject):
        return {"type": "json_object"}
    if isinstance(fmt, TextFormatJsonSchema):
        spec = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description}
        return {"type": "json_schema",
                "json_schema": {k: v for k, v in spec.items() if v is not None}}
    return None


def chat_request(req: ResponsesRequest, items: Sequence[Item], stream: bool
                 ) -> ChatCompletionRequest:
    """The chat completion that serves `req` over the whole conversation `items`; a 400 (named
    as the chat route names it) for what that request refuses."""
    tools = [{"type": "function", "function": t.model_dump(
        exclude_none=True, exclude={"type", "strict"})} for t in req.tools
        if isinstance(t, FunctionTool)]
    effort = req.reasoning.effort if req.reasoning is not None else None
    body: dict[str, Any] = {
        "model": req.model, "messages": chat_messages(req.instructions, items), "stream": stream,
        "temperature": req.temperature, "top_p": req.top_p,
        "max_completion_tokens": req.max_output_tokens, "tools": tools or None,
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls if tools else None,
        "response_format": _response_format(req), "user": req.user,
        "chat_template_kwargs": {"reasoning_effort": effort} if effort is not None else None,
        "top_k": req.top_k, "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
        "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
        "stop": req.stop or None,
    }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise renamed(RequestError(format_validation_error(e))) from None


# The chat request's names for what a Responses request calls otherwise: a 400 raised on the
# chat path names the field the client sent.
_FIELD_NAMES = (("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"),
                ("messages", "input"))


def renamed(error: RequestError) -> RequestError:
    message = str(error)
    for chat, ours in _FIELD_NAMES:
        message = re.sub(rf"\b{chat}\b", ours, message)
    return RequestError(message, error.status)


def status_of(finish: str | None) -> tuple[Status, IncompleteDetails | None]:
    """A response's status from the chat finish reason: cut by the token limit is incomplete."""
    if finish == "length":
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    if finish == "abort":
        return "failed", None
    return "completed", None


def output_items(choice: ChatCompletionChoice) -> list[OutputItem]:
    """A finished chat choice as output items, in the order a stream sends them: reasoning,
    the message, the function calls. A reply of calls only has no message; a reply cut off by
    the token limit has its last item incomplete (the one the stream was in when cut)."""
    msg = choice.message
    items: list[OutputItem] = []
    if msg.reasoning_content:
        items.append(OutputReasoning(id=new_id("reasoning"), status="completed", content=[
            {"type": "reasoning_text", "text": msg.reasoning_content}]))
    if msg.content or not msg.tool_calls:
        items.append(OutputMessage(id=new_id("message"), status="completed",
                                   content=[OutputTextPart(text=msg.content or "")]))
    for call in msg.tool_calls or []:
        items.append(OutputFunctionCall(id=new_id("function_call"), call_id=call.id,
                                        name=call.function.name,
                                        arguments=call.function.arguments, status="completed"))
    if status_of(choice.finish_reason)[0] == "incomplete":
        items[-1] = items[-1].model_copy(update={"status": "incomplete"})
    return items


def output_text(items: Sequence[OutputItem]) -> str:
    return "".join(part.text for item in items if isinstance(item, OutputMessage)
                   for part in item.content)

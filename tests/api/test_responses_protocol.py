"""/v1/responses without a server: the request's checks (a 400 naming what lockstep does not
do), the translation to a chat completion, the stream's events assembled by the openai SDK's
own ResponseStreamState into the items the non-streaming reply has, and the store's bounds,
owners and atomic persistence."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from lockstep.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from lockstep.entrypoints.openai.responses.events import EventStream
from lockstep.entrypoints.openai.responses.protocol import ResponseObject, ResponsesRequest
from lockstep.entrypoints.openai.responses.store import ResponseStore, StoredResponse
from lockstep.entrypoints.openai.responses.translate import (
    chat_messages,
    chat_request,
    input_items,
    output_items,
    renamed,
)
from lockstep.entrypoints.tokenizer_manager import RequestError

TOOL = {"type": "function", "name": "get_weather", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "Hi", **fields})


# ---------------------------------------------------------------------------------------------
# The request


@pytest.mark.parametrize(("fields", "named"), [
    ({"background": True}, "background"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"prompt_cache_key": "k"}, "prompt_cache_key"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"no_such_field": 1}, "no_such_field"),
])
def test_unserved_fields_are_refused_by_name(fields, named):
    with pytest.raises(ValidationError) as err:
        request(**fields)
    assert named in str(err.value), err.value


def test_defaults_clients_send_are_accepted():
    req = request(background=False, service_tier="auto", top_logprobs=0, truncation="disabled",
                  include=[], store=False, metadata={"k": "v"}, reasoning={"effort": "low"})
    assert req.store is False and req.metadata == {"k": "v"}


def test_conversation_becomes_chat_messages():
    req = request(instructions="Be brief.", input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Wea"},
                                                        {"type": "input_text", "text": "ther?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ])
    items = input_items(req)
    assert all(item["id"] for item in items)
    assert chat_messages(req.instructions, items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]


def test_chat_request_carries_tools_format_and_limits():
    req = request(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
                  max_output_tokens=7, temperature=0, top_k=5,
                  text={"format": {"type": "json_schema", "name": "w",
                                   "schema": {"type": "object"}}})
    chat = chat_request(req, input_items(req), stream=False)
    assert chat.max_completion_tokens == 7 and chat.temperature == 0 and chat.top_k == 5
    assert chat.tools[0].function.name == "get_weather"
    assert chat.tool_choice.function.name == "get_weather"
    assert chat.response_format.json_schema.name == "w"


# ---------------------------------------------------------------------------------------------
# The stream assembles the non-streaming reply


def _delta(**fields: Any) -> ChatCompletionStreamChoice:
    return ChatCompletionStreamChoice(index=0, delta=DeltaMessage(**fields))


CALL_DELTAS = [
    DeltaToolCall(index=0, id="call_a", type="function",
                  function=DeltaFunctionCall(name="get_weather", arguments='{"city": ')),
    DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='"Paris"}')),
    DeltaToolCall(index=1, id="call_b", type="function",
                  function=DeltaFunctionCall(name="get_weather", arguments='{"city": "Rome"}')),
]
CASES = {
    "text": ([_delta(content="Hel"), _delta(content="lo")],
             ChatResponseMessage(content="Hello"), "stop"),
    "reasoning then text": (
        [_delta(reasoning_content="think"), _delta(reasoning_content="ing"), _delta(content="ok")],
        ChatResponseMessage(reasoning_content="thinking", content="ok"), "stop"),
    "calls": ([_delta(tool_calls=CALL_DELTAS[:2]), _delta(tool_calls=CALL_DELTAS[2:])],
              ChatResponseMessage(content="", tool_calls=[
                  ToolCall(id="call_a", function=FunctionCall(
                      name="get_weather", arguments='{"city": "Paris"}')),
                  ToolCall(id="call_b", function=FunctionCall(
                      name="get_weather", arguments='{"city": "Rome"}'))]), "tool_calls"),
    "nothing": ([], ChatResponseMessage(content=""), "stop"),
    "reasoning cut off": ([_delta(reasoning_content="hmm")],
                          ChatResponseMessage(reasoning_content="hmm", content=""), "length"),
}


def _without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


@pytest.mark.parametrize("case", list(CASES))
def test_stream_events_assemble_the_whole_reply(case):
    deltas, message, finish = CASES[case]
    base = ResponseObject(id="resp_1", created_at=0, model="m", status="in_progress",
                          parallel_tool_calls=True, store=True, temperature=1, top_p=1,
                          text={"format": {"type": "text"}}, tool_choice="auto", tools=[])
    whole = output_items(ChatCompletionChoice(index=0, message=message, finish_reason=finish))
    stream = EventStream(base)
    events = stream.start()
    for d in deltas:
        events += stream.feed(d)
    status = "incomplete" if finish == "length" else "completed"
    events += stream.finish(status)
    done = base.model_copy(update={"status": status, "output": stream.items})
    events.append(stream.final(done))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert _without_ids([i.model_dump(mode="json") for i in stream.items]) == _without_ids(
        [i.model_dump(mode="json") for i in whole])
    # The openai SDK's own assembly of the events (what responses.stream() runs).
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        state.handle_event(adapter.validate_python(event))
    if status == "completed":
        final = state._completed_response
        assert final is not None
        assert _without_ids([o.model_dump(mode="json", exclude_none=True) for o in final.output]) \
            == _without_ids([i.model_dump(mode="json", exclude_none=True) for i in whole])
    assert events[-1]["type"] == f"response.{status}"


# ---------------------------------------------------------------------------------------------
# The store


def _stored(rid: str, text: str = "x") -> StoredResponse:
    return StoredResponse({"id": rid, "output": [{"type": "message", "content": text}]},
                          [{"type": "message", "id": f"m{rid}", "role": "user", "content": "q"}])


def test_store_evicts_oldest_by_count_and_says_so():
    store = ResponseStore(max_items=2, max_bytes=1 << 20)
    for rid in ("a", "b", "c"):
        store.put("", _stored(rid))
    assert len(store) == 2 and store.get("", "c").response["id"] == "c"
    with pytest.raises(RequestError, match="was evicted") as err:
        store.get("", "a")
    assert err.value.status == 404
    with pytest.raises(RequestError, match="No response with id 'zz'"):
        store.get("", "zz")
    assert store.conversation("", "b") == [*_stored("b").items, *_stored("b").response["output"]]


def test_store_evicts_oldest_by_bytes():
    one = len(json.dumps({"owner": "", **_stored("a", "y" * 100).__dict__}))
    store = ResponseStore(max_items=100, max_bytes=int(one * 2.5))
    for rid in ("a", "b", "c", "d"):
        store.put("", _stored(rid, "y" * 100))
    assert len(store) == 2 and store.bytes <= store.max_bytes
    with pytest.raises(RequestError, match="evicted"):
        store.get("", "b")
    store.get("", "d")


def test_store_keeps_owners_apart():
    store = ResponseStore(max_items=10, max_bytes=1 << 20)
    store.put("key-1", _stored("a"))
    with pytest.raises(RequestError) as err:
        store.get("key-2", "a")
    assert err.value.status == 404
    with pytest.raises(RequestError):
        store.delete("key-2", "a")
    store.delete("key-1", "a")
    with pytest.raises(RequestError):
        store.get("key-1", "a")


def test_store_persists_atomically(tmp_path, monkeypatch):
    path = tmp_path / "store.json"
    store = ResponseStore(max_items=10, max_bytes=1 << 20, path=path)
    store.put("o", _stored("a"))
    store.write(store.snapshot())
    assert ResponseStore(10, 1 << 20, path).get("o", "a") == _stored("a")
    # A crash between writing the temporary file and replacing: the old file is whole.
    store.put("o", _stored("b"))

    def crash(*_args: Any) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        store.write(store.snapshot())
    monkeypatch.undo()
    reloaded = ResponseStore(10, 1 << 20, path)
    assert len(reloaded) == 1 and reloaded.get("o", "a") == _stored("a")
    # Writes finishing out of order: the older snapshot never replaces the newer file.
    older = store.snapshot()
    store.put("o", _stored("c"))
    store.write(store.snapshot())
    store.write(older)
    assert len(ResponseStore(10, 1 << 20, path)) == 3
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        ResponseStore(10, 1 << 20, path)


def test_chat_path_errors_name_the_responses_fields():
    error = renamed(RequestError("a forced tool call cannot be combined with response_format; "
                                 "max_completion_tokens too large; messages: bad", 400))
    assert str(error) == ("a forced tool call cannot be combined with text.format; "
                          "max_output_tokens too large; input: bad")
    assert error.status == 400


def test_each_api_key_has_its_own_store_owner():
    from types import SimpleNamespace

    from starlette.requests import Request

    from lockstep.entrypoints.openai.responses.serving import owner_of

    def owner(key: str | None, header: str) -> str:
        scope = {"type": "http", "headers": [(b"authorization", header.encode())]}
        return owner_of(Request(scope), SimpleNamespace(api_key=key))  # type: ignore[arg-type]

    assert owner(None, "Bearer a") == owner(None, "") == ""  # no key: one store
    assert owner("a", "Bearer a") != owner("a", "Bearer b")
    key = "sk-secret-key"
    assert owner(key, f"Bearer {key}") == owner(key, f"Bearer {key}")
    assert key not in owner(key, f"Bearer {key}")  # the store never holds the key itself

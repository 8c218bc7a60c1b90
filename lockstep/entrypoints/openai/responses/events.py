"""A streamed response: the chat stream's delta choices as the Responses event sequence, each
event numbered (sequence_number), so that a client assembling them (the openai SDK's
`responses.stream`) gets the items the non-streaming call returns, in the same order: a
reasoning item, the message, the function calls (output_items in translate.py)."""

from __future__ import annotations

from typing import Any

from lockstep.entrypoints.openai.protocol import ChatCompletionStreamChoice
from lockstep.entrypoints.openai.responses.protocol import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputTextPart,
    ResponseObject,
    Status,
)
from lockstep.entrypoints.openai.responses.translate import new_id

Event = dict[str, Any]


class _Open:
    """The output item being streamed: its place, what it has so far."""

    def __init__(self, index: int, item: OutputItem) -> None:
        self.index = index
        self.item = item
        self.text = ""  # the message's or reasoning's text, or the call's arguments


class EventStream:
    """Turns delta choices into events; `items` is the output so far (finished items)."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response  # status "in_progress", no output yet
        self.items: list[OutputItem] = []
        self._seq = 0
        self._open: _Open | None = None

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return self.response.model_dump(mode="json")

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def feed(self, choice: ChatCompletionStreamChoice) -> list[Event]:
        delta = choice.delta
        events: list[Event] = []
        if delta.reasoning_content:
            events += self._text_delta("reasoning", delta.reasoning_content)
        if delta.content:
            events += self._text_delta("message", delta.content)
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call's first delta: a new item
                events += self._close("completed")
                item = OutputFunctionCall(id=new_id("function_call"), call_id=call.id,
                                          name=call.function.name or "", arguments="",
                                          status="in_progress")
                events += self._add(item)[1]
            if call.function.arguments and self._open is not None:
                self._open.text += call.function.arguments
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=self._open.item.id,
                                          output_index=self._open.index,
                                          delta=call.function.arguments))
        return events

    def finish(self, status: Status) -> list[Event]:
        """Close the open item. A reply with neither text nor calls still gets its (empty)
        message, as the non-streaming reply does."""
        kinds = {item.type for item in self.items} | (
            {self._open.item.type} if self._open is not None else set())
        events = self._text_delta("message", "") if kinds <= {"reasoning"} else []
        item_status: Status = "incomplete" if status == "incomplete" else "completed"
        return events + self._close(item_status)

    def final(self, response: ResponseObject) -> Event:
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response.status, "response.failed")
        return self._event(kind, response=response.model_dump(mode="json"))

    def _add(self, item: OutputItem) -> tuple[_Open, list[Event]]:
        self._open = _Open(len(self.items), item)
        return self._open, [self._event("response.output_item.added", output_index=self._open.index,
                                        item=item.model_dump(mode="json"))]

    def _text_delta(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        current = self._open
        if current is None or current.item.type != kind:
            events += self._close("completed")
            item: OutputItem
            if kind == "reasoning":
                item = OutputReasoning(id=new_id("reasoning"), status="in_progress", content=[])
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = OutputMessage(id=new_id("message"), status="in_progress", content=[])
                part = OutputTextPart(text="").model_dump(mode="json")
            current, added = self._add(item)
            events += added
            events.append(self._event("response.content_part.added", item_id=item.id,
                                      output_index=current.index, content_index=0, part=part))
        current.text += text
        if text:
            extra = {"logprobs": []} if kind == "message" else {}
            events.append(self._event(f"response.{_TEXT[kind]}.delta", item_id=current.item.id,
                                      output_index=current.index, content_index=0, delta=text,
                                      **extra))
        return events

    def _close(self, status: Status) -> list[Event]:
        current, self._open = self._open, None
        if current is None:
            return []
        where = {"item_id": current.item.id, "output_index": current.index}
        events: list[Event] = []
        item = current.item
        if isinstance(item, OutputFunctionCall):
            item = item.model_copy(update={"arguments": current.text, "status": status})
            events.append(self._event("response.function_call_arguments.done",
                                      arguments=current.text, **where))
        elif isinstance(item, OutputMessage):
            part = OutputTextPart(text=current.text)
            item = item.model_copy(update={"content": [part], "status": status})
            events.append(self._event("response.output_text.done", content_index=0,
                                      text=current.text, logprobs=[], **where))
            events.append(self._event("response.content_part.done", content_index=0,
                                      part=part.model_dump(mode="json"), **where))
        else:
            part_dict = {"type": "reasoning_text", "text": current.text}
            item = item.model_copy(update={"content": [part_dict], "status": status})
            events.append(self._event("response.reasoning_text.done", content_index=0,
                                      text=current.text, **where))
            events.append(self._event("response.content_part.done", content_index=0,
                                      part=part_dict, **where))
        self.items.append(item)
        events.append(self._event("response.output_item.done", output_index=current.index,
                                  item=item.model_dump(mode="json")))
        return events


_TEXT = {"message": "output_text", "reasoning": "reasoning_text"}

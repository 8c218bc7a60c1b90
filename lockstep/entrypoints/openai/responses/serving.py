"""/v1/responses' work: the request becomes a chat completion (translate.py) run by
OpenAIServing's chat path, its choice becomes output items (or, streamed, events: events.py),
and with store true the response and its conversation are kept (store.py)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lockstep.entrypoints.fanout import Fanout, run_to_completion, start_stream
from lockstep.entrypoints.openai.protocol import ChatCompletionChoice, UsageInfo
from lockstep.entrypoints.openai.responses.events import EventStream
from lockstep.entrypoints.openai.responses.protocol import (
    InputItemList,
    InputTokensDetails,
    OutputItem,
    OutputReasoning,
    OutputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from lockstep.entrypoints.openai.responses.store import ResponseStore, StoredResponse
from lockstep.entrypoints.openai.responses.translate import (
    Item,
    chat_request,
    input_items,
    new_id,
    output_items,
    output_text,
    renamed,
    status_of,
)
from lockstep.entrypoints.openai.serving import ChatRun, OpenAIServing, usage_of
from lockstep.entrypoints.tokenizer_manager import GenerateOutput, RequestError
from lockstep.server_args import ServerArgs
from lockstep.utils.asgi import SSEResponse
from lockstep.utils.http import json_response, sse


def owner_of(request: Request, args: ServerArgs) -> str:
    """Whose store a request reads: the API key's (hashed, never kept), or everyone's when the
    server has no key."""
    if not args.api_key:
        return ""
    given = request.headers.get("authorization", "")
    return hashlib.sha256(given.encode()).hexdigest()[:32]


class ResponsesServing:
    def __init__(self, openai: OpenAIServing, args: ServerArgs) -> None:
        self.openai = openai
        path = Path(args.responses_store_file) if args.responses_store_file else None
        self.store = ResponseStore(args.responses_store_max_items,
                                   args.responses_store_max_bytes, path)

    async def create(self, req: ResponsesRequest, request: Request, owner: str) -> Response:
        history = (self.store.conversation(owner, req.previous_response_id)
                   if req.previous_response_id else [])
        items = [*history, *input_items(req)]
        try:
            run = await self.openai.prepare_chat(chat_request(req, items, req.stream))
        except RequestError as e:  # the chat path's 400, in this API's field names
            raise renamed(e) from None
        base = self._in_progress(req)
        if req.stream:
            fan = await start_stream(self.openai.tm, run.singles, request)
            return SSEResponse(self._stream(fan, run, req, base, items, owner))
        finals = await run_to_completion(self.openai.tm, run.singles, request)
        choice: ChatCompletionChoice = run.whole(0, finals[0])
        done = self._finished(base, output_items(choice), choice.finish_reason,
                              usage_of(run.singles, finals))
        await self._keep(req, done, items, owner)
        return json_response(done.model_dump(mode="json"))

    def get(self, response_id: str, owner: str) -> dict[str, Any]:
        return self.store.get(owner, response_id).response

    async def delete(self, response_id: str, owner: str) -> None:
        self.store.delete(owner, response_id)
        await self._persist()

    def input_items(self, response_id: str, owner: str, limit: int, order: str,
                    after: str | None) -> InputItemList:
        items = self.store.get(owner, response_id).items
        ordered = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item.get("id") for item in ordered]
            ordered = ordered[ids.index(after) + 1:] if after in ids else []
        page = ordered[:limit]
        return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                             last_id=page[-1]["id"] if page else None,
                             has_more=len(ordered) > limit)

    def _in_progress(self, req: ResponsesRequest) -> ResponseObject:
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        choice = req.tool_choice
        return ResponseObject(
            id=new_id("response"), created_at=time.time(), model=self.openai.model_name,
            status="in_progress", instructions=req.instructions,
            max_output_tokens=req.max_output_tokens, metadata=req.metadata or {},
            parallel_tool_calls=req.parallel_tool_calls,
            previous_response_id=req.previous_response_id,
            reasoning=req.reasoning.model_dump(exclude_none=True) if req.reasoning else None,
            store=req.store, temperature=req.temperature, top_p=req.top_p,
            text={"format": fmt.model_dump(mode="json", by_alias=True, exclude_none=True)
                  if fmt is not None else {"type": "text"}},
            tool_choice=(choice.model_dump() if choice is not None and not isinstance(choice, str)
                         else choice or "auto"),
            tools=[t.model_dump(mode="json", exclude_none=True) for t in req.tools],
            user=req.user, safety_identifier=req.safety_identifier)

    def _finished(self, base: ResponseObject, items: Sequence[OutputItem], finish: str | None,
                  usage: UsageInfo) -> ResponseObject:
        status, incomplete = status_of(finish)
        reasoning = "".join(part["text"] for item in items if isinstance(item, OutputReasoning)
                            for part in item.content)
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return base.model_copy(update={
            "status": status, "output": list(items), "output_text": output_text(items),
            "completed_at": time.time() if status == "completed" else None,
            "incomplete_details": incomplete,
            "error": ResponseError(code="server_error", message="the request was aborted")
            if status == "failed" else None,
            "usage": ResponseUsage(
                input_tokens=usage.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=cached),
                output_tokens=usage.completion_tokens,
                # The reasoning block's tokens, counted by tokenizing its text again.
                output_tokens_details=OutputTokensDetails(reasoning_tokens=len(
                    self.openai.tm.tokenizer.encode(reasoning, add_special_tokens=False))
                    if reasoning else 0),
                total_tokens=usage.total_tokens)})

    async def _stream(self, fan: Fanout, run: ChatRun, req: ResponsesRequest,
                      base: ResponseObject, items: list[Item], owner: str
                      ) -> AsyncIterator[bytes]:
        events = EventStream(base)
        finals: list[GenerateOutput | None] = [None]
        finish: str | None = None
        try:
            for event in events.start():
                yield sse(event)
            async for index, item in fan.items():
                finals[index] = item
                for choice in run.step(index, item):
                    finish = choice.finish_reason or finish
                    for event in events.feed(choice):
                        yield sse(event)
            status, _ = status_of(finish)
            for event in events.finish(status):
                yield sse(event)
            done = self._finished(base, events.items, finish, usage_of(run.singles, finals))
            await self._keep(req, done, items, owner)
            yield sse(events.final(done))
        finally:
            fan.close()

    async def _keep(self, req: ResponsesRequest, done: ResponseObject, items: list[Item],
                    owner: str) -> None:
        if req.store:
            self.store.put(owner, StoredResponse(done.model_dump(mode="json"), items))
            await self._persist()

    async def _persist(self) -> None:
        if self.store.path is not None:
            await asyncio.to_thread(self.store.write, self.store.snapshot())

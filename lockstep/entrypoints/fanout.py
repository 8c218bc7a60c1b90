"""Running the single requests one HTTP request (or Engine call) fans out into (prompts x n): at
once, outputs in arrival order, after every request's first output, so a refused request becomes
a 4xx before any 200 or stream starts; closing the Fanout aborts what still runs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from lockstep.core import FINISH_ABORT
from lockstep.entrypoints.tokenizer_manager import GenerateOutput, RequestError, TokenizerManager
from lockstep.messages import TokenizedGenerateReq
from lockstep.utils.asgi import unless_disconnected


def raise_if_refused(item: GenerateOutput) -> None:
    """The scheduler refuses a request it can never serve with an abort carrying a status code:
    a RequestError with that status."""
    reason = item.finish_reason
    if isinstance(reason, FINISH_ABORT) and reason.status_code:
        raise RequestError(reason.message, reason.status_code)


class Fanout:
    """`start()` returns once every request produced its first output (RequestError if one was
    refused); `items()` then yields (index, output). Always `close()` it (safe when cancelled)."""

    def __init__(self, tm: TokenizerManager, singles: list[TokenizedGenerateReq]) -> None:
        self.tm = tm
        self.singles = singles
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.buffer: list[tuple[int, GenerateOutput]] = []
        self.open = len(singles)

    async def _pump(self, index: int, single: TokenizedGenerateReq) -> None:
        err = None
        try:
            async with contextlib.aclosing(self.tm.generate(single)) as gen:
                async for item in gen:
                    self.queue.put_nowait((index, item, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            err = e
        self.queue.put_nowait((index, None, err))

    async def _next(self) -> tuple[int, GenerateOutput | None]:
        """The next output; None when that request has ended. Raises what a request raised."""
        index, item, err = await self.queue.get()
        if err is not None:
            raise err
        if item is None:
            self.open -= 1
        return index, item

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._pump(i, s)) for i, s in enumerate(self.singles)]
        waiting = set(range(len(self.singles)))
        try:
            while waiting:
                index, item = await self._next()
                waiting.discard(index)
                if item is None:  # ended without output: cannot happen, but never hang on it
                    continue
                raise_if_refused(item)
                self.buffer.append((index, item))
        except BaseException:
            self.close()
            raise

    async def items(self) -> AsyncIterator[tuple[int, GenerateOutput]]:
        buffered, self.buffer = self.buffer, []
        for entry in buffered:
            yield entry
        while self.open:
            index, item = await self._next()
            if item is not None:
                yield index, item

    async def collect(self) -> list[GenerateOutput]:
        """The last output of every request, by index (non-streaming)."""
        finals: list[GenerateOutput | None] = [None] * len(self.singles)
        async for index, item in self.items():
            finals[index] = item
        if missing := [i for i, f in enumerate(finals) if f is None]:
            raise RuntimeError(f"requests {missing} ended without output")
        return finals  # type: ignore[return-value]

    def close(self) -> None:
        for task in self.tasks:
            if not task.done():
                task.cancel()


async def run_to_completion(tm: TokenizerManager, singles: list[TokenizedGenerateReq],
                            request: Request | None) -> list[GenerateOutput]:
    """Non-streaming: every request's final output; a refused request raises RequestError, a
    disconnected client raises starlette's ClientDisconnect (its requests are aborted)."""
    fan = Fanout(tm, singles)

    async def run() -> list[GenerateOutput]:
        await fan.start()
        return await fan.collect()

    try:
        finals = await (unless_disconnected(request.receive, run()) if request else run())
    finally:
        fan.close()
    for item in finals:
        raise_if_refused(item)
    return finals


async def start_stream(tm: TokenizerManager, singles: list[TokenizedGenerateReq],
                       request: Request | None) -> Fanout:
    """Streaming: a started Fanout (errors are raised here, before any byte is sent)."""
    fan = Fanout(tm, singles)
    await (unless_disconnected(request.receive, fan.start()) if request else fan.start())
    return fan


def sglang_output(item: GenerateOutput) -> dict[str, Any]:
    """SGLang's output of /generate and the Engine: the text and ids so far, and meta_info."""
    return {"text": item.text, "output_ids": item.output_ids, "meta_info": item.meta_info()}


async def sglang_chunks(fan: Fanout, incremental: bool, many: bool
                        ) -> AsyncIterator[dict[str, Any]]:
    """A stream of SGLang outputs (HTTP's and the Engine's), each with `index` in a batch; with
    `incremental`, each holds only what it adds. Closes the fan."""
    sent: list[dict[str, int]] = [{} for _ in fan.singles]
    try:
        async for index, item in fan.items():
            out = sglang_output(item)
            if incremental:
                out.update(text=item.text_delta, output_ids=item.new_token_ids,
                           meta_info=meta_delta(out["meta_info"], sent[index]))
            if many:
                out["index"] = index
            yield out
    finally:
        fan.close()


def meta_delta(meta: dict[str, Any], sent: dict[str, int]) -> dict[str, Any]:
    """Incremental streaming: each logprob list holds only what is new since the last event."""
    for key, value in meta.items():
        if key.endswith("_logprobs"):
            meta[key], sent[key] = value[sent.get(key, 0):], len(value)
    return meta

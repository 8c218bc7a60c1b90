"""The offline `Engine` and the one launch path it shares with the HTTP server.

`launch_subprocesses` starts one scheduler process per (pp_rank, tp_rank) on this node, then the
detokenizer; waits for each to report ready over its Pipe; then builds the TokenizerManager in
this process. A watchdog thread brings everything down if any child dies.

`Engine`: the server's processes and API, without HTTP.

    import lockstep

    if __name__ == "__main__":  # the scheduler processes are spawned: guard the entry point
        with lockstep.Engine(model_path=...) as engine:
            print(engine.generate("The capital of France is", {"max_new_tokens": 8})["text"])

It starts the same processes as `lockstep serve` (the shared launch path) and runs the
TokenizerManager on a private asyncio loop in a background thread, so `generate` works from
plain synchronous code and `async_generate` from any event loop. Outputs are SGLang's dicts:
{"text", "output_ids", "meta_info"}; a list for a list of prompts (or n > 1). Streaming yields
the same dicts, each carrying the whole text so far (only what each adds with
incremental_streaming_output=True, as the HTTP stream does); a batch stream adds "index"."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import pydantic

from lockstep.configs.model_config import ModelConfig
from lockstep.core import FINISH_ABORT
from lockstep.detokenizer.detokenizer_manager import run_detokenizer_process
from lockstep.detokenizer.incremental_detokenizer import load_tokenizer
from lockstep.entrypoints.errors import format_validation_error
from lockstep.entrypoints.fanout import (
    run_to_completion,
    sglang_chunks,
    sglang_output,
    start_stream,
)
from lockstep.entrypoints.generate_request import GenerateReqInput
from lockstep.entrypoints.tokenizer_manager import TokenizerManager
from lockstep.managers.data_parallel_controller import run_data_parallel_controller
from lockstep.managers.scheduler_process import run_scheduler_process
from lockstep.messages import ReqOutput, TokenizedGenerateReq
from lockstep.model_loader import resolve_model
from lockstep.model_loader.pooling import model_kind, pooling_for
from lockstep.multimodal.images import ImageLimits
from lockstep.multimodal.processing import image_inputs_for
from lockstep.server_args import PortArgs, ServerArgs
from lockstep.utils.process import kill_tree

logger = logging.getLogger(__name__)

# How long a child may take to load its share of the model and report ready.
READY_TIMEOUT_S = 600.0


class LaunchError(RuntimeError):
    pass


@dataclass
class Launched:
    args: ServerArgs
    ports: PortArgs
    children: list[mp.Process]
    tokenizer_manager: TokenizerManager | None  # None on nodes other than 0
    info: dict[str, Any] = field(default_factory=dict)
    failed: str | None = None  # set when a child died: the server is going down (/health 503)
    _stopping: bool = False

    def server_info(self) -> dict[str, Any]:
        """SGLang's /server_info: every server argument, the model's identity as resolved at launch
        (SGLang's router registers a null one as "unknown"), and the live figures."""
        tm = self.tokenizer_manager
        assert tm is not None, "node 0 only"
        info = self.args.info()
        info.update({k: self.info[k] for k in ("model_path", "tokenizer_path", "served_model_name")})
        info.update(max_total_num_tokens=tm.max_total_num_tokens, context_len=tm.context_len,
                    vocab_size=tm.vocab_size, num_running_requests=len(tm.states),
                    weight_plan=self.info.get("weight_plan"))  # rank 0's, as its ready message gave it
        return info

    def shutdown(self) -> None:
        self.kill_children()
        if self.tokenizer_manager is not None:
            self.tokenizer_manager.close()

    def kill_children(self) -> None:
        self._stopping = True
        for p in self.children:
            if p.is_alive():
                kill_tree(p.pid)
        for p in self.children:
            p.join(timeout=10)

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(message)` as soon as any child exits while we are not stopping."""

        def loop() -> None:
            while not self._stopping:
                sentinels = {p.sentinel: p for p in self.children}  # replicas come and go
                ready = wait(list(sentinels), timeout=1.0)
                if ready and not self._stopping:
                    # A sentinel is ready however the child ended: an exception, os._exit, or a
                    # signal that ran no Python at all (SIGKILL, the OOM killer, a segfault).
                    p = sentinels[ready[0]]
                    if p not in self.children:  # a replica removed on purpose (elastic.py)
                        continue
                    p.join(timeout=1)
                    self.failed = f"child process {p.name} (pid {p.pid}) exited with code {p.exitcode}"
                    on_death(self.failed)
                    return

        threading.Thread(target=loop, name="lockstep-child-watchdog", daemon=True).start()


def replica_processes(args: ServerArgs, rports: PortArgs, dp_rank: int) -> list[tuple[Any, ...]]:
    """(process name, run_scheduler_process's arguments) of each scheduler process of replica
    `dp_rank` on this node: at launch, and for a replica added while serving (elastic.py)."""
    per_node = args.tp_size * args.pp_size // args.nnodes
    first = args.node_rank * per_node
    threads = max(1, (os.cpu_count() or 1) // (per_node * args.dp_size))  # the node's cores, shared
    return [(f"scheduler-DP{dp_rank}-TP{tp_rank}-PP{pp_rank}", args, rports, tp_rank, pp_rank, threads)
            for pp_rank, tp_rank in (divmod(g, args.tp_size) for g in range(first, first + per_node))]


def launch_subprocesses(args: ServerArgs) -> Launched:
    # Resolve (and on first use convert) the model once, here: a bad path fails the launch with
    # one clear message before any child starts, and the children then find the cache ready.
    source = resolve_model(args.model_path)
    ports = PortArgs.new(args)
    ctx = mp.get_context("spawn")
    children: list[mp.Process] = []
    pipes = []

    def spawn(name: str, target: Callable[..., None], *child_args: Any, **kwargs: Any) -> None:
        """Start `target(*child_args, **kwargs, pipe=...)`; it reports ready over the pipe."""
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, name=name, args=child_args,
                        kwargs={**kwargs, "pipe": writer})
        p.start()
        children.append(p)
        pipes.append((p, reader))

    replica_ports = [ports.for_replica(i) for i in range(args.dp_size)] if args.dp_size > 1 else [ports]
    for dp_rank, rports in enumerate(replica_ports):
        for name, *rank_args in replica_processes(args, rports, dp_rank):
            spawn(name, run_scheduler_process, *rank_args, dp_rank=dp_rank)
    if args.dp_size > 1:
        spawn("data-parallel-controller", run_data_parallel_controller, args, ports,
              [r.scheduler_input_ipc for r in replica_ports])
    if args.node_rank == 0:
        spawn("detokenizer", run_detokenizer_process, args, ports)
    launched = Launched(args, ports, children, None)
    try:
        infos = [_wait_ready(p, r, READY_TIMEOUT_S) for p, r in pipes]
    except BaseException:
        launched.shutdown()
        raise
    info = launched.info = {**infos[0], "ranks": [i for i in infos if "tp_rank" in i]}
    if args.node_rank == 0:
        tokenizer = load_tokenizer(args)
        vocab = ModelConfig.from_hf(source.hf_config).vocab_size
        launched.info.update(
            vocab_size=vocab, model_dir=str(source.model_dir), chat_template=source.chat_template,
            model_path=source.origin, tokenizer_path=args.tokenizer_path or str(source.model_dir),
            served_model_name=args.served_model_name or args.model_path,
            model_type=source.hf_config.get("model_type"),
            architectures=source.hf_config.get("architectures"))
        launched.tokenizer_manager = TokenizerManager(
            args, ports, tokenizer, info["context_len"], info["max_total_num_tokens"], vocab)
        pooling = pooling_for(source.model_dir, source.hf_config, args.is_embedding, source.origin,
                              args.chat_template)
        launched.info.update(kind=model_kind(pooling),
                             pooling=dataclasses.asdict(pooling) if pooling else None)
        launched.tokenizer_manager.kind = launched.info["kind"]
        launched.tokenizer_manager.image_inputs = image_inputs_for(
            source.model_dir, source.hf_config, tokenizer,
            ImageLimits(args.max_image_bytes, max_images=args.max_images_per_request,
                        allow_urls=args.allow_image_urls))
    return launched


def _wait_ready(proc: mp.Process, reader: Connection, timeout: float) -> dict[str, Any]:
    """The child's ready message; LaunchError with the child's own message when it failed, or
    when it exited or timed out without a word."""
    if wait([reader, proc.sentinel], timeout) and reader.poll():
        with contextlib.suppress(EOFError):
            msg = reader.recv()
            if msg.get("status") == "ready":
                return msg
            raise LaunchError(msg.get("message", f"{proc.name} failed to start"))
    proc.join(timeout=5)
    if proc.is_alive():
        raise LaunchError(f"{proc.name} did not become ready within {timeout:.0f} s")
    raise LaunchError(f"{proc.name} exited during startup with code {proc.exitcode}; see its log above")


def install_signal_handlers(launched: Launched, exit_code_on_child_death: int = 1) -> None:
    """SIGTERM/SIGINT end everything (exit 0); SIGQUIT ends everything non-zero; a dead child too."""

    def terminate(signum: int, _frame: Any) -> None:
        launched.shutdown()
        os._exit(0 if signum in (signal.SIGTERM, signal.SIGINT) else exit_code_on_child_death)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, terminate)

    def on_death(msg: str) -> None:
        # On the watchdog thread: kill the rest and exit at once, touching nothing the event
        # loop owns (its sockets are not thread-safe).
        logger.error("%s; shutting the server down", msg)
        launched.kill_children()
        os._exit(exit_code_on_child_death)

    launched.watch(on_death)


_END = object()


async def _anext(agen: AsyncIterator[Any]) -> Any:
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return _END


async def _cancel_tasks() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.wait(tasks, timeout=2) if tasks else None


class Engine:
    """`lockstep.Engine(**server_args)`: keyword arguments are ServerArgs fields."""

    def __init__(self, **kwargs: Any) -> None:
        self.server_args = ServerArgs(**kwargs)
        self._launched = launch_subprocesses(self.server_args)
        self._closed = False
        self.tokenizer_manager = self._launched.tokenizer_manager
        assert self.tokenizer_manager is not None
        self._dead: str | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lockstep-engine",
                                        daemon=True)
        self._thread.start()  # the tokenizer manager starts on it with the first request
        self._launched.watch(self._on_child_death)
        atexit.register(self.shutdown)

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        if self._closed or self._dead:
            coro.close()
            raise RuntimeError("the engine has been shut down" if self._closed
                               else f"the engine is dead: {self._dead}")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self._submit(coro).result()

    async def _await(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return await asyncio.wrap_future(self._submit(coro))

    def _on_child_death(self, message: str) -> None:
        logger.error("%s; the engine stops serving", message)
        self._dead = message
        tm = self.tokenizer_manager

        def fail_pending() -> None:
            for state in list(tm.states.values()):
                state.queue.put_nowait(ReqOutput(
                    state.out.rid, [], FINISH_ABORT(f"engine died: {message}"),
                    state.out.prompt_tokens, len(state.out.output_ids), 0))

        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fail_pending)

    def _request(self, prompt: Any, sampling_params: Any, input_ids: Any, stream: bool,
                 **extra: Any) -> Coroutine[Any, Any, Any]:
        """The request, validated here (a ValueError with the server's message), as the
        coroutine that runs it on the engine's loop."""
        body = {"text": prompt, "input_ids": input_ids, "sampling_params": sampling_params,
                "stream": stream, **extra}
        try:
            obj = GenerateReqInput.model_validate({k: v for k, v in body.items() if v is not None})
            singles = obj.normalize()
        except pydantic.ValidationError as e:
            raise ValueError(format_validation_error(e)) from None
        return self._run(singles, obj.is_batch or len(singles) > 1, stream)

    async def _run(self, singles: list[TokenizedGenerateReq], many: bool, stream: bool) -> Any:
        """SGLang's output (a list when `many`), or, streaming, the async iterator of its chunks."""
        tm = self.tokenizer_manager
        if stream:
            fan = await start_stream(tm, singles, None)
            return sglang_chunks(fan, self.server_args.incremental_streaming_output, many)
        outs = [sglang_output(f) for f in await run_to_completion(tm, singles, None)]
        return outs if many else outs[0]

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 return_logprob: bool | list[bool] | None = None,
                 logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                 return_text_in_logprobs: bool | None = None, rid: str | list[str] | None = None,
                 stream: bool = False, lora_path: str | list[str | None] | None = None,
                 image_data: str | list[Any] | None = None) -> Any:
        """One dict per prompt (a list for a list, or n > 1); with stream=True an iterator of
        chunks. Bad input raises ValueError with the same message the server would send."""
        out = self._call(self._request(
            prompt, sampling_params, input_ids, stream, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs, rid=rid, lora_path=lora_path,
            image_data=image_data))
        return self._sync_stream(out) if stream else out

    def _sync_stream(self, agen: AsyncIterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        try:
            yield from iter(lambda: self._call(_anext(agen)), _END)
        finally:  # also when the caller stops early: the requests are aborted
            if not self._closed and not self._loop.is_closed():
                asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop)

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None,
                             return_logprob: bool | list[bool] | None = None,
                             logprob_start_len: int | None = None,
                             top_logprobs_num: int | None = None,
                             return_text_in_logprobs: bool | None = None,
                             rid: str | list[str] | None = None, stream: bool = False,
                             lora_path: str | list[str | None] | None = None,
                             image_data: str | list[Any] | None = None) -> Any:
        """As `generate`, from any event loop; with stream=True it returns an async iterator."""
        out = await self._await(self._request(
            prompt, sampling_params, input_ids, stream, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs, rid=rid, lora_path=lora_path,
            image_data=image_data))
        return self._async_stream(out) if stream else out

    async def _async_stream(self, agen: AsyncIterator[dict[str, Any]]
                            ) -> AsyncIterator[dict[str, Any]]:
        try:
            while (chunk := await self._await(_anext(agen))) is not _END:
                yield chunk
        finally:
            if not self._closed and not self._loop.is_closed():
                asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop)

    def flush_cache(self) -> bool:
        return self._call(self.tokenizer_manager.flush_cache()).success

    def get_server_info(self) -> dict[str, Any]:
        return self._launched.server_info()

    @property
    def child_pids(self) -> list[int]:
        return [p.pid for p in self._launched.children if p.pid is not None]

    def shutdown(self) -> None:
        """Ends every child process; safe to call twice (and called at exit)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._loop.is_running():
            try:  # abort what is still running, then stop the loop
                asyncio.run_coroutine_threadsafe(_cancel_tasks(), self._loop).result(timeout=5)
            except Exception:  # noqa: BLE001 - shutting down regardless
                logger.debug("cancelling the engine's tasks failed", exc_info=True)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._launched.shutdown()
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self._closed else "dead" if self._dead else "running"
        return f"Engine({self.server_args.model_path}, {state})"

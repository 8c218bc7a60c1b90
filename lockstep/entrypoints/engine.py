"""The one launch path, shared by the HTTP server and the offline Engine.

Start one scheduler process per (pp_rank, tp_rank) on this node, then the detokenizer; wait
for each to report ready over its Pipe; then build the TokenizerManager in this process. A
watchdog thread brings everything down if any child dies."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lockstep.configs.model_config import ModelConfig
from lockstep.managers.data_parallel_controller import run_data_parallel_controller
from lockstep.managers.detokenizer_manager import load_tokenizer, run_detokenizer_process
from lockstep.managers.scheduler_process import run_scheduler_process
from lockstep.managers.tokenizer_manager import TokenizerManager
from lockstep.model_loader import resolve_model
from lockstep.server_args import PortArgs, ServerArgs
from lockstep.utils.process import kill_tree

logger = logging.getLogger(__name__)


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

    def watch(self, on_death: Callable[[str], None]) -> threading.Thread:
        """Call `on_death(message)` as soon as any child exits while we are not stopping."""

        def loop() -> None:
            sentinels = {p.sentinel: p for p in self.children}
            from multiprocessing.connection import wait

            while not self._stopping:
                ready = wait(list(sentinels), timeout=1.0)
                if ready and not self._stopping:
                    # A sentinel is ready however the child ended: an exception, os._exit, or a
                    # signal that ran no Python at all (SIGKILL, the OOM killer, a segfault).
                    p = sentinels[ready[0]]
                    p.join(timeout=1)
                    self.failed = f"child process {p.name} (pid {p.pid}) exited with code {p.exitcode}"
                    on_death(self.failed)
                    return

        t = threading.Thread(target=loop, name="lockstep-child-watchdog", daemon=True)
        t.start()
        return t


def _threads_per_rank(args: ServerArgs) -> int:
    local = args.tp_size * args.pp_size * args.dp_size // args.nnodes
    return max(1, (os.cpu_count() or 1) // local)


def launch_subprocesses(args: ServerArgs, ports: PortArgs | None = None,
                        ready_timeout: float = 600.0) -> Launched:
    # Resolve (and on first use convert) the model once, here: a bad path fails the launch with
    # one clear message before any child starts, and the children then find the cache ready.
    source = resolve_model(args.model_path)
    ports = ports or PortArgs.new(args)
    ctx = mp.get_context("spawn")
    children: list[mp.Process] = []
    pipes = []
    per_node = args.tp_size * args.pp_size // args.nnodes
    first = args.node_rank * per_node
    threads = _threads_per_rank(args)
    replica_ports = [ports.for_replica(i) for i in range(args.dp_size)] if args.dp_size > 1 else [ports]
    for dp_rank, rports in enumerate(replica_ports):
        for global_rank in range(first, first + per_node):
            pp_rank, tp_rank = divmod(global_rank, args.tp_size)
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=run_scheduler_process,
                            name=f"scheduler-DP{dp_rank}-TP{tp_rank}-PP{pp_rank}",
                            args=(args, rports, tp_rank, pp_rank, threads, writer, dp_rank))
            p.start()
            children.append(p)
            pipes.append((p, reader))
    if args.dp_size > 1:
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=run_data_parallel_controller, name="data-parallel-controller",
                        args=(args, ports, [r.scheduler_input_ipc for r in replica_ports], writer))
        p.start()
        children.append(p)
        pipes.append((p, reader))
    if args.node_rank == 0:
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=run_detokenizer_process, name="detokenizer",
                        args=(args, ports, writer), daemon=False)
        p.start()
        children.append(p)
        pipes.append((p, reader))
    launched = Launched(args, ports, children, None)
    try:
        infos = [_wait_ready(p, r, ready_timeout) for p, r in pipes]
    except BaseException:
        launched.shutdown()
        raise
    info = dict(infos[0])
    info["ranks"] = [i for i in infos if "tp_rank" in i]
    launched.info = info
    if args.node_rank == 0:
        tokenizer = load_tokenizer(args)
        vocab = ModelConfig.from_hf(source.hf_config).vocab_size
        launched.info.update(vocab_size=vocab, model_dir=str(source.model_dir),
                             chat_template=source.chat_template)
        launched.tokenizer_manager = TokenizerManager(
            args, ports, tokenizer, info["context_len"], info["max_total_num_tokens"], vocab)
    return launched


def _wait_ready(proc: mp.Process, reader, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if reader.poll(0.2):
            try:
                msg = reader.recv()
            except EOFError:
                break
            if msg.get("status") == "ready":
                return msg
            raise LaunchError(msg.get("message", f"{proc.name} failed to start"))
        if not proc.is_alive():
            break
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

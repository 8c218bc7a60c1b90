"""Starting the HTTP server: listen at once and answer 503 while the scheduler and detokenizer
processes start through the shared launch path, then serve `create_app(launched)` with uvicorn.
SIGTERM drains (new requests get 503, running ones finish for up to --graceful-shutdown-timeout
seconds) and then ends every process; SIGINT ends them at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import socket
import sys
import threading
from typing import Any

import uvicorn

from lockstep.core import FINISH_ABORT
from lockstep.entrypoints.engine import (
    Launched,
    LaunchError,
    install_signal_handlers,
    launch_subprocesses,
)
from lockstep.entrypoints.http_server import create_app
from lockstep.entrypoints.middleware import BoundedH11Protocol, ServerStatus, unavailable_response
from lockstep.entrypoints.openai.chat_templates import resolve_chat_template
from lockstep.entrypoints.openai.reasoning_parser import reasoning_format
from lockstep.server_args import ServerArgs
from lockstep.utils.process import configure_logging

logger = logging.getLogger(__name__)

# After the drain: a moment for the aborts of requests still running to reach their clients.
ABORT_GRACE_S = 2.0


def _bind(host: str, port: int) -> socket.socket:
    """Bind before the (slow) model load so a taken port fails at once."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise LaunchError(f"cannot bind {host}:{port}: {e.strerror or e}") from e
    return sock


def _uvicorn_config(app: Any, args: ServerArgs, **overrides: Any) -> uvicorn.Config:
    """The one HTTP stack, for the start-up 503s and for serving: uvicorn with the limits."""
    return uvicorn.Config(**{
        "app": app, "log_config": None, "log_level": args.log_level,
        "access_log": args.log_level == "debug", "timeout_graceful_shutdown": 5,
        "timeout_keep_alive": args.timeout_keep_alive, "lifespan": "on",
        "http": BoundedH11Protocol.limits(args.timeout_request_read, args.max_connections),
        **overrides})


class StartupResponder:
    """While the processes start, every request on the listening socket gets `status`'s 503
    ("starting", not a refused connection): uvicorn with the serving limits, on its own thread
    (the main thread spawns the children: PR_SET_PDEATHSIG follows the spawning thread), on a
    duplicate of the socket, which `stop()` leaves listening for the real server."""

    def __init__(self, sock: socket.socket, status: ServerStatus, args: ServerArgs) -> None:
        async def starting(scope: Any, receive: Any, send: Any) -> None:
            refusal = unavailable_response(status.unavailable() or "retry shortly")
            refusal.headers["Connection"] = "close"
            await refusal(scope, receive, send)

        # Quiet: its start and "Shutting down" are not the server's (the real Config, built after
        # stop(), sets uvicorn's log level back).
        self.server = uvicorn.Server(_uvicorn_config(starting, args, lifespan="off",
                                                     log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, args=([sock.dup()],),
                                       daemon=True, name="lockstep-startup-503")

    def start(self) -> StartupResponder:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.should_exit = self.server.force_exit = True  # a 503 is sent at once
        self.thread.join()


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, except that SIGTERM drains first ("draining": new generations and /health
    get 503; running requests get --graceful-shutdown-timeout s, then are aborted). A second
    SIGTERM, or SIGINT, stops at once. The status turns "ready" once uvicorn has started."""

    def __init__(self, config: uvicorn.Config, status: ServerStatus, launched: Launched) -> None:
        super().__init__(config)
        self.status = status
        self.launched = launched
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain: concurrent.futures.Future | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if not self.started:
            return
        self.status.phase = "ready"
        args, info = self.launched.args, self.launched.info
        logger.info("model %s: context %s tokens, KV pool %s tokens",
                    args.model_path, info.get("context_len"),
                    info.get("max_total_num_tokens"))
        host = f"[{args.host}]" if ":" in args.host else args.host
        logger.info("serving on http://%s:%s", host, args.port)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if (sig == signal.SIGTERM and self.status.phase == "ready" and self.loop is not None
                and not self.should_exit):
            self.status.phase = "draining"
            self.drain = asyncio.run_coroutine_threadsafe(self._drain(), self.loop)
            return
        super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        tm = self.launched.tokenizer_manager
        assert tm is not None
        grace = self.launched.args.graceful_shutdown_timeout
        loop = asyncio.get_running_loop()

        async def settle(seconds: float) -> None:  # until every request is done, at most that
            end = loop.time() + seconds
            while tm.states and loop.time() < end:
                await asyncio.sleep(0.05)

        logger.info("SIGTERM: refusing new requests; %d running request(s) get up to %g s to "
                    "finish", len(tm.states), grace)
        await settle(grace)
        if tm.states:
            rids = list(tm.states)
            logger.warning("graceful shutdown: %d request(s) still running after %g s; aborting "
                           "them", len(rids), grace)
            reason = FINISH_ABORT("the server is shutting down", status_code=503)
            for rid in rids:
                await tm.abort(rid, reason)
            await settle(ABORT_GRACE_S)
        else:
            logger.info("graceful shutdown: every request finished")
        super().handle_exit(signal.SIGTERM, None)


def launch_server(args: ServerArgs) -> None:
    """Start every process, serve until SIGINT/SIGTERM, then end them all."""
    configure_logging(args.log_level, "server")
    try:  # a mistyped name fails here, not after the model has loaded
        if args.chat_template:
            resolve_chat_template(args.chat_template, None, "", [])
        if args.reasoning_parser:
            reasoning_format(args.reasoning_parser)
    except ValueError as e:  # ChatTemplateError is one
        logger.error("%s", e)
        sys.exit(2)
    responder: StartupResponder | None = None
    status = ServerStatus()
    try:
        sock = _bind(args.host, args.port)
        if args.node_rank == 0:  # answer 503 while the model loads
            sock.listen(2048)
            responder = StartupResponder(sock, status, args).start()
        launched = launch_subprocesses(args)
    except LaunchError as e:
        logger.error("%s", e)
        sys.exit(1)
    except Exception as e:  # ModelLoadError and friends: one line, not a traceback
        logger.error("startup failed: %s: %s", type(e).__name__, e)
        sys.exit(1)
    install_signal_handlers(launched)
    if launched.tokenizer_manager is None:
        # Nodes other than 0 run only their scheduler ranks; node 0 serves. The watchdog ends
        # this process when a rank exits (for example when node 0 goes away).
        logger.info("node %d: %d scheduler rank(s) running; node 0 serves requests",
                    args.node_rank, len(launched.children))
        for p in launched.children:
            p.join()
        return
    try:
        app = create_app(launched, status)
        if responder is not None:  # the real server takes over the socket (and uvicorn's logs)
            responder.stop()
        DrainingServer(_uvicorn_config(app, args), status, launched).run(sockets=[sock])
    finally:
        launched.shutdown()


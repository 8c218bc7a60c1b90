"""Starting the HTTP server: listen at once and answer 503 while the scheduler and detokenizer
processes start through the shared launch path, then serve `create_app(launched)` with uvicorn.
SIGTERM drains (new requests get 503, running ones finish for up to --graceful-shutdown-timeout
seconds) and then ends every process; SIGINT ends them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
from lockstep.entrypoints.middleware import (
    BoundedH11Protocol,
    ServerStatus,
    unavailable_response,
)
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


class StartupResponder:
    """While the processes start: every request on the (already listening) socket gets the 503
    that `status` gives in its "starting" phase, so that load balancers and clients see
    "starting" rather than a refused connection. A plain thread, so the launch (whose children
    must be spawned by the main thread: PR_SET_PDEATHSIG follows the spawning thread) goes on
    undisturbed; a client slower than `read_timeout` is dropped (each holds a thread); `stop()`
    leaves the socket open for uvicorn."""

    MAX_DRAIN_BYTES = 1 << 20

    def __init__(self, sock: socket.socket, status: ServerStatus, read_timeout: float) -> None:
        drain_limit = self.MAX_DRAIN_BYTES

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = read_timeout  # the socket's: a slow client once held its thread forever

            def refuse(self) -> None:
                with contextlib.suppress(ValueError, OSError):
                    length = int(self.headers.get("Content-Length") or 0)
                    if 0 < length <= drain_limit:
                        self.rfile.read(length)
                refusal = unavailable_response(status.unavailable() or "retry shortly")
                self.send_response(refusal.status_code)
                for name, value in refusal.headers.items():
                    self.send_header(name, value)
                self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(refusal.body)
                self.close_connection = True

            do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = refuse

            def log_message(self, *_args: Any) -> None:
                pass

        server = ThreadingHTTPServer(sock.getsockname()[:2], Handler, bind_and_activate=False)
        server.socket.close()
        server.socket = sock
        server.daemon_threads = True
        self.server = server
        self.thread = threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True,
                                       name="lockstep-startup-503")

    def start(self) -> StartupResponder:
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()  # stops accepting; the socket stays open


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, except that SIGTERM drains first: the status turns "draining" (new
    generations and /health get 503), running requests get up to --graceful-shutdown-timeout
    seconds to finish, what is left is aborted, and then uvicorn shuts down as usual. A second
    SIGTERM, or SIGINT, stops at once."""

    def __init__(self, config: uvicorn.Config, status: ServerStatus, launched: Launched) -> None:
        super().__init__(config)
        self.status = status
        self.launched = launched
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if (sig == signal.SIGTERM and self.status.phase == "ready" and self.loop is not None
                and not self.should_exit):
            self.status.phase = "draining"
            self.loop.call_soon_threadsafe(self._begin_drain)
            return
        super().handle_exit(sig, frame)

    def _begin_drain(self) -> None:
        self.drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        tm = self.launched.tokenizer_manager
        assert tm is not None
        grace = self.launched.args.graceful_shutdown_timeout
        loop = asyncio.get_running_loop()
        logger.info("SIGTERM: refusing new requests; %d running request(s) get up to %g s to "
                    "finish", len(tm.states), grace)
        deadline = loop.time() + grace
        while tm.states and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if tm.states:
            rids = list(tm.states)
            logger.warning("graceful shutdown: %d request(s) still running after %g s; aborting "
                           "them", len(rids), grace)
            reason = FINISH_ABORT("the server is shutting down", status_code=503)
            for rid in rids:
                await tm.abort(rid, reason)
            end = loop.time() + ABORT_GRACE_S
            while tm.states and loop.time() < end:
                await asyncio.sleep(0.05)
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
            responder = StartupResponder(sock, status, args.timeout_request_read).start()
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
        config = uvicorn.Config(
            app, log_config=None, log_level=args.log_level, access_log=args.log_level == "debug",
            timeout_graceful_shutdown=5, timeout_keep_alive=args.timeout_keep_alive,
            lifespan="on", loop="none",
            http=BoundedH11Protocol.limits(args.timeout_request_read, args.max_connections),
        )
        server = DrainingServer(config, status, launched)

        async def main() -> None:
            server.loop = asyncio.get_running_loop()

            async def announce() -> None:
                while not server.started:
                    await asyncio.sleep(0.05)
                status.phase = "ready"
                info = launched.info
                logger.info("model %s: context %s tokens, KV pool %s tokens",
                            args.model_path or "(default) Gemma 3 270M", info.get("context_len"),
                            info.get("max_total_num_tokens"))
                host = f"[{args.host}]" if ":" in args.host else args.host
                logger.info("serving on http://%s:%s", host, args.port)

            task = asyncio.get_running_loop().create_task(announce())
            try:
                if responder is not None:
                    responder.stop()  # uvicorn takes over the listening socket
                await server.serve(sockets=[sock])
            finally:
                task.cancel()

        _run(main())
    finally:
        launched.shutdown()


def _run(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)

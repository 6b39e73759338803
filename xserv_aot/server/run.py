"""Serve an engine over HTTP with uvicorn (h11, bounded concurrency and header sizes, graceful shutdown).

Shutdown: the first SIGTERM/SIGINT (or request_shutdown()) drains the app (admission closed, in-flight requests get
`shutdown_grace` seconds, then are aborted with a final chunk) while the listener stays open to answer 503; then
uvicorn stops. A second signal ends the grace period at once (the aborts still send final chunks), a third forces
the exit. The process exits 0.
"""
from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import signal
import socket

import uvicorn

from xserv_aot.errors import UsageError
from xserv_aot.server.app import create_app
from xserv_aot.server.conn import HEADER_TIMEOUT_S, h11_with_header_timeout
from xserv_aot.server.gate import MAX_HEADER_BYTES

log = logging.getLogger(__name__)


def server_config(app, host: str = "127.0.0.1", port: int = 8000, *, header_timeout: float = HEADER_TIMEOUT_S,
                  timeout_keep_alive: int = 5, timeout_graceful_shutdown: int = 10, log_level: str = "info",
                  access_log: bool = True) -> uvicorn.Config:
    """Connections are not counted (the app limits requests in flight, /health aside); one that has not sent a
    whole request head header_timeout seconds after it opened or after its last response is closed; headers are
    capped at 16 KiB (by h11 while incomplete, by the app with 431 once parsed); responses still open
    timeout_graceful_shutdown seconds after the drain are cancelled (and so aborted)."""
    return uvicorn.Config(app, host=host, port=port, http=h11_with_header_timeout(header_timeout), loop="asyncio",
                          lifespan="on", limit_concurrency=None, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                          timeout_keep_alive=timeout_keep_alive, timeout_graceful_shutdown=timeout_graceful_shutdown,
                          log_level=log_level, access_log=access_log, server_header=False)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signals drain the app first (app.state.server.admission) and are not re-raised."""

    def __init__(self, config: uvicorn.Config, shutdown_grace: float = 30.0):
        super().__init__(config)
        self.shutdown_grace = shutdown_grace
        self._calls = itertools.count(1)             # atomic; no lock a nested signal handler could deadlock on
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if sockets and self.started:                 # uvicorn logs its address only for sockets it binds itself
            host, port = sockets[0].getsockname()[:2]
            log.info("running on http://%s:%d (Press CTRL+C to quit)", f"[{host}]" if ":" in host else host, port)

    def handle_exit(self, sig: int, frame) -> None:
        log.info("received %s", signal.Signals(sig).name)
        self.request_shutdown()

    def request_shutdown(self) -> None:
        """Thread- and signal-safe. First call: drain, then stop. Second: end the grace now. Third: force exit."""
        n, admission = next(self._calls), self._admission()
        if n >= 3 or self._loop is None or admission is None:
            self.force_exit = n >= 3
            self.should_exit = True
        elif n == 2:
            self._loop.call_soon_threadsafe(admission.cut_grace)
        else:
            self._loop.call_soon_threadsafe(self._start_drain, admission)

    def _admission(self):
        srv = getattr(getattr(self.config.app, "state", None), "server", None)     # an app from create_app
        return getattr(srv, "admission", None)

    def _start_drain(self, admission) -> None:
        self._drain_task = asyncio.ensure_future(self._drain(admission))

    async def _drain(self, admission) -> None:
        try:
            await admission.drain(self.shutdown_grace)
        except Exception:
            log.exception("drain failed")
        finally:
            self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the plan is loaded; a busy or unbindable address is one line. Its protocol
    is IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets of that protocol, and with
    Nagle on, a response written in two pieces (headers, then body or the first SSE chunk) waits for the client's
    delayed ACK: +40 ms on every request of a kept-alive connection after its first."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
        raise UsageError(f"{host}:{port} {why}") from None
    except (OverflowError, socket.gaierror) as e:
        sock.close()
        raise UsageError(f"{host}:{port} is not a valid address ({e})") from None
    sock.set_inheritable(True)
    return sock


def run_server(engine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               model_name: str | None = None, *, max_request_bytes: int = 1_000_000, reasoning: bool | None = None,
               max_in_flight: int = 512, log_level: str = "info", request_timeout: float | None = None,
               shutdown_grace: float = 30.0, sock: socket.socket | None = None,
               special_tokens_in_content: bool = False, tool_call_parser: str | None = None,
               metrics_require_key: bool = True) -> None:
    """Blocks until the server stops (SIGTERM/SIGINT drain it first). Starts the engine inside the server's event
    loop, shuts it down at exit. model_name defaults to engine.model_name."""
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach this address can use the model", host)
    app = create_app(engine, model_name=model_name or engine.model_name, api_key=api_key,
                     max_request_bytes=max_request_bytes, reasoning=reasoning, manage_engine=True,
                     request_timeout=request_timeout, max_in_flight=max_in_flight,
                     special_tokens_in_content=special_tokens_in_content, tool_call_parser=tool_call_parser,
                     metrics_require_key=metrics_require_key)
    config = server_config(app, host, port, log_level=log_level)
    server = DrainingServer(config, shutdown_grace=shutdown_grace)
    if hasattr(engine, "on_death"):                  # an engine core process that dies stops the server
        engine.on_death.append(lambda reason: server.request_shutdown())
    server.run(sockets=[sock] if sock is not None else None)

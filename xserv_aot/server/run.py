"""Serve an engine over HTTP with uvicorn (h11, bounded concurrency and header sizes, graceful shutdown).

Shutdown: the first SIGTERM/SIGINT (or request_shutdown()) drains the app (admission closed, in-flight requests get
`shutdown_grace` seconds, then are aborted with a final chunk) while the listener stays open to answer 503; then
uvicorn stops. A second signal ends the grace period at once (the aborts still send final chunks), a third forces
the exit. The process exits 0.
"""
from __future__ import annotations

import asyncio
import logging
import itertools
import signal

import uvicorn

from xserv_aot.server.app import create_app
from xserv_aot.server.gate import MAX_HEADER_BYTES

log = logging.getLogger(__name__)


def server_config(app, host: str = "127.0.0.1", port: int = 8000, *, limit_concurrency: int = 512,
                  timeout_keep_alive: int = 5, timeout_graceful_shutdown: int = 10, log_level: str = "info",
                  access_log: bool = True) -> uvicorn.Config:
    """uvicorn answers 503 above limit_concurrency open connections+tasks; headers are capped at 16 KiB (by h11
    while incomplete, by the app with 431 once parsed); responses still open timeout_graceful_shutdown seconds
    after the drain are cancelled (and so aborted)."""
    return uvicorn.Config(app, host=host, port=port, http="h11", loop="asyncio", lifespan="on",
                          limit_concurrency=limit_concurrency, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
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


def run_server(engine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               model_name: str | None = None, *, max_request_bytes: int = 1_000_000, reasoning: bool | None = None,
               limit_concurrency: int = 512, log_level: str = "info", request_timeout: float | None = None,
               shutdown_grace: float = 30.0, tool_call_parser: str | None = None,
               metrics_require_key: bool = True) -> None:
    """Blocks until the server stops (SIGTERM/SIGINT drain it first). Starts the engine inside the server's event
    loop, shuts it down at exit. model_name defaults to engine.model_name."""
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach this address can use the model", host)
    app = create_app(engine, model_name=model_name or engine.model_name, api_key=api_key,
                     max_request_bytes=max_request_bytes, reasoning=reasoning, manage_engine=True,
                     request_timeout=request_timeout, tool_call_parser=tool_call_parser,
                     metrics_require_key=metrics_require_key)
    config = server_config(app, host, port, limit_concurrency=limit_concurrency, log_level=log_level)
    server = DrainingServer(config, shutdown_grace=shutdown_grace)
    if hasattr(engine, "on_death"):                  # an engine core process that dies stops the server
        engine.on_death.append(lambda reason: server.request_shutdown())
    server.run()

"""Serve an engine over HTTP with uvicorn (h11, bounded concurrency and header sizes)."""
from __future__ import annotations

import uvicorn

from xserv_aot.server.app import MAX_HEADER_BYTES, create_app


def server_config(app, host: str = "127.0.0.1", port: int = 8000, *, limit_concurrency: int = 512,
                  timeout_keep_alive: int = 5, timeout_graceful_shutdown: int = 10, log_level: str = "info",
                  access_log: bool = True) -> uvicorn.Config:
    """uvicorn answers 503 above limit_concurrency open connections+tasks; headers are capped at 16 KiB (by h11
    while incomplete, by the app with 431 once parsed); at shutdown, streams still open after
    timeout_graceful_shutdown seconds are cancelled (and so aborted)."""
    return uvicorn.Config(app, host=host, port=port, http="h11", loop="asyncio", lifespan="on",
                          limit_concurrency=limit_concurrency, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                          timeout_keep_alive=timeout_keep_alive, timeout_graceful_shutdown=timeout_graceful_shutdown,
                          log_level=log_level, access_log=access_log, server_header=False)


def run_server(engine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               model_name: str | None = None, *, max_request_bytes: int = 1_000_000, reasoning: bool | None = None,
               limit_concurrency: int = 512, log_level: str = "info") -> None:
    """Blocks until the server stops (Ctrl-C). Starts the engine inside the server's event loop, shuts it down
    at exit. model_name defaults to engine.model_name."""
    app = create_app(engine, model_name=model_name or engine.model_name, api_key=api_key,
                     max_request_bytes=max_request_bytes, reasoning=reasoning, manage_engine=True)
    uvicorn.Server(server_config(app, host, port, limit_concurrency=limit_concurrency, log_level=log_level)).run()

"""OpenAI-format error responses and the app's exception handlers. Nothing internal (messages of unexpected
exceptions, tracebacks, engine error text) reaches a client: those go to the log."""
from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from xserv_aot.engine.api import EngineFailedError, InvalidRequestError, QueueFullError, RequestTooLongError
from xserv_aot.server.protocol import RequestError
from xserv_aot.server.responses import error_body

log = logging.getLogger(__name__)

REFUSALS = (QueueFullError, RequestTooLongError, InvalidRequestError, EngineFailedError)  # refused before starting
GENERATION_FAILED = "internal error while generating"


class RequestTimeout(Exception):
    """The request ran past the server's --request-timeout; its engine request is aborted."""

    def __init__(self, seconds: float):
        super().__init__(f"the request exceeded the server's request timeout of {seconds:g} s")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)


def timeout_body(exc: RequestTimeout) -> dict:
    return error_body(str(exc), 504, code="request_timeout")


async def _request_error(request, exc: RequestError):
    return error_response(exc.status, exc.message, exc.param, exc.code)


async def _http_error(request, exc: HTTPException):
    return error_response(exc.status_code, exc.detail, headers=exc.headers)


async def _too_long(request, exc: RequestTooLongError):
    return error_response(400, str(exc), "max_tokens", "context_length_exceeded")


async def _invalid(request, exc: InvalidRequestError):
    return error_response(400, str(exc))


async def _queue_full(request, exc: QueueFullError):
    return error_response(429, "the server is at capacity; retry later", code="queue_full",
                          headers={"Retry-After": "1"})


async def _engine_failed(request, exc: EngineFailedError):
    log.error("request refused: %s", exc)
    return error_response(503, "the inference engine is not available", code="engine_unavailable")


async def _client_gone(request, exc: ClientDisconnect):
    return Response(status_code=499)                          # the client left while sending its body


async def _internal(request, exc: Exception):
    log.error("unhandled error in %s", request.url.path, exc_info=exc)
    return error_response(500, "internal server error")


HANDLERS = {RequestError: _request_error, HTTPException: _http_error, RequestTooLongError: _too_long,
            InvalidRequestError: _invalid, QueueFullError: _queue_full, EngineFailedError: _engine_failed,
            ClientDisconnect: _client_gone, Exception: _internal}

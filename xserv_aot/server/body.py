"""Reading a JSON request body defensively: a byte limit enforced while reading (chunked bodies included), strict
UTF-8, bounded nesting, and no lone surrogates (they cannot be tokenized or re-encoded as UTF-8)."""
from __future__ import annotations

import asyncio
import json

from xserv_aot.server.protocol import RequestError

MAX_JSON_DEPTH = 32                                  # arrays/objects inside one another
BODY_TIMEOUT_S = 30.0                                # from the request head to the body's last byte


def _too_big(limit: int) -> RequestError:
    return RequestError(f"request body exceeds {limit} bytes", status=413, code="request_too_large")


async def read_body(request, limit: int, timeout: float = BODY_TIMEOUT_S) -> bytes:
    """The body, or 413 as soon as Content-Length or the bytes read so far exceed limit (the rest is never read),
    or 408 when the whole body has not arrived within `timeout` seconds."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_big(limit)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise _too_big(limit)
    except TimeoutError:
        raise RequestError(f"the request body did not arrive within {timeout:g} seconds", status=408,
                           code="request_timeout") from None
    return bytes(body)


def _too_deep(n: int) -> RequestError:
    return RequestError(f"request body JSON nests arrays/objects deeper than {n} levels")


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_json(value, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse nesting deeper than max_depth and strings (or keys) holding lone surrogates. Iterative: any depth."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if _has_surrogate(v):
                raise RequestError("request body holds a lone UTF-16 surrogate (an invalid \\ud800-\\udfff escape)")
        elif isinstance(v, (list, dict)):
            if depth > max_depth:
                raise _too_deep(max_depth)
            if isinstance(v, dict):
                stack.extend((k, depth) for k in v)
                v = v.values()
            stack.extend((x, depth + 1) for x in v)


def parse_json(raw: bytes):
    try:
        text = raw.decode("utf-8")
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(MAX_JSON_DEPTH) from None
    except ValueError as e:                           # UnicodeDecodeError, JSONDecodeError, too many int digits
        raise RequestError(f"request body is not valid JSON ({type(e).__name__}: {_short(e)})") from None
    check_json(value)
    return value


def _short(e: Exception, n: int = 200) -> str:
    msg = " ".join(str(e).split())
    return msg if len(msg) <= n else msg[:n] + "..."


async def read_json(request, limit: int, timeout: float = BODY_TIMEOUT_S):
    return parse_json(await read_body(request, limit, timeout))

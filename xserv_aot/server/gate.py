"""ASGI middleware in front of every route: header-size limit (431), bearer API key on every route but /health (401),
a bound on requests in flight (503 with Retry-After; /health is never refused), and the
requests-by-endpoint-and-status counter."""
from __future__ import annotations

import hmac

from xserv_aot.errors import UsageError
from xserv_aot.server.errors import error_response
from xserv_aot.server.metrics import ServerMetrics

MAX_HEADER_BYTES = 16 * 1024                         # all request header names + values
MAX_IN_FLIGHT = 512                                  # requests being read, generated or sent at once
OPEN_PATHS = ("/health",)                            # reachable without the API key or a free slot (probes)


def check_api_key(api_key: str | None) -> bytes | None:
    """None: no auth. Surrounding whitespace is stripped (it cannot travel in a header); empty keys are refused."""
    if api_key is None:
        return None
    key = api_key.strip()
    if not key:
        raise UsageError("--api-key / XSERV_API_KEY is empty; give a key or leave it unset for no authentication")
    if any(c.isspace() or not c.isprintable() for c in key) or not key.isascii():
        raise UsageError("--api-key / XSERV_API_KEY must be printable ASCII without whitespace")
    return key.encode()


class Gate:
    def __init__(self, app, metrics: ServerMetrics, api_key: str | None, endpoints: tuple[str, ...],
                 max_in_flight: int = MAX_IN_FLIGHT, open_paths: tuple[str, ...] = OPEN_PATHS):
        if not (isinstance(max_in_flight, int) and max_in_flight >= 1):
            raise UsageError(f"max_in_flight must be an integer >= 1, got {max_in_flight!r}")
        self.app, self.metrics, self.endpoints, self.open_paths = app, metrics, endpoints, open_paths
        self.key = check_api_key(api_key)
        self.max_in_flight, self.in_flight = max_in_flight, 0

    def _authorized(self, scope) -> bool:
        auth = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
        scheme, _, token = auth.strip().partition(b" ")
        token = token.strip()
        return scheme.lower() == b"bearer" and bool(token) and hmac.compare_digest(token, self.key)

    def _endpoint(self, path: str) -> str:
        if path in self.endpoints:
            return path
        return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]
        counted = scope["path"] not in OPEN_PATHS

        async def send_status(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)
        self.in_flight += counted
        try:
            if counted and self.in_flight > self.max_in_flight:
                await error_response(503, f"the server has {self.max_in_flight} requests in flight; retry shortly",
                                     code="server_busy", headers={"Retry-After": "1"})(scope, receive, send_status)
            elif sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
                await error_response(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")(
                    scope, receive, send_status)
            elif self.key is not None and scope["path"] not in self.open_paths and not self._authorized(scope):
                await error_response(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                     code="invalid_api_key")(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            self.in_flight -= counted
            self.metrics.requests.labels(self._endpoint(scope["path"]), str(status[0])).inc()

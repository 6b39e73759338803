"""ASGI middleware in front of every route: header-size limit (431), bearer API key on every route but /health (401),
and the requests-by-endpoint-and-status counter."""
from __future__ import annotations

import hmac

from xserv_aot.server.errors import error_response
from xserv_aot.server.metrics import ServerMetrics

MAX_HEADER_BYTES = 16 * 1024                         # all request header names + values
OPEN_PATHS = ("/health",)                            # reachable without the API key (load-balancer probes)


class Gate:
    def __init__(self, app, metrics: ServerMetrics, api_key: str | None, endpoints: tuple[str, ...],
                 open_paths: tuple[str, ...] = OPEN_PATHS):
        self.app, self.metrics, self.endpoints, self.open_paths = app, metrics, endpoints, open_paths
        self.key = None if api_key is None else api_key.encode()

    def _authorized(self, scope) -> bool:
        auth = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    def _endpoint(self, path: str) -> str:
        if path in self.endpoints:
            return path
        return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)
        try:
            if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
                await error_response(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")(
                    scope, receive, send_status)
            elif self.key is not None and scope["path"] not in self.open_paths and not self._authorized(scope):
                await error_response(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                     code="invalid_api_key")(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(self._endpoint(scope["path"]), str(status[0])).inc()

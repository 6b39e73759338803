"""The server's read-only endpoints: /v1/models, /v1/models/{name}, /health, /version, /metrics, /openapi.json.

InfoRoutes is a mixin of OpenAIServer (server/app.py): it reads the server's engine, model_name, admission, metrics
and openapi. /health: 503 while draining, when engine stats are unavailable, when the engine has failed or is not
running; "degraded" (200) after failed steps with no success since; else "ok".
"""
from __future__ import annotations

import logging
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from xserv_aot import __version__
from xserv_aot.server.errors import error_response

log = logging.getLogger(__name__)


class InfoRoutes:
    def _card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "xserv-aot",
                "root": self.model_name, "parent": None, "max_model_len": self.engine.max_seq_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name != self.model_name:
            return error_response(404, f"the model '{name[:200]}' does not exist", "model", "model_not_found")
        return JSONResponse(self._card())

    async def health(self, request: Request) -> Response:
        if self.admission.draining:
            return error_response(503, "the server is draining for shutdown", code="draining")
        try:
            stats = self.engine.stats()
        except Exception:
            log.exception("engine.stats() failed in /health")
            return error_response(503, "engine stats are unavailable", code="engine_unhealthy")
        if not stats.healthy:
            return error_response(503, "the inference engine has failed and refuses requests", code="engine_unhealthy")
        if not getattr(stats, "accepting", True):
            return error_response(503, "the inference engine is not running", code="engine_stopped")
        failures = getattr(stats, "consecutive_failures", 0)
        if failures:
            return JSONResponse({"status": "degraded", "consecutive_step_failures": failures})
        return JSONResponse({"status": "ok"})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def metrics_text(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def openapi_json(self, request: Request) -> Response:
        return JSONResponse(self.openapi)

"""The OpenAI-compatible HTTP app: /v1/chat/completions, /v1/completions, /v1/models, /health, /version, /metrics,
/openapi.json.

Every generation request is one engine request. A client that disconnects (while waiting or mid-stream) has
its engine request closed and aborted; so has one that runs past request_timeout. Errors use the OpenAI error
shape; engine failures never leak details. Messages are data handed to the model's own (sandboxed) chat template.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

import jinja2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from xserv_aot import __version__
from xserv_aot.server import protocol as P
from xserv_aot.server.body import BODY_TIMEOUT_S, read_json
from xserv_aot.server.errors import (GENERATION_FAILED, HANDLERS, REFUSALS, RequestTimeout, error_response,
                                     timeout_body)
from xserv_aot.server.gate import MAX_HEADER_BYTES, MAX_IN_FLIGHT, Gate, check_api_key
from xserv_aot.server.lifecycle import Admission
from xserv_aot.server.metrics import ServerMetrics
from xserv_aot.server.openapi import openapi_document
from xserv_aot.server.reasoning import prompt_opens_reasoning, template_uses_thinking
from xserv_aot.server.responses import TokenText
from xserv_aot.server.streaming import (GONE, KEEPALIVE_S, Generation, Reply, SSEResponse, admitted, collect, events,
                                       until_disconnect)

log = logging.getLogger(__name__)
MAX_PROMPT_BYTES_PER_TOKEN = 16     # text beyond max_seq_len * this many bytes is refused before it is tokenized
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/version", "/metrics",
             "/openapi.json")
__all__ = ["create_app", "MAX_HEADER_BYTES", "OpenAIServer"]


class OpenAIServer:
    def __init__(self, engine, model_name: str, max_request_bytes: int, reasoning: bool | None,
                 request_timeout: float | None, api_key_set: bool, body_timeout: float = BODY_TIMEOUT_S,
                 sse_keepalive: float = KEEPALIVE_S, special_tokens_in_content: bool = False):
        self.engine, self.model_name, self.max_request_bytes = engine, model_name, max_request_bytes
        self.special_tokens_in_content = special_tokens_in_content
        self.body_timeout, self.sse_keepalive = body_timeout, sse_keepalive
        self.request_timeout = request_timeout
        self.tokenizer = engine.tokenizer
        self.reasoning = template_uses_thinking(self.tokenizer) if reasoning is None else reasoning
        self.metrics = ServerMetrics(lambda: engine.stats())
        self.vocab_size = getattr(self.tokenizer, "vocab_size", None)
        self.admission = Admission()
        self.openapi = openapi_document(model_name, max_request_bytes, api_key_set)

    def _check_model(self, req: P.GenerateRequest) -> P.GenerateRequest:
        if req.model is not None and req.model != self.model_name:
            raise P.RequestError(f"the model '{req.model[:200]}' does not exist (this server serves "
                                 f"'{self.model_name}')", status=404, param="model", code="model_not_found")
        return req

    def _check_prompt_size(self, req: P.GenerateRequest) -> None:
        """Text is bounded in bytes before it is tokenized (which holds the GIL for ~1 s per MB); token ids are
        checked against the context by _check_length."""
        if req.kind == "completion" and not isinstance(req.prompt, str):
            return
        limit = self.engine.max_seq_len * MAX_PROMPT_BYTES_PER_TOKEN
        what = "messages" if req.kind == "chat" else "prompt"
        text = req.prompt if req.kind == "completion" else json.dumps(req.messages, ensure_ascii=False)
        n = len(text.encode("utf-8", "surrogatepass"))
        if n > limit:
            raise P.RequestError(f"the {what} is {n} bytes; this model's maximum context length is "
                                 f"{self.engine.max_seq_len} tokens, and prompts longer than {limit} bytes are "
                                 f"refused before tokenizing", param=what, code="context_length_exceeded")

    def _check_length(self, req: P.GenerateRequest, prompt_ids: list[int]) -> None:
        if self.vocab_size:
            bad = [t for t in (*prompt_ids, *req.params.stop_token_ids) if t >= self.vocab_size]
            if bad:
                raise P.RequestError(f"token id {bad[0]} is out of range (vocabulary size {self.vocab_size})")
        n, limit, what = len(prompt_ids), self.engine.max_seq_len, "messages" if req.kind == "chat" else "prompt"
        if req.max_tokens is None:
            if n >= limit:
                raise P.RequestError(f"this model's maximum context length is {limit} tokens, but the prompt has "
                                     f"{n} tokens", param=what, code="context_length_exceeded")
            req.params.max_tokens = limit - n
        elif n + req.max_tokens > limit:
            raise P.RequestError(f"this model's maximum context length is {limit} tokens, but {n + req.max_tokens}"
                                 f" were requested ({n} in the prompt, {req.max_tokens} for the completion)",
                                 param="max_tokens", code="context_length_exceeded")
        else:
            req.params.max_tokens = req.max_tokens

    def _token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _token_bytes(self, tid: int) -> bytes:
        raw = getattr(self.tokenizer, "token_bytes", None)
        return raw(tid) if raw is not None else self._token_text(tid).encode("utf-8")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _render_chat(self, req: P.GenerateRequest) -> tuple[list[int], bool]:
        try:
            ids = self.tokenizer.encode_chat(req.messages, add_generation_prompt=True,
                                             special_tokens_in_content=self.special_tokens_in_content,
                                             **req.chat_template_kwargs)
            opens = self.reasoning and prompt_opens_reasoning(self.tokenizer.apply_chat_template(
                req.messages, add_generation_prompt=True, **req.chat_template_kwargs))
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise P.RequestError(f"the chat template refused the messages: {' '.join(str(e).split())[:300]}",
                                 param="messages") from None
        return list(ids), opens

    async def _read(self, request: Request):
        self.admission.check()
        return await self.admission.guard(read_json(request, self.max_request_bytes, self.body_timeout))

    async def chat(self, request: Request) -> Response:
        req = self._check_model(P.parse_chat_request(await self._read(request)))
        self._check_prompt_size(req)
        ids, opens = await asyncio.to_thread(self._render_chat, req)      # a 1 MB prompt takes ~1 s: off the loop
        return await self._generate(request, req, ids, opens)

    async def completions(self, request: Request) -> Response:
        req = self._check_model(P.parse_completion_request(await self._read(request)))
        self._check_prompt_size(req)
        ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt) if isinstance(req.prompt, str) else req.prompt
        return await self._generate(request, req, list(ids), False)

    async def _generate(self, request: Request, req: P.GenerateRequest, ids: list[int], opens: bool) -> Response:
        self._check_length(req, ids)
        self.admission.check()                               # a drain may have begun while the body was read
        rid = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        gen = Generation(self.engine, self.metrics, rid, ids, req.params, self.request_timeout,
                         self.admission.live)
        rp = Reply(req, rid, int(time.time()), self.model_name, len(ids), self.reasoning and req.kind == "chat",
                   opens, TokenText(self._token_text, self._token_bytes, self._decode))
        body = None
        try:
            first = await admitted(gen) if req.stream else await until_disconnect(request.receive, gen.next())
            if first is not GONE and not req.stream:
                body = await until_disconnect(request.receive, collect(gen, rp, first))
        except REFUSALS:
            await gen.close()
            raise
        except RequestTimeout as e:
            await gen.close()
            return JSONResponse(timeout_body(e), status_code=504)
        except Exception:
            log.exception("generation %s failed", rid)
            await gen.close()
            return error_response(500, GENERATION_FAILED)
        except BaseException:
            await gen.close()
            raise
        gone = first is GONE or body is GONE
        if gone or not req.stream:
            await gen.close()
            return Response(status_code=499) if gone else JSONResponse(body)       # 499: nobody is listening
        return SSEResponse(events(gen, rp, first, self.sse_keepalive), gen.close)

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


def create_app(engine, *, model_name: str, api_key: str | None = None, max_request_bytes: int = 1_000_000,
               reasoning: bool | None = None, manage_engine: bool = False,
               request_timeout: float | None = None, body_timeout: float = BODY_TIMEOUT_S,
               max_in_flight: int = MAX_IN_FLIGHT, sse_keepalive: float = KEEPALIVE_S,
               special_tokens_in_content: bool = False) -> Starlette:
    """reasoning: split <think> blocks into reasoning_content (None: when the chat template mentions <think>).
    manage_engine: start the engine at app startup and shut it down at exit (inside the server's event loop).
    request_timeout: seconds from arrival after which a generation is aborted (504, or an error event mid-stream).
    body_timeout: seconds for the whole request body to arrive (408). max_in_flight: requests at once (503).
    sse_keepalive: seconds between SSE comments while a stream waits for its first token (headers go at once).
    special_tokens_in_content: let special-token text in chat message content become control tokens (default:
    it is encoded as plain text, so a user cannot open a system turn).
    app.state.server.admission.drain(grace) starts a graceful shutdown (run.py calls it on SIGTERM)."""
    if request_timeout is not None and not request_timeout > 0:
        raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
    check_api_key(api_key)                           # now: Starlette builds the Gate at the first request
    if not body_timeout > 0:
        raise ValueError(f"body_timeout must be > 0 seconds, got {body_timeout}")
    srv = OpenAIServer(engine, model_name, max_request_bytes, reasoning, request_timeout, api_key is not None,
                       body_timeout, sse_keepalive, special_tokens_in_content)

    @asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                engine.shutdown()

    routes = [Route("/v1/chat/completions", srv.chat, methods=["POST"]),
              Route("/v1/completions", srv.completions, methods=["POST"]),
              Route("/v1/models", srv.models, methods=["GET"]),
              Route("/v1/models/{name:path}", srv.model, methods=["GET"]),
              Route("/health", srv.health, methods=["GET"]),
              Route("/version", srv.version, methods=["GET"]),
              Route("/metrics", srv.metrics_text, methods=["GET"]),
              Route("/openapi.json", srv.openapi_json, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers=HANDLERS, lifespan=lifespan)
    app.state.server = srv
    app.add_middleware(Gate, metrics=srv.metrics, api_key=api_key, endpoints=ENDPOINTS, max_in_flight=max_in_flight)
    return app

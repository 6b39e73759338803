"""The OpenAI-compatible HTTP app: /v1/chat/completions, /v1/completions, /v1/models, /health, /version, /metrics.

Every generation request is one engine request. A client that disconnects (while waiting or mid-stream) has
its engine request closed and aborted. Errors use the OpenAI error shape; engine failures never leak details.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from xserv_aot import __version__
from xserv_aot.engine.api import InvalidRequestError, QueueFullError, RequestOutput, RequestTooLongError
from xserv_aot.server import protocol as P
from xserv_aot.server.metrics import ServerMetrics
from xserv_aot.server.reasoning import (ReasoningParser, prompt_opens_reasoning, split_reasoning,
                                        template_uses_thinking)

log = logging.getLogger(__name__)
REFUSALS = (QueueFullError, RequestTooLongError, InvalidRequestError)   # the engine refused before starting
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/version", "/metrics")
MAX_HEADER_BYTES = 16 * 1024                         # all request header names + values
_GONE = object()                                     # the client disconnected before the result was ready


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, status, param, code), status_code=status, headers=headers)


def _sse(obj) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, allow_nan=False,
                                                       separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _usage(final: RequestOutput, n_prompt: int) -> dict:
    return P.usage(final.num_prompt_tokens or n_prompt, final.num_generated_tokens, final.num_cached_tokens)


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(receive, coro):
    """Run coro; if the client disconnects first, cancel it and return _GONE. Exceptions propagate."""
    work, watch = asyncio.ensure_future(coro), asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, watch):
            t.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    return _GONE if work.cancelled() else work.result()


class _Gate:
    """ASGI wrapper: header-size limit, bearer-key check (all routes but /health), requests-by-endpoint+status."""

    def __init__(self, app, metrics: ServerMetrics, api_key: str | None):
        self.app, self.metrics = app, metrics
        self.key = None if api_key is None else api_key.encode()

    def _authorized(self, scope) -> bool:
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

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
                await _error(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")(scope, receive, send_status)
            elif self.key is not None and scope["path"] != "/health" and not self._authorized(scope):
                await _error(401, "invalid or missing API key (Authorization: Bearer <key>)",
                             code="invalid_api_key")(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            path = scope["path"]
            endpoint = path if path in ENDPOINTS else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
            self.metrics.requests.labels(endpoint, str(status[0])).inc()


class _Generation:
    """One engine request: pulls outputs, records metrics, aborts the request if closed before it finished."""

    def __init__(self, engine, metrics: ServerMetrics, rid: str, prompt_ids: list[int], params):
        self.engine, self.metrics, self.rid = engine, metrics, rid
        self.t0, self.t_first = time.monotonic(), None
        self.final: RequestOutput | None = None
        self.refused = self.failed = False
        self.n_prompt = len(prompt_ids)
        self._it = engine.generate(rid, prompt_ids, params)

    async def next(self) -> RequestOutput:
        try:
            out = await anext(self._it)
        except REFUSALS:
            self.refused = True
            raise
        except StopAsyncIteration:
            self.failed = True
            raise RuntimeError(f"engine stream for {self.rid} ended without a finish_reason") from None
        except Exception:
            self.failed = True
            raise
        now, m = time.monotonic(), self.metrics
        if out.new_token_ids:
            m.generation_tokens.inc(len(out.new_token_ids))
            if self.t_first is None:
                self.t_first = now
                m.ttft.observe(now - self.t0)
        if out.finish_reason is not None:
            self.final = out
            m.e2e.observe(now - self.t0)
            if out.num_generated_tokens > 1 and self.t_first is not None:
                m.tpot.observe((now - self.t_first) / (out.num_generated_tokens - 1))
            m.prompt_tokens.inc(out.num_prompt_tokens or self.n_prompt)
            m.finished.labels(out.finish_reason).inc()
            if out.finish_reason == "abort":
                m.aborted.inc()
        return out

    async def close(self) -> None:
        await self._it.aclose()
        if self.final is None and not self.refused:
            reason = "error" if self.failed else "abort"
            self.engine.abort(self.rid)
            self.metrics.finished.labels(reason).inc()
            if reason == "abort":
                self.metrics.aborted.inc()
            self.final = RequestOutput(self.rid, [], "", finish_reason=reason)


class _SSEResponse:
    """text/event-stream body from an async iterator of bytes; on disconnect the iterator is closed."""

    def __init__(self, events: AsyncIterator[bytes], on_close):
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send):
        async def pump():
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        try:
            await _until_disconnect(receive, pump())
        except OSError:
            pass                                         # ASGI >= 2.4 servers report a gone client from send()
        finally:
            await self.events.aclose()
            await self.on_close()


class OpenAIServer:
    def __init__(self, engine, model_name: str, max_request_bytes: int, reasoning: bool | None):
        self.engine, self.model_name, self.max_request_bytes = engine, model_name, max_request_bytes
        self.tokenizer = engine.tokenizer
        self.reasoning = template_uses_thinking(self.tokenizer) if reasoning is None else reasoning
        self.metrics = ServerMetrics(lambda: engine.stats())
        self.vocab_size = getattr(self.tokenizer, "vocab_size", None)

    async def _read_json(self, request: Request):
        limit = self.max_request_bytes
        length = request.headers.get("content-length", "")
        too_big = P.RequestError(f"request body exceeds {limit} bytes", status=413, code="request_too_large")
        if length.isdigit() and int(length) > limit:
            raise too_big
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:
            raise P.RequestError(f"request body is not valid JSON ({type(e).__name__}: {e})") from None

    def _check_model(self, req: P.GenerateRequest) -> P.GenerateRequest:
        if req.model is not None and req.model != self.model_name:
            raise P.RequestError(f"the model '{req.model}' does not exist (this server serves "
                                 f"'{self.model_name}')", status=404, param="model", code="model_not_found")
        return req

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

    async def chat(self, request: Request) -> Response:
        req = self._check_model(P.parse_chat_request(await self._read_json(request)))
        try:
            ids = self.tokenizer.encode_chat(req.messages, add_generation_prompt=True, **req.chat_template_kwargs)
            opens = self.reasoning and prompt_opens_reasoning(self.tokenizer.apply_chat_template(
                req.messages, add_generation_prompt=True, **req.chat_template_kwargs))
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise P.RequestError(f"the chat template refused the messages: {e}", param="messages") from None
        return await self._generate(request, req, list(ids), opens)

    async def completions(self, request: Request) -> Response:
        req = self._check_model(P.parse_completion_request(await self._read_json(request)))
        ids = self.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else req.prompt
        return await self._generate(request, req, list(ids), False)

    async def _generate(self, request: Request, req: P.GenerateRequest, ids: list[int], opens: bool) -> Response:
        self._check_length(req, ids)
        rid = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        gen = _Generation(self.engine, self.metrics, rid, ids, req.params)
        ctx = dict(rid=rid, created=int(time.time()), model=self.model_name)
        body = None
        try:
            first = await _until_disconnect(request.receive, gen.next())
            if first is not _GONE and not req.stream:
                body = await _until_disconnect(request.receive, self._collect(gen, req, first, ids, opens, ctx))
        except REFUSALS:
            await gen.close()
            raise
        except Exception:
            log.exception("generation %s failed", rid)
            await gen.close()
            return _error(500, "internal error while generating")
        except BaseException:
            await gen.close()
            raise
        if first is _GONE or body is _GONE:
            await gen.close()
            return Response(status_code=499)                 # nobody is listening any more
        if not req.stream:
            return JSONResponse(body)
        return _SSEResponse(self._events(gen, req, first, len(ids), opens, ctx), gen.close)

    async def _collect(self, gen: _Generation, req, out: RequestOutput, ids, opens: bool, ctx: dict) -> dict:
        text, lps = [], []
        while True:
            text.append(out.text)
            lps.extend(out.logprobs or [])
            if out.finish_reason is not None:
                break
            out = await gen.next()
        if out.finish_reason == "error":
            raise RuntimeError(f"engine error for {gen.rid}: {out.error}")
        usage = _usage(out, len(ids))
        want_lps = req.params.logprobs is not None
        if req.kind == "completion":
            lp = P.completion_logprobs(lps, self._token_text, 0) if want_lps else None
            return P.completion_response(**ctx, text="".join(text), logprobs=lp, finish_reason=out.finish_reason,
                                         usage_=usage)
        message = {"content": "".join(text)}
        if self.reasoning:
            reasoning, content = split_reasoning(message["content"], opens)
            message = {"content": content if content or reasoning is None else None, "reasoning_content": reasoning}
        lp = P.chat_logprobs(lps, self._token_text) if want_lps else None
        return P.chat_response(**ctx, message=message, logprobs=lp, finish_reason=out.finish_reason, usage_=usage)

    async def _events(self, gen: _Generation, req, out: RequestOutput, n_prompt: int, opens: bool, ctx: dict):
        chat, with_usage = req.kind == "chat", req.include_usage
        parser = ReasoningParser(opens) if chat and self.reasoning else None
        pending, offset = [], 0
        if chat:
            yield _sse(P.chat_chunk(**ctx, delta={"role": "assistant", "content": ""}, with_usage=with_usage))
        try:
            while True:
                done = out.finish_reason is not None
                if out.finish_reason == "error":
                    log.error("engine error for %s: %s", gen.rid, out.error)
                    yield _sse(P.error_body("internal error while generating", 500))
                    break
                pending.extend(out.logprobs or [])
                r, c = parser.feed(out.text) if parser else ("", out.text)
                if parser and done:
                    r2, c2 = parser.flush()
                    r, c = r + r2, c + c2
                if r or c or done:
                    want = req.params.logprobs is not None
                    if chat:
                        delta = {k: v for k, v in (("reasoning_content", r), ("content", c)) if v}
                        lp = P.chat_logprobs(pending, self._token_text) if want else None
                        chunk = P.chat_chunk(**ctx, delta=delta, logprobs=lp, finish_reason=out.finish_reason,
                                             with_usage=with_usage)
                    else:
                        lp = P.completion_logprobs(pending, self._token_text, offset) if want else None
                        chunk = P.completion_chunk(**ctx, text=c, logprobs=lp, finish_reason=out.finish_reason,
                                                   with_usage=with_usage)
                        offset += len(c)
                    pending = []
                    yield _sse(chunk)
                if done:
                    if with_usage:
                        usage = _usage(out, n_prompt)
                        yield _sse(P.usage_chunk(**ctx, kind=req.kind, usage_=usage))
                    break
                out = await gen.next()
        except Exception:
            log.exception("generation %s failed mid-stream", gen.rid)
            yield _sse(P.error_body("internal error while generating", 500))
        yield _sse("[DONE]")

    def _card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "xserv-aot",
                "root": self.model_name, "parent": None, "max_model_len": self.engine.max_seq_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name != self.model_name:
            return _error(404, f"the model '{name}' does not exist", "model", "model_not_found")
        return JSONResponse(self._card())

    async def health(self, request: Request) -> Response:
        try:
            healthy = self.engine.stats().healthy
        except Exception:
            log.exception("engine.stats() failed in /health")
            healthy = False
        return JSONResponse({"status": "ok"}) if healthy else _error(503, "engine is not healthy")

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def metrics_text(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)


async def _request_error(request, exc: P.RequestError):
    return _error(exc.status, exc.message, exc.param, exc.code)


async def _http_error(request, exc: HTTPException):
    return _error(exc.status_code, exc.detail, headers=exc.headers)


async def _too_long(request, exc: RequestTooLongError):
    return _error(400, str(exc), "max_tokens", "context_length_exceeded")


async def _invalid(request, exc: InvalidRequestError):
    return _error(400, str(exc))


async def _queue_full(request, exc: QueueFullError):
    return _error(429, "the server is at capacity; retry later", code="queue_full", headers={"Retry-After": "1"})


async def _internal(request, exc: Exception):
    log.error("unhandled error in %s", request.url.path, exc_info=exc)
    return _error(500, "internal server error")


def create_app(engine, *, model_name: str, api_key: str | None = None, max_request_bytes: int = 1_000_000,
               reasoning: bool | None = None, manage_engine: bool = False) -> Starlette:
    """reasoning: split <think> blocks into reasoning_content (None: when the chat template mentions <think>).
    manage_engine: start the engine at app startup and shut it down at exit (inside the server's event loop)."""
    srv = OpenAIServer(engine, model_name, max_request_bytes, reasoning)

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
              Route("/metrics", srv.metrics_text, methods=["GET"])]
    handlers = {P.RequestError: _request_error, HTTPException: _http_error, RequestTooLongError: _too_long,
                InvalidRequestError: _invalid, QueueFullError: _queue_full, Exception: _internal}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.server = srv
    app.add_middleware(_Gate, metrics=srv.metrics, api_key=api_key)
    return app

"""The OpenAI-compatible HTTP app: OpenAIServer (the /v1/chat/completions, /v1/completions, /tokenize and
/detokenize handlers) and create_app (option checks, the route table, the Gate middleware). The read-only endpoints
(/v1/models, /health, /version, /metrics, /openapi.json) are InfoRoutes, a mixin in server/info.py.

Every generation request is one engine request. A client that disconnects (while waiting or mid-stream) has
its engine request closed and aborted; so has one that runs past request_timeout. Errors use the OpenAI error
shape; engine failures never leak details. Messages are data handed to the model's own (sandboxed) chat template.
"""
from __future__ import annotations

import asyncio
import dataclasses
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

from xserv_aot.engine.api import SamplingParams
from xserv_aot.server import protocol as P
from xserv_aot.server import tokenize as T
from xserv_aot.server.body import BODY_TIMEOUT_S, read_json
from xserv_aot.server.errors import (GENERATION_FAILED, HANDLERS, REFUSALS, RequestTimeout, error_response,
                                     timeout_body)
from xserv_aot.server.gate import MAX_HEADER_BYTES, MAX_IN_FLIGHT, OPEN_PATHS, Gate, check_api_key
from xserv_aot.server.info import InfoRoutes
from xserv_aot.server.lifecycle import Admission
from xserv_aot.server.metrics import ServerMetrics
from xserv_aot.server.openapi import openapi_document
from xserv_aot.server.reasoning import prompt_opens_reasoning, template_uses_thinking
from xserv_aot.server.responses import TokenText
from xserv_aot.server.choices import Reply, collect, events
from xserv_aot.server.streaming import GONE, KEEPALIVE_S, Generation, SSEResponse, admitted, until_disconnect
from xserv_aot.server.tools import PARSERS, default_parser

log = logging.getLogger(__name__)
MAX_PROMPT_BYTES_PER_TOKEN = 16     # text beyond max_seq_len * this many bytes is refused before it is tokenized
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/version", "/metrics",
             "/openapi.json", "/tokenize", "/detokenize")
__all__ = ["create_app", "MAX_HEADER_BYTES", "OpenAIServer"]


class OpenAIServer(InfoRoutes):
    def __init__(self, engine, model_name: str, max_request_bytes: int, reasoning: bool | None,
                 request_timeout: float | None, api_key_set: bool, tool_call_parser: str | None = None,
                 open_paths: tuple[str, ...] = OPEN_PATHS, body_timeout: float = BODY_TIMEOUT_S,
                 sse_keepalive: float = KEEPALIVE_S, special_tokens_in_content: bool = False):
        self.engine, self.model_name, self.max_request_bytes = engine, model_name, max_request_bytes
        self.special_tokens_in_content = special_tokens_in_content
        self.body_timeout, self.sse_keepalive = body_timeout, sse_keepalive
        self.request_timeout = request_timeout
        self.tokenizer = engine.tokenizer
        self.reasoning = template_uses_thinking(self.tokenizer) if reasoning is None else reasoning
        self.metrics = ServerMetrics(lambda: engine.stats(), model_name)
        self.vocab_size = getattr(self.tokenizer, "vocab_size", None)
        self.defaults = dict(getattr(engine, "generation_defaults", None) or {})
        self.tool_parser = tool_call_parser or default_parser(getattr(self.tokenizer, "chat_template", None))
        self.admission = Admission()
        self.openapi = openapi_document(model_name, max_request_bytes, api_key_set, open_paths)

    def _check_model(self, req):
        """req (anything with .model, or a dict with "model"), after a 404 for a model this server does not serve."""
        model = req.get("model") if isinstance(req, dict) else req.model
        if isinstance(model, str) and model != self.model_name:
            raise P.RequestError(f"the model '{model[:200]}' does not exist (this server serves "
                                 f"'{self.model_name}')", status=404, param="model", code="model_not_found")
        return req

    def _check_prompt_size(self, req: P.GenerateRequest) -> None:
        """Text is bounded in bytes before it is tokenized (which holds the GIL for ~1 s per MB); token ids are
        checked against the context by _check_length."""
        limit = self.engine.max_seq_len * MAX_PROMPT_BYTES_PER_TOKEN
        what = "messages" if req.kind == "chat" else "prompt"
        texts = ([p for p in req.prompts if isinstance(p, str)] if req.kind == "completion"
                 else [json.dumps(req.messages, ensure_ascii=False)])
        for text in texts:
            n = len(text.encode("utf-8", "surrogatepass"))
            if n > limit:
                raise P.RequestError(f"the {what} is {n} bytes; this model's maximum context length is "
                                     f"{self.engine.max_seq_len} tokens, and prompts longer than {limit} bytes are "
                                     f"refused before tokenizing", param=what, code="context_length_exceeded")

    def _check_length(self, req: P.GenerateRequest, prompt_ids: list[int]) -> int:
        """max_tokens for this prompt (the request's, or what the context leaves)."""
        if self.vocab_size:
            bad = [t for t in (*prompt_ids, *req.params.stop_token_ids, *req.params.logit_bias)
                   if t >= self.vocab_size]
            if bad:
                raise P.RequestError(f"token id {bad[0]} is out of range (vocabulary size {self.vocab_size})")
        n, limit, what = len(prompt_ids), self.engine.max_seq_len, "messages" if req.kind == "chat" else "prompt"
        if req.max_tokens is None:
            if n >= limit:
                raise P.RequestError(f"this model's maximum context length is {limit} tokens, but the prompt has "
                                     f"{n} tokens", param=what, code="context_length_exceeded")
            return min(limit - n, self.defaults.get("max_tokens", limit))     # the model's max_new_tokens, if any
        if n + req.max_tokens > limit:
            raise P.RequestError(f"this model's maximum context length is {limit} tokens, but {n + req.max_tokens}"
                                 f" were requested ({n} in the prompt, {req.max_tokens} for the completion)",
                                 param="max_tokens", code="context_length_exceeded")
        return req.max_tokens

    def _sample_params(self, req: P.GenerateRequest, prompt_ids: list[int], j: int) -> SamplingParams:
        """Sample j of a prompt: its own max_tokens; seeded requests give sample j the seed + j."""
        max_tokens = self._check_length(req, prompt_ids)
        p = dataclasses.replace(req.params, max_tokens=max_tokens, min_tokens=min(req.params.min_tokens, max_tokens))
        if p.seed is not None and j:
            p.seed = (p.seed + j) % 2 ** 64
        return p

    def _token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _token_bytes(self, tid: int) -> bytes:
        raw = getattr(self.tokenizer, "token_bytes", None)
        return raw(tid) if raw is not None else self._token_text(tid).encode("utf-8")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _render_chat(self, req: P.GenerateRequest) -> tuple[list[int], bool]:
        try:
            kwargs = {**req.chat_template_kwargs, **({"tools": req.tools.tools} if req.tools else {})}
            ids = self.tokenizer.encode_chat(req.messages, add_generation_prompt=True,
                                             special_tokens_in_content=self.special_tokens_in_content, **kwargs)
            opens = self.reasoning and prompt_opens_reasoning(self.tokenizer.apply_chat_template(
                req.messages, add_generation_prompt=True, **kwargs))
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise P.RequestError(f"the chat template refused the messages: {' '.join(str(e).split())[:300]}",
                                 param="messages") from None
        return list(ids), opens

    async def _read(self, request: Request):
        self.admission.check()
        return await self.admission.guard(read_json(request, self.max_request_bytes, self.body_timeout))

    async def chat(self, request: Request) -> Response:
        req = self._check_model(P.parse_chat_request(await self._read(request), self.defaults))
        self._check_prompt_size(req)
        ids, opens = await asyncio.to_thread(self._render_chat, req)      # a 1 MB prompt takes ~1 s: off the loop
        return await self._generate(request, req, [ids], opens)

    async def completions(self, request: Request) -> Response:
        req = self._check_model(P.parse_completion_request(await self._read(request), self.defaults))
        self._check_prompt_size(req)
        prompts = [await asyncio.to_thread(self.tokenizer.encode, p) if isinstance(p, str) else p
                   for p in req.prompts]
        return await self._generate(request, req, [list(p) for p in prompts], False)

    async def _generate(self, request: Request, req: P.GenerateRequest, prompts: list[list[int]],
                        opens: bool) -> Response:
        """One engine request per (prompt, sample); choice i of the response is sample i % n of prompt i // n."""
        k = req.n_samples
        plan = [(ids, self._sample_params(req, ids, j)) for ids in prompts for j in range(k)]
        self.admission.check()                               # a drain may have begun while the body was read
        rid = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        echo = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in plan] if req.echo else []
        rp = Reply(req, rid, int(time.time()), self.model_name, sum(len(p) for p in prompts),
                   self.reasoning and req.kind == "chat", opens,
                   TokenText(self._token_text, self._token_bytes, self._decode), self.tool_parser, echo)
        gens: list[Generation] = []
        body = None
        try:
            for i, (ids, params) in enumerate(plan):
                gens.append(Generation(self.engine, self.metrics, rid if len(plan) == 1 else f"{rid}-{i}", ids,
                                       params, self.request_timeout, self.admission.live))
            if req.stream:                                   # headers at once; keep-alives while queued
                firsts = await admitted(gens)
            else:
                firsts = await until_disconnect(request.receive, asyncio.gather(*(g.next() for g in gens)))
            if firsts is not GONE and not req.stream:
                body = await until_disconnect(request.receive, collect(gens, rp, firsts))
        except REFUSALS:
            await _close(gens)
            raise
        except RequestTimeout as e:
            await _close(gens)
            return JSONResponse(timeout_body(e), status_code=504)
        except Exception:
            log.exception("generation %s failed", rid)
            await _close(gens)
            return error_response(500, GENERATION_FAILED)
        except BaseException:
            await _close(gens)
            raise
        gone = firsts is GONE or body is GONE
        if gone or not req.stream:
            await _close(gens)
            return Response(status_code=499) if gone else JSONResponse(body)       # 499: nobody is listening
        return SSEResponse(events(gens, rp, firsts, self.sse_keepalive), lambda: _close(gens))

    async def tokenize(self, request: Request) -> Response:
        t = self._check_model(T.parse_tokenize(await read_json(request, self.max_request_bytes)))
        if "chat" in t:
            req = t["chat"]
            kwargs = {**req.chat_template_kwargs, **({"tools": req.tools.tools} if req.tools else {})}
            try:
                ids = await asyncio.to_thread(self.tokenizer.encode_chat, req.messages,
                                              add_generation_prompt=t["add_generation_prompt"], **kwargs)
            except (jinja2.TemplateError, ValueError, TypeError) as e:
                raise P.RequestError(f"the chat template refused the messages: {' '.join(str(e).split())[:300]}",
                                     param="messages") from None
        else:
            ids = await asyncio.to_thread(self.tokenizer.encode, t["prompt"], t["add_special_tokens"])
        ids = list(ids)
        strs = [self.tokenizer.id_to_token(i) for i in ids] if t["return_token_strs"] else None
        return JSONResponse(T.tokenize_body(ids, self.engine.max_seq_len, strs))

    async def detokenize(self, request: Request) -> Response:
        body = await read_json(request, self.max_request_bytes)
        ids = T.parse_detokenize(body, self.vocab_size)
        self._check_model(body)
        return JSONResponse({"prompt": self.tokenizer.decode(ids, skip_special_tokens=False)})


async def _close(gens: list[Generation]) -> None:
    for g in gens:
        await g.close()


def create_app(engine, *, model_name: str, api_key: str | None = None, max_request_bytes: int = 1_000_000,
               reasoning: bool | None = None, manage_engine: bool = False,
               request_timeout: float | None = None, tool_call_parser: str | None = None,
               metrics_require_key: bool = True, body_timeout: float = BODY_TIMEOUT_S,
               max_in_flight: int = MAX_IN_FLIGHT, sse_keepalive: float = KEEPALIVE_S,
               special_tokens_in_content: bool = False) -> Starlette:
    """reasoning: split <think> blocks into reasoning_content (None: when the chat template mentions <think>).
    manage_engine: start the engine at app startup and shut it down at exit (inside the server's event loop).
    request_timeout: seconds from arrival after which a generation is aborted (504, or an error event mid-stream).
    tool_call_parser: how tool_choice auto finds calls in the text (server/tools.py; None: from the template).
    metrics_require_key: /metrics needs the API key too (False: open like vLLM's, for key-less Prometheus scrapes).
    body_timeout: seconds for the whole request body to arrive (408). max_in_flight: requests at once (503).
    sse_keepalive: seconds between SSE comments while a stream waits for its first token (headers go at once).
    special_tokens_in_content: let special-token text in chat message content become control tokens (default:
    it is encoded as plain text, so a user cannot open a system turn).
    app.state.server.admission.drain(grace) starts a graceful shutdown (run.py calls it on SIGTERM)."""
    if request_timeout is not None and not request_timeout > 0:
        raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {tool_call_parser!r}")
    check_api_key(api_key)                           # now: Starlette builds the Gate at the first request
    if not body_timeout > 0:
        raise ValueError(f"body_timeout must be > 0 seconds, got {body_timeout}")
    open_paths = OPEN_PATHS + (("/metrics",) if not metrics_require_key else ())
    srv = OpenAIServer(engine, model_name, max_request_bytes, reasoning, request_timeout, api_key is not None,
                       tool_call_parser, open_paths, body_timeout, sse_keepalive, special_tokens_in_content)

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
              Route("/openapi.json", srv.openapi_json, methods=["GET"]),
              Route("/tokenize", srv.tokenize, methods=["POST"]),
              Route("/detokenize", srv.detokenize, methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers=HANDLERS, lifespan=lifespan)
    app.state.server = srv
    app.add_middleware(Gate, metrics=srv.metrics, api_key=api_key, endpoints=ENDPOINTS, max_in_flight=max_in_flight,
                       open_paths=open_paths)
    return app

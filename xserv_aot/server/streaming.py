"""One generation request from first output to last: the engine stream (deadline, metrics, abort on close), client
disconnect detection, and the two ways out: a full response body (collect) or server-sent events (events).

Every stream that started ends with a final chunk or an error event, then `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from xserv_aot.engine.api import RequestOutput
from xserv_aot.server import responses as R
from xserv_aot.server.errors import GENERATION_FAILED, REFUSALS, RequestTimeout, timeout_body
from xserv_aot.server.metrics import ServerMetrics
from xserv_aot.server.protocol import GenerateRequest
from xserv_aot.server.reasoning import ReasoningParser, split_reasoning

log = logging.getLogger(__name__)
GONE = object()                                      # the client disconnected before the result was ready
KEEPALIVE_S = 15.0                                   # SSE comment interval while a stream waits for its first token
KEEPALIVE = b": keep-alive\n\n"
ADMIT_YIELDS = 8                                     # loop turns an engine gets to refuse a request synchronously


def sse(obj) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, allow_nan=False,
                                                       separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive, coro):
    """Run coro; if the client disconnects first, cancel it and return GONE. Exceptions propagate."""
    work, watch = asyncio.ensure_future(coro), asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, watch):
            t.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    return GONE if work.cancelled() else work.result()


class Generation:
    """One engine request: pulls outputs before its deadline, records metrics, and aborts the engine request if
    closed before it finished. `live` (a set) holds it from creation until close()."""

    def __init__(self, engine, metrics: ServerMetrics, rid: str, prompt_ids: list[int], params,
                 timeout: float | None, live: set):
        self.engine, self.metrics, self.rid, self.timeout, self.live = engine, metrics, rid, timeout, live
        self.t0, self.t_first = time.monotonic(), None
        self.final: RequestOutput | None = None
        self.refused = self.failed = False
        self.n_prompt = len(prompt_ids)
        live.add(self)
        self._it = engine.generate(rid, prompt_ids, params)

    async def _pull(self) -> RequestOutput:
        if self.timeout is None:
            return await anext(self._it)
        left = self.t0 + self.timeout - time.monotonic()
        try:
            return await asyncio.wait_for(anext(self._it), max(left, 0.0))
        except TimeoutError:
            self.metrics.timeouts.inc()
            raise RequestTimeout(self.timeout) from None

    async def next(self) -> RequestOutput:
        try:
            out = await self._pull()
        except (*REFUSALS, RequestTimeout) as e:
            self.refused = isinstance(e, REFUSALS)
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

    def abort(self) -> None:
        """Ask the engine to end this request now; its final output (finish_reason "abort") still arrives."""
        self.engine.abort(self.rid)

    async def close(self) -> None:
        try:
            await self._it.aclose()
            if self.final is None and not self.refused:
                reason = "error" if self.failed else "abort"
                self.engine.abort(self.rid)
                self.metrics.finished.labels(reason).inc()
                if reason == "abort":
                    self.metrics.aborted.inc()
                self.final = RequestOutput(self.rid, [], "", finish_reason=reason)
        finally:
            self.live.discard(self)


async def admitted(gen: "Generation"):
    """The first output if the engine produces it (or refuses the request) without waiting for a step; else the
    pending task, so a queued stream can send its headers at once."""
    task = asyncio.ensure_future(gen.next())
    for _ in range(ADMIT_YIELDS):
        if task.done():
            return task.result()
        await asyncio.sleep(0)
    return task


class SSEResponse:
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
            await until_disconnect(receive, pump())
        except OSError:
            pass                                         # ASGI >= 2.4 servers report a gone client from send()
        finally:
            await self.events.aclose()
            await self.on_close()


@dataclass
class Reply:
    """How one request's outputs become OpenAI bodies."""
    req: GenerateRequest
    rid: str
    created: int
    model: str
    n_prompt: int
    reasoning: bool                                  # split <think> blocks into reasoning_content (chat)
    opens: bool                                      # the prompt already opened a <think> block
    tokens: R.TokenText

    @property
    def ids(self) -> dict:
        return dict(rid=self.rid, created=self.created, model=self.model)

    def usage(self, final: RequestOutput) -> dict:
        return R.usage(final.num_prompt_tokens or self.n_prompt, final.num_generated_tokens,
                       final.num_cached_tokens)


async def collect(gen: Generation, rp: Reply, out: RequestOutput) -> dict:
    """The whole non-streaming response body; raises on an engine error."""
    req, text, lps = rp.req, [], []
    while True:
        text.append(out.text)
        lps.extend(out.logprobs or [])
        if out.finish_reason is not None:
            break
        out = await gen.next()
    if out.finish_reason == "error":
        raise RuntimeError(f"engine error for {gen.rid}: {out.error}")
    want_lps = req.params.logprobs is not None
    if req.kind == "completion":
        lp = R.completion_logprobs(lps, rp.tokens, []) if want_lps else None
        return R.completion_response(**rp.ids, text="".join(text), logprobs=lp, finish_reason=out.finish_reason,
                                     usage_=rp.usage(out))
    message = {"content": "".join(text)}
    if rp.reasoning:
        reasoning, content = split_reasoning(message["content"], rp.opens)
        message = {"content": content if content or reasoning is None else None, "reasoning_content": reasoning}
    lp = R.chat_logprobs(lps, rp.tokens) if want_lps else None
    return R.chat_response(**rp.ids, message=message, logprobs=lp, finish_reason=out.finish_reason,
                           usage_=rp.usage(out))


async def _first(task: asyncio.Future, keepalive: float) -> AsyncIterator[bytes]:
    """SSE comments every `keepalive` seconds until task (the first output) is done; cancels it if closed early."""
    try:
        while not (await asyncio.wait({task}, timeout=keepalive))[0]:
            yield KEEPALIVE
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def events(gen: Generation, rp: Reply, out, keepalive: float = KEEPALIVE_S) -> AsyncIterator[bytes]:
    """SSE chunks from the first output on (out: that output, or the task that will produce it, with keep-alive
    comments meanwhile); engine errors and timeouts become an error event before [DONE]."""
    req = rp.req
    chat, with_usage, want = req.kind == "chat", req.include_usage, req.params.logprobs is not None
    parser = ReasoningParser(rp.opens) if chat and rp.reasoning else None
    pending, emitted = [], []                          # logprobs not yet sent; ids of those sent
    if chat:
        yield sse(R.chat_chunk(**rp.ids, delta={"role": "assistant", "content": ""}, with_usage=with_usage))
    try:
        if isinstance(out, asyncio.Future):
            async for comment in _first(out, keepalive):
                yield comment
            out = out.result()
        while True:
            done = out.finish_reason is not None
            if out.finish_reason == "error":
                log.error("engine error for %s: %s", gen.rid, out.error)
                yield sse(R.error_body(GENERATION_FAILED, 500))
                break
            pending.extend(out.logprobs or [])
            r, c = parser.feed(out.text) if parser else ("", out.text)
            if parser and done:
                r2, c2 = parser.flush()
                r, c = r + r2, c + c2
            if r or c or done:
                if chat:
                    delta = {k: v for k, v in (("reasoning_content", r), ("content", c)) if v}
                    lp = R.chat_logprobs(pending, rp.tokens) if want else None
                    chunk = R.chat_chunk(**rp.ids, delta=delta, logprobs=lp, finish_reason=out.finish_reason,
                                         with_usage=with_usage)
                else:
                    lp = R.completion_logprobs(pending, rp.tokens, emitted) if want else None
                    chunk = R.completion_chunk(**rp.ids, text=c, logprobs=lp, finish_reason=out.finish_reason,
                                               with_usage=with_usage)
                    emitted += [x.token_id for x in pending]
                pending = []
                yield sse(chunk)
            if done:
                if with_usage:
                    yield sse(R.usage_chunk(**rp.ids, kind=req.kind, usage_=rp.usage(out)))
                break
            out = await gen.next()
    except RequestTimeout as e:
        log.warning("request %s timed out mid-stream", gen.rid)
        yield sse(timeout_body(e))
    except Exception:
        log.exception("generation %s failed mid-stream", gen.rid)
        yield sse(R.error_body(GENERATION_FAILED, 500))
    yield sse("[DONE]")

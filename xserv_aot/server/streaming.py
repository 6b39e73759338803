"""One engine request from first output to last: the engine stream (deadline, metrics, abort on close), client
disconnect detection, and the server-sent-events response. server/choices.py turns outputs into bodies."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator

from xserv_aot.engine.api import RequestOutput
from xserv_aot.server.errors import REFUSALS, RequestTimeout
from xserv_aot.server.metrics import ServerMetrics

log = logging.getLogger(__name__)
GONE = object()                                      # the client disconnected before the result was ready


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
        self.t0, self.t_first, self.t_last = time.monotonic(), None, None
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
            else:
                for _ in out.new_token_ids:
                    m.itl.observe((now - self.t_last) / len(out.new_token_ids))
            self.t_last = now
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

"""AsyncEngine: the LLMEngine loop in its own thread, bridged to asyncio.

asyncio -> engine: a thread-safe command queue ("add", "abort", "stop"), drained before every step.
engine -> asyncio: each request's outputs go into its own asyncio.Queue through loop.call_soon_threadsafe.

Failure policy (see llm_engine): when a step raises, the requests of that step end with finish_reason "error"
and a one-line error (no traceback; the traceback goes to the log), the other requests restart from their tokens
so far on a reset KV pool, and the loop keeps serving; stats().healthy stays True, stats().last_error and
consecutive_failures record the failure. After max_consecutive_failures failed steps in a row, or when recovery
itself fails, the engine has failed permanently: every open request ends with "error", the engine thread stops,
healthy is False for good and generate raises EngineFailedError.

Every stream gets a final output: when the thread stops (shutdown or failure) it closes the engine under the
stream lock, so no generate() can register after the last outputs were sent.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from typing import AsyncIterator, Callable

from xserv_aot.engine.api import (EngineFailedError, EngineStats, InvalidRequestError, QueueFullError,
                                  RequestOutput, SamplingParams)
from xserv_aot.engine.llm_engine import LLMEngine, one_line

log = logging.getLogger(__name__)


async def until_finished(q: asyncio.Queue, closed: Callable[[bool], None], coalesce: bool = False
                         ) -> AsyncIterator[RequestOutput]:
    """Yield a request's outputs up to its final one; closed(finished) runs however the consumer stops.
    coalesce: the outputs already queued when the consumer asks come as one (RequestOutput.extend), so a consumer
    that fell behind catches up with one chunk, not one per token."""
    finished = False
    try:
        while not finished:
            out = await q.get()
            while coalesce and out.finish_reason is None and not q.empty():
                out = out.extend(q.get_nowait())
            finished = out.finish_reason is not None
            yield out
    finally:
        closed(finished)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, model_name: str = "", max_waiting: int = 256,
                 generation_defaults: dict | None = None):
        self.engine = engine
        self.generation_defaults = dict(generation_defaults or {})     # the plan's, for the API (server)
        self.tokenizer = engine.tokenizer
        self.max_seq_len = engine.max_seq_len
        self.model_name = model_name
        self.max_waiting = max_waiting
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()                 # guards _streams, _pending_adds, _stats
        self._pending_adds = 0
        self._stats = engine.stats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dead: str | None = None                 # set when the engine failed permanently
        self._closed = True                           # no thread serving streams (guarded by _lock)
        engine.on_scheduled = lambda: self._publish([])

    # lifecycle

    def start(self) -> None:
        if (self._thread is not None and self._thread.is_alive()) or self._dead is not None:
            return
        self._stop.clear()
        with self._lock:
            self._closed = False
        self._thread = threading.Thread(target=self._loop, name="xserv-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; open requests end with finish_reason "abort"."""
        if self._thread is None:
            return
        self._stop.set()
        self._commands.put(("stop",))
        self._thread.join(timeout)
        self._thread = None

    # requests

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        params = params if params is not None else SamplingParams()
        self.engine.check_request(prompt_ids, params)
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        with self._lock:
            if self._closed or self._dead is not None or self._thread is None:
                raise EngineFailedError("engine is not running" + (f" ({self._dead})" if self._dead else ""))
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            if self._stats.num_waiting + self._pending_adds >= self.max_waiting:
                raise QueueFullError(f"too many waiting requests (max_waiting {self.max_waiting})")
            self._streams[request_id] = (loop, q)
            self._pending_adds += 1
            self._commands.put(("add", request_id, list(prompt_ids), params))

        def closed(finished: bool) -> None:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))
        async for out in until_finished(q, closed):
            yield out

    def abort(self, request_id: str) -> None:
        """Thread-safe; the engine frees the request's blocks before its next step. Unknown ids are ignored."""
        self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        """The engine's stats as of its last schedule; num_waiting also counts requests not yet picked up."""
        with self._lock:
            accepting = not self._closed and self._dead is None and self._thread is not None and self._thread.is_alive()
            return dataclasses.replace(self._stats, num_waiting=self._stats.num_waiting + self._pending_adds,
                                       accepting=accepting)

    def call_runner(self, method: str, *args):
        """Call one of the runner's remote_methods (the same hook EngineCoreClient forwards to its process)."""
        if method not in getattr(self.engine.runner, "remote_methods", ()):
            raise RuntimeError(f"ValueError: unknown utility call 'runner' [{method!r}]")
        return getattr(self.engine.runner, method)(*args)

    def debug_state(self) -> dict[str, int]:
        """Leak check counters (all 0 when idle); read while the engine is idle."""
        from xserv_aot.engine.core import debug_state
        with self._lock:
            return {**debug_state(self.engine), "streams": len(self._streams), "pending_adds": self._pending_adds}

    # engine thread

    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set() and eng.failed is None:
                self._drain(block=not eng.has_unfinished())
                if self._stop.is_set() or not eng.has_unfinished():
                    continue
                outputs = eng.step_or_recover()
                if eng.failed is not None:            # refuse new requests before anyone sees these errors
                    with self._lock:
                        self._dead, self._closed = eng.failed, True
                self._publish(outputs)
            if eng.failed is not None:
                log.error("%s", eng.failed)
                self._dead = eng.failed
        except Exception as e:
            log.exception("engine loop died")
            self._dead = f"engine failed: {one_line(e)}"
            eng.failed = eng.failed or self._dead
        self._close()

    def _close(self) -> None:
        """Refuse new streams, then end every open one: "abort" on shutdown, "error" after a failure."""
        with self._lock:
            self._closed = True
            rids = list(self._streams)
            self._pending_adds = 0
            while not self._commands.empty():             # adds never picked up: their streams end below
                self._commands.get_nowait()
        try:
            aborted = self.engine.abort_all()             # frees every block: no request stays inside
        except Exception:
            log.exception("abort_all failed while closing the engine")
            aborted = []
        outputs = aborted if self._dead is None else []
        done = {o.request_id for o in outputs}
        reason = "abort" if self._dead is None else "error"
        outputs += [RequestOutput(r, [], "", finish_reason=reason, error=self._dead) for r in rids if r not in done]
        self._publish(outputs)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return
        outputs, picked_up = [], 0
        while True:
            if cmd[0] == "add":
                _, rid, prompt, params = cmd
                picked_up += 1
                try:
                    self.engine.add_request(rid, prompt, params)
                except Exception as e:
                    outputs.append(RequestOutput(rid, [], "", finish_reason="error", error=one_line(e)))
            elif cmd[0] == "abort":
                out = self.engine.abort(cmd[1])
                if out is not None:
                    outputs.append(out)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self._publish(outputs, picked_up)

    def _publish(self, outputs: list[RequestOutput], picked_up: int = 0) -> None:
        """Refresh the stats snapshot (picked_up: add commands now in the engine) and deliver outputs."""
        try:
            stats = self.engine.stats()
            stats.healthy = stats.healthy and self._dead is None
        except Exception:
            log.exception("engine.stats() failed")
            stats = dataclasses.replace(self._stats, healthy=False)
        with self._lock:
            self._stats = stats
            self._pending_adds -= picked_up
            targets = [(self._streams.get(o.request_id), o) for o in outputs]
        for stream, out in targets:
            if stream is None:
                continue
            loop, q = stream
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:                      # that event loop is closed; nobody is listening
                pass

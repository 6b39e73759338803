"""EngineCoreClient: the API server process's side of the engine core process (AsyncEngineProtocol).

It validates requests, keeps one stream per request, and turns the core's id-only outputs into text
(detokenization and stop strings happen here: a stop string ends the stream and aborts the request in the core).
A reader thread takes the core's messages off the output socket and watches the process.

If the core process dies (crash, kill, OOM), every open request ends with finish_reason "error", stats() says
unhealthy (/health 503), new requests get EngineFailedError, and the `on_death` callbacks run (`xserv-aot serve`
then stops the server and exits non-zero). The engine is not restarted.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import threading
from typing import AsyncIterator, Callable

import zmq

from xserv_aot.engine import messages as M
from xserv_aot.engine.api import (EngineFailedError, EngineStats, InvalidRequestError, QueueFullError,
                                  RequestOutput, SamplingParams)
from xserv_aot.engine.async_engine import until_finished
from xserv_aot.engine.core import CoreProcess, CoreSpec, make_socket
from xserv_aot.engine.grammar import GrammarCompiler
from xserv_aot.engine.request_checks import check_guided, check_request
from xserv_aot.engine.text_output import RequestStream

log = logging.getLogger(__name__)


class EngineCoreClient:
    def __init__(self, plan_dir, *, backend: str = "auto", model_name: str = "", max_waiting: int = 256,
                 verify: str = "full", runner_wrapper: Callable | None = None, engine_kwargs: dict | None = None,
                 output_hwm: int = 64, socket_buffer: int = 0, start_timeout: float = 900.0,
                 coalesce_outputs: bool = True):
        """coalesce_outputs: a stream whose consumer fell behind gets the outputs queued meanwhile as one
        (engine.async_engine.until_finished); measured on the H200 at 256 streams, 14.1k -> 16.2k tok/s (bf16) and
        14.1k -> 19.9k (FP8), docs/benchmarks/2026-12-01-session8-h200.md."""
        from xserv_aot.plan.manifest import Plan, PlanError
        from xserv_aot.tokenizer import Tokenizer
        plan = Plan.load(plan_dir, verify="none")           # the core verifies the weights
        if not plan.has_tokenizer:
            raise PlanError(f"{plan_dir}: plan has no tokenizer; serving needs one")
        self.tokenizer = Tokenizer.from_dir(plan.dir)
        self.build, self.vocab_size = plan.build, plan.model.vocab_size
        self.max_seq_len, self.model_name, self.max_waiting = plan.build.max_seq_len, model_name, max_waiting
        self.generation_defaults = dict(plan.generation_defaults)          # the plan's, for the API (server)
        self.eos_token_ids = frozenset(int(t) for t in [*(plan.model.eos_token_ids or []),
                                                        *self.tokenizer.eos_token_ids])   # the core's set too
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)   # 400s here
        self.start_timeout, self.coalesce_outputs = start_timeout, coalesce_outputs
        self._spec = dict(plan_dir=str(plan.dir), backend=backend, verify=verify,
                          eos_token_ids=list(self.tokenizer.eos_token_ids), runner_wrapper=runner_wrapper,
                          engine_kwargs=engine_kwargs or {}, output_hwm=output_hwm, socket_buffer=socket_buffer)
        self._lock = threading.Lock()                 # guards _streams, _stats, counters, _dead, _closed
        self._send_lock = threading.Lock()            # the input socket is used from the loop and the reader
        self._streams: dict[str, RequestStream] = {}
        self._stats = EngineStats(0, 0, 0, plan.build.num_blocks, 0, 0, accepting=False)
        self._num_sent_adds = self._num_adds_received = 0
        self._dead: str | None = None
        self._closed = True
        self._stopping = False
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._bye = threading.Event()
        self.on_death: list[Callable[[str], None]] = []
        self.num_rejected = 0                         # malformed messages from the core
        self.proc: CoreProcess | None = None
        self._reader: threading.Thread | None = None

    @property
    def dead(self) -> str | None:
        return self._dead

    # lifecycle

    def start(self) -> None:
        """Spawn the core and wait until it is ready; raises RuntimeError (one line) when it cannot start."""
        if self.proc is not None or self._dead is not None:
            return
        self._dir = tempfile.mkdtemp(prefix="xserv-core-")
        self._ctx = zmq.Context()
        spec = CoreSpec(input_addr=f"ipc://{self._dir}/in", output_addr=f"ipc://{self._dir}/out",
                        parent_pid=os.getpid(), **self._spec)
        self._inp = make_socket(self._ctx, zmq.PUSH, spec.input_addr, bind=True)
        self._out = make_socket(self._ctx, zmq.PULL, spec.output_addr, bind=True, hwm=spec.output_hwm,
                                buffer=spec.socket_buffer)
        self.codec = M.client_codec()
        self.proc = CoreProcess(spec)
        try:
            self._wait_ready()
        except BaseException:
            self._stopping = True
            self.proc.kill()
            self._cleanup()
            raise
        with self._lock:
            self._closed = False
        self._reader = threading.Thread(target=self._read_loop, name="xserv-core-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> None:
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        if not poller.poll(self.start_timeout * 1000):
            raise EngineFailedError(f"the engine core did not start within {self.start_timeout:.0f} s")
        if self._out.poll(0):
            msg = self.codec.decode(self._out.recv())
            if isinstance(msg, M.Ready):
                return
            if isinstance(msg, M.Failed):
                raise EngineFailedError(f"the engine core failed to start: {msg.error}")
        self.proc.join(5)
        raise EngineFailedError(f"the engine core exited with status {self.proc.exitcode} before it was ready")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core: it aborts what is left (each stream gets its final output), says Bye and exits."""
        if self.proc is None or self._stopping:
            return
        self._stopping = True
        if self.proc.is_alive() and self._send(M.Shutdown()):
            self._bye.wait(timeout)
        self.proc.join(timeout)
        if self.proc.is_alive():
            log.error("engine core did not exit within %.0f s; killing it", timeout)
            self.proc.kill()
        if self._reader is not None:
            self._reader.join(timeout)
        self._end_streams("abort", None)
        self._cleanup()

    def _cleanup(self) -> None:
        self.proc.close()
        self._inp.close()
        self._out.close()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # requests

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        params = params if params is not None else SamplingParams()
        check_request(prompt_ids, params, self.build, self.vocab_size, True)
        check_guided(params, self.grammars)
        from xserv_aot.detokenizer import IncrementalDetokenizer
        stop_ids = self.eos_token_ids | frozenset(int(t) for t in params.stop_token_ids)
        stream = RequestStream(asyncio.get_running_loop(), IncrementalDetokenizer(self.tokenizer, True), params.stop,
                               stop_ids)
        msg = M.AddRequest(request_id, [int(t) for t in prompt_ids], dataclasses.replace(params, stop=[]))
        with self._lock:
            if self._closed or self._dead is not None:
                raise EngineFailedError("engine is not running" + (f" ({self._dead})" if self._dead else ""))
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            if self._stats.num_waiting + self._num_sent_adds - self._num_adds_received >= self.max_waiting:
                raise QueueFullError(f"too many waiting requests (max_waiting {self.max_waiting})")
            if not self._send(msg):
                raise EngineFailedError("the engine core is not reachable")
            self._streams[request_id] = stream
            self._num_sent_adds += 1

        def closed(finished: bool) -> None:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)
        async for out in until_finished(stream.queue, closed, self.coalesce_outputs):
            yield out

    def abort(self, request_id: str) -> None:
        self._send(M.Abort([request_id]))

    def stats(self) -> EngineStats:
        with self._lock:
            pending = self._num_sent_adds - self._num_adds_received
            alive = self.proc is not None and self.proc.is_alive()
            return dataclasses.replace(self._stats, num_waiting=self._stats.num_waiting + pending,
                                       healthy=self._stats.healthy and self._dead is None,
                                       accepting=not self._closed and self._dead is None and alive)

    def call(self, name: str, *args, timeout: float = 30.0):
        """A utility call in the core: "debug_state", or ("runner", method, *args) for a runner's remote_methods."""
        cid = next(self._call_ids)
        fut = self._calls[cid] = concurrent.futures.Future()
        if not self._send(M.Utility(cid, name, list(args))):
            raise EngineFailedError("the engine core is not reachable")
        try:
            res = fut.result(timeout)
        finally:
            self._calls.pop(cid, None)
        if res.error is not None:
            raise RuntimeError(res.error)
        return res.value

    def call_runner(self, method: str, *args):
        return self.call("runner", method, *args)

    def debug_state(self) -> dict[str, int]:
        state = self.call("debug_state")
        with self._lock:
            state.update(streams=len(self._streams), pending_adds=self._num_sent_adds - self._num_adds_received)
        return state

    # the reader thread

    def _send(self, msg) -> bool:
        try:
            with self._send_lock:
                self._inp.send(self.codec.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:                          # no core connected (it died), or the socket is closed
            return False

    def _read_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        while not self._bye.is_set():
            exited = dict(poller.poll(100)).get(self.proc.sentinel) is not None or not self.proc.is_alive()
            self._read_all()
            if exited and not self._bye.is_set():
                self._read_all()
                if not self._stopping:
                    self._die(f"the engine core process exited unexpectedly (status {self.proc.exitcode})")
                return

    def _read_all(self) -> None:
        while not self._bye.is_set():
            try:
                data = self._out.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self.codec.decode(data)
            except M.MessageError as e:
                self.num_rejected += 1
                log.error("rejected a message from the engine core: %s", e)
                continue
            if isinstance(msg, M.Outputs):
                self._on_outputs(msg)
            elif isinstance(msg, M.UtilityResult):
                fut = self._calls.get(msg.call_id)
                if fut is not None:
                    fut.set_result(msg)
            elif isinstance(msg, M.Bye):
                self._bye.set()

    def _on_outputs(self, msg: M.Outputs) -> None:
        with self._lock:
            self._stats, self._num_adds_received = msg.stats, msg.num_adds_received
            targets = [(self._streams.get(w.request_id), w) for w in msg.outputs]
        ready = []
        for stream, w in targets:
            if stream is None or stream.done:
                continue
            out, stopped_here = stream.process(w)
            if stopped_here:
                self.abort(w.request_id)
            ready.append((stream, out))
        self._put(ready)

    @staticmethod
    def _put(ready: list[tuple[RequestStream, RequestOutput]]) -> None:
        """Hand outputs to their streams' event loops: one wake-up per loop for the whole list (a call_soon_threadsafe
        per output makes this thread and the loop's trade the GIL at every self-pipe write)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, out in ready:
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:                      # that event loop is closed; nobody is listening
                pass

    def _end_streams(self, reason: str, error: str | None) -> None:
        with self._lock:
            self._closed = True
            targets = [(rid, s) for rid, s in self._streams.items() if not s.done]
        for rid, stream in targets:
            stream.done = True
        self._put([(stream, RequestOutput(rid, [], "", finish_reason=reason, error=error)) for rid, stream in targets])

    def _die(self, reason: str) -> None:
        log.error("%s: ending every open request with an error", reason)
        with self._lock:
            self._dead = reason
        self._end_streams("error", reason)
        for fut in list(self._calls.values()):
            if not fut.done():
                fut.set_exception(EngineFailedError(reason))
        for cb in self.on_death:
            try:
                cb(reason)
            except Exception:
                log.exception("on_death callback failed")


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)

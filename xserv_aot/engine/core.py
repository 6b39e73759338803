"""The engine core process (vLLM v1's EngineCore shape): scheduler, block manager, runner and the device live here.

`run_engine_core(spec)` is the child's entry point. It connects to the API process's two
ZeroMQ sockets (PULL for requests, PUSH for outputs), builds the runner and an ids-only LLMEngine, says Ready,
then loops: take in every pending message, run one step when there is work, send that step's outputs and stats.

Lifetime: SIGINT/SIGTERM are ignored (the API process drains and then sends Shutdown, which aborts what is left
and ends with Bye and exit 0). The core polls os.getppid() at every loop turn (at most `poll_s` apart, also while a
send waits), so it exits by itself (status 1) within a second of its parent dying, even by SIGKILL.
Backpressure: outputs go through a PUSH socket with a small high-water mark; when the API process is slow to read,
send waits (the engine stops stepping) instead of queueing without bound. Malformed messages are logged, counted
and dropped.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

import zmq

from xserv_aot.engine import messages as M
from xserv_aot.engine.api import RequestOutput
from xserv_aot.engine.llm_engine import LLMEngine, one_line

log = logging.getLogger(__name__)


@dataclass
class CoreSpec:
    """Everything the child needs; pickled at spawn."""
    plan_dir: str
    backend: str
    verify: str
    eos_token_ids: list[int]
    input_addr: str                      # the API process binds both addresses
    output_addr: str
    parent_pid: int
    runner_wrapper: Callable | None = None   # runner -> runner, applied in the child (tests: fault injection)
    engine_kwargs: dict = field(default_factory=dict)
    output_hwm: int = 64                 # output messages buffered before send waits
    socket_buffer: int = 0               # SO_SNDBUF/SO_RCVBUF bytes (0: the OS default); tests make it small
    poll_s: float = 0.1


class CoreProcess:
    """`python -m xserv_aot.engine.core` with the pickled spec on stdin (no re-import of the caller's __main__,
    the caller's sys.path as PYTHONPATH); `sentinel` is a pidfd that becomes readable when the process exits."""

    def __init__(self, spec: CoreSpec):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.popen = subprocess.Popen([sys.executable, "-m", "xserv_aot.engine.core"], stdin=subprocess.PIPE, env=env)
        self.pid = self.popen.pid
        self.sentinel = os.pidfd_open(self.pid)
        self.popen.stdin.write(pickle.dumps(spec))
        self.popen.stdin.close()

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()

    def close(self) -> None:
        os.close(self.sentinel)


def make_socket(ctx: zmq.Context, kind: int, addr: str, *, bind: bool, hwm: int = 0, buffer: int = 0) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, hwm)
    if buffer:
        sock.setsockopt(zmq.SNDBUF if kind == zmq.PUSH else zmq.RCVBUF, buffer)
    (sock.bind if bind else sock.connect)(addr)
    return sock


class EngineCore:
    """The loop around one LLMEngine; talks only through its two sockets. `alive()` False ends it (parent gone)."""

    def __init__(self, engine: LLMEngine, inp: zmq.Socket, out: zmq.Socket, alive: Callable[[], bool],
                 poll_s: float = 0.1):
        self.engine, self.inp, self.out, self.alive, self.poll_ms = engine, inp, out, alive, int(poll_s * 1000)
        self.codec = M.core_codec()
        self.num_adds = 0
        self.num_rejected = 0                # malformed messages dropped
        self.num_send_waits = 0              # sends that found the output queue full (backpressure)
        self.send_blocked = threading.Event()     # set on the first such wait (tests wait on it)
        self._stop = False

    def run(self) -> int:
        eng = self.engine
        while not self._stop:
            if not self.alive():
                log.error("the API process is gone; engine core exits")
                return 1
            outputs = self._receive(block=not eng.has_unfinished())
            if eng.has_unfinished() and not self._stop:
                outputs = (outputs or []) + eng.step_or_recover()
            if outputs is not None and not self._send_outputs(outputs):
                return 1
        if not self._send_outputs(eng.abort_all()) or not self._send(M.Bye()):
            return 1
        return 0

    def _receive(self, block: bool) -> list[RequestOutput] | None:
        """Handle every pending message (waiting up to poll_s for the first when block). None: nothing came."""
        if not self.inp.poll(self.poll_ms if block else 0):
            return None
        outputs: list[RequestOutput] = []
        while not self._stop:
            try:
                data = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                self._handle(self.codec.decode(data), outputs)
            except M.MessageError as e:
                self.num_rejected += 1
                log.warning("engine core rejected a message: %s", e)
        return outputs

    def _handle(self, msg, outputs: list[RequestOutput]) -> None:
        eng = self.engine
        if isinstance(msg, M.AddRequest):
            self.num_adds += 1
            try:
                eng.add_request(msg.request_id, msg.prompt_ids, msg.params)
            except Exception as e:
                outputs.append(RequestOutput(msg.request_id, [], "", finish_reason="error", error=one_line(e)))
        elif isinstance(msg, M.Abort):
            outputs += [o for o in map(eng.abort, msg.request_ids) if o is not None]
        elif isinstance(msg, M.Utility):
            self._send(self._utility(msg))
        elif isinstance(msg, M.Shutdown):
            self._stop = True

    def _utility(self, msg: M.Utility) -> M.UtilityResult:
        try:
            if msg.name == "debug_state":
                value = debug_state(self.engine)
            elif msg.name == "runner" and msg.args and msg.args[0] in getattr(self.engine.runner, "remote_methods", ()):
                value = getattr(self.engine.runner, msg.args[0])(*msg.args[1:])
            else:
                raise ValueError(f"unknown utility call {msg.name!r} {msg.args[:1]}")
            return M.UtilityResult(msg.call_id, value)
        except Exception as e:
            return M.UtilityResult(msg.call_id, None, one_line(e))

    def _send_outputs(self, outputs: list[RequestOutput]) -> bool:
        return self._send(M.Outputs([M.to_wire(o) for o in outputs], self.engine.stats(), self.num_adds))

    def _send(self, msg) -> bool:
        """Send, waiting while the API process is slow to read; False when it died meanwhile."""
        data = self.codec.encode(msg)
        while True:
            try:
                self.out.send(data, zmq.NOBLOCK)
                return True
            except zmq.Again:
                self.num_send_waits += 1
                self.send_blocked.set()
            self.out.poll(self.poll_ms, zmq.POLLOUT)
            if not self.alive():
                log.error("the API process is gone while the engine core waits to send; exiting")
                return False


def debug_state(engine: LLMEngine) -> dict[str, int]:
    """What a leak check needs: requests, scheduler queues and referenced KV blocks (all 0 when idle)."""
    s = engine.scheduler
    return {"seqs": len(engine._seqs), "running": len(s.running), "waiting": len(s.waiting),
            "blocks_referenced": sum(1 for r in s.block_manager.ref_counts if r)}


def build_core_engine(spec: CoreSpec) -> LLMEngine:
    from xserv_aot.plan.manifest import Plan
    from xserv_aot.runtime.select import make_runner
    plan = Plan.load(spec.plan_dir, verify=spec.verify)
    runner = make_runner(plan, spec.backend)
    if spec.runner_wrapper is not None:
        runner = spec.runner_wrapper(runner)
    eos = [*(plan.model.eos_token_ids or []), *spec.eos_token_ids]
    log.info("engine core %d: %s on %s", os.getpid(), plan.model.arch, type(runner).__name__)
    grammar_tokenizer = None
    if plan.has_tokenizer:                       # structured outputs: grammar masks are made here
        from xserv_aot.tokenizer import Tokenizer
        grammar_tokenizer = Tokenizer.from_dir(plan.dir)
    return LLMEngine(runner, None, eos_token_ids=eos, grammar_tokenizer=grammar_tokenizer, **spec.engine_kwargs)


def run_engine_core(spec: CoreSpec) -> None:
    """Child process entry point (`python -m xserv_aot.engine.core`, the pickled CoreSpec on stdin)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inp = make_socket(ctx, zmq.PULL, spec.input_addr, bind=False)
    out = make_socket(ctx, zmq.PUSH, spec.output_addr, bind=False, hwm=spec.output_hwm, buffer=spec.socket_buffer)
    alive = lambda: os.getppid() == spec.parent_pid
    rc = 1
    try:
        try:
            engine = build_core_engine(spec)
        except Exception as e:
            log.exception("engine core failed to start")
            EngineCore(None, inp, out, alive, spec.poll_s)._send(M.Failed(one_line(e)))
            return
        core = EngineCore(engine, inp, out, alive, spec.poll_s)
        if core._send(M.Ready(os.getpid())):
            rc = core.run()
    except Exception:
        log.exception("engine core loop died")
    finally:
        inp.close()
        out.close()
        ctx.term()
        sys.exit(rc)





if __name__ == "__main__":
    run_engine_core(pickle.load(sys.stdin.buffer))

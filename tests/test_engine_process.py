"""The engine core in its own process: the wire (malformed messages, backpressure), parity with the in-process
engine, and the process boundary (engine crash -> error events + 503 + non-zero exit, parent SIGKILL -> the core
exits by itself, SIGTERM is covered by tests/test_shutdown.py).

EngineCore is driven in a thread over real ZeroMQ sockets (FakeRunner engine, outputs checked against the unpaged
reference); EngineCoreClient and `xserv-aot serve` spawn the real child process on the tiny Qwen3 plan.
"""
from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import tempfile
import threading

import httpx
import msgspec
import pytest
import zmq

from tests.fake_engine import LiveServer, tiny_plan, wait_until
from tests.fake_runner import FakeRunner
from tests.test_engine import VOCAB, expected, mkbuild
from tests.test_shutdown import Stream, free_port, serve_log, serve_process, wait_healthy
from xserv_aot.engine import messages as M
from xserv_aot.engine.api import EngineFailedError, SamplingParams
from xserv_aot.engine.core import EngineCore, make_socket
from xserv_aot.engine.llm_engine import LLMEngine
from xserv_aot.serve import build_engine
from xserv_aot.server import create_app

GREEDY = dict(temperature=0.0, ignore_eos=True)


class CorePair:
    """An EngineCore on a FakeRunner in a thread, and the API side's raw sockets to it."""

    def __init__(self, build=None, hwm: int = 64, buffer: int = 0):
        self.dir = tempfile.mkdtemp(prefix="xc")
        self.ctx = zmq.Context()
        ia, oa = f"ipc://{self.dir}/in", f"ipc://{self.dir}/out"
        self.push = make_socket(self.ctx, zmq.PUSH, ia, bind=True)
        self.pull = make_socket(self.ctx, zmq.PULL, oa, bind=True, hwm=hwm, buffer=buffer)
        self.runner = FakeRunner(build or mkbuild(), VOCAB)
        self.alive = threading.Event()
        self.alive.set()
        engine = LLMEngine(self.runner, None, seed=0)
        self.core = EngineCore(engine, make_socket(self.ctx, zmq.PULL, ia, bind=False),
                               make_socket(self.ctx, zmq.PUSH, oa, bind=False, hwm=hwm, buffer=buffer),
                               self.alive.is_set, poll_s=0.02)
        self.codec = M.client_codec()
        self.enc = M.core_codec()
        self.rc = None
        self.thread = threading.Thread(target=lambda: setattr(self, "rc", self.core.run()), daemon=True)
        self.thread.start()

    def send(self, msg) -> None:
        self.push.send(msg if isinstance(msg, bytes) else self.enc.encode(msg))

    def collect(self, rids: set[str]) -> dict[str, list[M.WireOutput]]:
        """Read outputs until every rid has finished."""
        outs: dict[str, list] = {}
        while not all(outs.get(r) and outs[r][-1].finish_reason for r in rids):
            assert self.pull.poll(30_000), "no output from the engine core"
            msg = self.codec.decode(self.pull.recv())
            if isinstance(msg, M.Outputs):
                for w in msg.outputs:
                    outs.setdefault(w.request_id, []).append(w)
        return outs

    def close(self) -> None:
        self.send(M.Shutdown())
        self.thread.join(30)
        assert not self.thread.is_alive() and self.rc == 0
        for s in (self.push, self.pull, self.core.inp, self.core.out):
            s.close()
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


def ids_of(outs: list[M.WireOutput]) -> list[int]:
    return [t for w in outs for t in w.new_token_ids]


def test_malformed_messages_are_rejected_and_the_core_keeps_serving():
    pair = CorePair()
    try:
        good = M.AddRequest("ok", [3, 1, 4, 1, 5], SamplingParams(max_tokens=7, **GREEDY))
        raw = msgspec.msgpack.encode
        pair.send(b"\xc1 not msgpack")
        pair.send(raw(["AddRequest", "bad", ["x"], {}]))              # prompt ids of the wrong type
        pair.send(raw(["Launch", "missiles"]))                         # no such message
        pair.send(pair.enc.encode(good)[:-2])                          # truncated
        pair.send(M.AddRequest("zero", [1, 2], SamplingParams(max_tokens=0)))    # decodes, but invalid
        pair.send(good)
        outs = pair.collect({"ok", "zero"})
        assert pair.core.num_rejected == 4
        assert ids_of(outs["ok"]) == expected([3, 1, 4, 1, 5], good.params) and outs["ok"][-1].finish_reason == "length"
        assert outs["zero"][-1].finish_reason == "error" and "max_tokens" in outs["zero"][-1].error
    finally:
        pair.close()


def test_backpressure_a_slow_reader_stalls_the_core_and_loses_nothing():
    build = mkbuild(max_seq_len=1024, num_blocks=300)
    pair = CorePair(build, hwm=2, buffer=2048)
    try:
        params = SamplingParams(max_tokens=1000, **GREEDY)
        pair.send(M.AddRequest("long", [7, 8, 9], params))
        assert pair.core.send_blocked.wait(60)                         # the API side has not read anything yet
        steps_while_blocked = len(pair.runner.batches)
        assert steps_while_blocked < params.max_tokens                 # it stopped stepping: not queued unbounded
        outs = pair.collect({"long"})
        assert ids_of(outs["long"]) == expected([7, 8, 9], params)     # every token, in order
        assert [w.num_generated_tokens for w in outs["long"]] == list(range(1, 1001))
        assert pair.core.num_send_waits > 0
    finally:
        pair.close()


def test_core_exits_when_its_parent_is_gone_even_while_blocked_on_a_send():
    pair = CorePair(mkbuild(max_seq_len=1024, num_blocks=300), hwm=1, buffer=1024)
    pair.send(M.AddRequest("long", [1, 2], SamplingParams(max_tokens=1000, **GREEDY)))
    assert pair.core.send_blocked.wait(60)
    pair.alive.clear()                                                 # what os.getppid() changing looks like
    pair.thread.join(30)
    assert not pair.thread.is_alive() and pair.rc == 1
    for s in (pair.push, pair.pull, pair.core.inp, pair.core.out):
        s.close()
    pair.ctx.term()


# the real child process


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return tiny_plan(tmp_path_factory, num_blocks=64)


def gather(engine, rid, ids, params):
    async def run():
        return [o async for o in engine.generate(rid, ids, params)]
    return asyncio.run(run())


def merged(outs):
    return ([t for o in outs for t in o.new_token_ids], "".join(o.text for o in outs), outs[-1].finish_reason,
            outs[-1].num_generated_tokens, [lp.token_id for o in outs for lp in (o.logprobs or [])])


def test_the_api_side_rejects_malformed_messages_from_the_core_and_keeps_streaming(plan):
    ae = build_engine(plan, backend="cpu", engine_process=True)
    ae.start()
    try:
        ctx = zmq.Context()
        intruder = make_socket(ctx, zmq.PUSH, f"ipc://{ae._dir}/out", bind=False)
        for junk in (b"\x00garbage", msgspec.msgpack.encode(["Outputs", "not a list", {}, 1])):
            intruder.send(junk)
        assert wait_until(lambda: ae.num_rejected == 2)
        intruder.close()
        ctx.term()
        p = SamplingParams(max_tokens=5, **GREEDY)
        outs = gather(ae, "after", ae.tokenizer.encode("signal"), p)
        assert outs[-1].finish_reason == "length" and outs[-1].num_generated_tokens == 5
    finally:
        ae.shutdown()


def test_outputs_across_the_process_boundary_equal_the_in_process_engine(plan):
    tok = build_engine(plan, backend="cpu").tokenizer
    ids = tok.encode("lantern orbit signal")
    local = build_engine(plan, backend="cpu")
    first = merged(gather_started(local, "probe", ids, SamplingParams(max_tokens=12, **GREEDY)))
    stop_text = first[1][4:7]                                          # a stop string the output really contains
    cases = [SamplingParams(max_tokens=12, **GREEDY),
             SamplingParams(max_tokens=12, temperature=0.8, top_k=40, seed=5, ignore_eos=True),
             SamplingParams(max_tokens=12, stop=[stop_text], **GREEDY),
             SamplingParams(max_tokens=12, stop_token_ids=[first[0][5]], **GREEDY),
             SamplingParams(max_tokens=6, temperature=0.7, repetition_penalty=1.3, logprobs=2, seed=9)]
    remote = build_engine(plan, backend="cpu", engine_process=True)
    remote.start()
    try:
        for i, p in enumerate(cases):
            want = merged(gather_started(local, f"l{i}", ids, p))
            got = merged(gather(remote, f"r{i}", ids, p))
            assert got == want, (i, p)
        assert stop_text not in merged(gather(remote, "s", ids, cases[2]))[1]
        assert wait_until(lambda: set(remote.debug_state().values()) == {0}), remote.debug_state()
    finally:
        remote.shutdown()
    assert remote.proc.exitcode == 0


def test_structured_outputs_logit_bias_and_forks_cross_the_process_boundary(plan):
    """GuidedDecoding, logit_bias and min_tokens travel in the msgspec AddRequest; grammar matchers run in the core
    (the last token of a finished grammar is text on the API side too); parallel samples of one prompt (forks)
    equal the in-process engine's; a grammar the tokenizer cannot compile is refused before it is sent."""
    import json
    from xserv_aot.engine.api import GuidedDecoding, InvalidRequestError
    tok = build_engine(plan, backend="cpu").tokenizer
    ids = tok.encode("Answer:")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    cases = [SamplingParams(max_tokens=20, temperature=0.0, guided=GuidedDecoding("json", json.dumps(schema))),
             SamplingParams(max_tokens=20, temperature=0.9, seed=4, guided=GuidedDecoding("choice", '["yes", "no"]')),
             SamplingParams(max_tokens=20, temperature=0.0, guided=GuidedDecoding("regex", "[a-c]{3}"), logprobs=1),
             SamplingParams(max_tokens=8, temperature=0.0, logit_bias={ids[0]: 100.0}, ignore_eos=True),
             SamplingParams(max_tokens=8, temperature=0.0, min_tokens=8)]
    forks = [SamplingParams(max_tokens=8, temperature=1.0, seed=20 + j, ignore_eos=True) for j in range(3)]
    long = tok.encode("quartz meadow signal orbit lantern " * 4)

    async def parallel(engine):
        async def one(j, p):
            return merged([o async for o in engine.generate(f"f{j}", long, p)])
        return await asyncio.gather(*(one(j, p) for j, p in enumerate(forks)))

    local = build_engine(plan, backend="cpu")
    local.start()
    try:
        want = [merged(gather(local, f"l{i}", ids, p)) for i, p in enumerate(cases)]
        want_forks = asyncio.run(parallel(local))
    finally:
        local.shutdown()
    assert json.loads(want[0][1])["n"] >= 0 and want[0][2] == "stop" and want[1][1] in ("yes", "no")
    remote = build_engine(plan, backend="cpu", engine_process=True)
    remote.start()
    try:
        got = [merged(gather(remote, f"r{i}", ids, p)) for i, p in enumerate(cases)]
        assert got == want
        assert asyncio.run(parallel(remote)) == want_forks
        with pytest.raises(InvalidRequestError):
            gather(remote, "bad", ids, SamplingParams(guided=GuidedDecoding("json", '{"type": "nonsense"}')))
        assert wait_until(lambda: set(remote.debug_state().values()) == {0}), remote.debug_state()
    finally:
        remote.shutdown()


def gather_started(engine, rid, ids, params):
    engine.start()
    try:
        return gather(engine, rid, ids, params)
    finally:
        engine.shutdown()


def test_coalesced_outputs_of_a_stream_read_late_come_as_one_and_equal_the_plain_stream(plan):
    p = SamplingParams(max_tokens=24, **GREEDY)
    plain = build_engine(plan, backend="cpu", engine_process=True, coalesce_outputs=False)
    ids = plain.tokenizer.encode("lantern orbit signal")
    want = merged(gather_started(plain, "p", ids, p))
    remote = build_engine(plan, backend="cpu", engine_process=True)      # coalesce_outputs: on by default
    remote.start()

    async def read_late():
        it = remote.generate("c", ids, p)
        first = await anext(it)                  # then the request runs to its end in the core
        await asyncio.to_thread(wait_until, lambda: remote.debug_state()["seqs"] == 0)
        return [first] + [o async for o in it]

    try:
        outs = asyncio.run(read_late())
    finally:
        remote.shutdown()
    assert len(outs) <= 2 and outs[-1].finish_reason == "length"    # everything queued after the first: one output
    assert merged(outs) == want


def test_engine_core_that_cannot_start_is_one_line_error(plan):
    ae = build_engine(plan, backend="cpu", engine_process=True, runner_wrapper=functools.partial(broken_runner))
    with pytest.raises(RuntimeError, match=r"^the engine core failed to start: RuntimeError: no device here$"):
        ae.start()


def broken_runner(runner):
    raise RuntimeError("no device here")


def test_engine_crash_ends_every_stream_with_an_error_and_health_503(plan):
    ae = build_engine(plan, backend="cpu", model_name="tiny", engine_process=True)
    deaths = []
    ae.on_death.append(deaths.append)
    with LiveServer(create_app(ae, model_name="tiny", manage_engine=True)) as url:
        streams = [Stream(url, {"model": "tiny", "prompt": w, "max_tokens": 200, "ignore_eos": True})
                   for w in ("river", "quartz")]
        for s in streams:
            s.start()
        for s in streams:
            s.wait_for_chunks(2)
        os.kill(ae.proc.pid, signal.SIGKILL)
        for s in streams:
            s.join(30)
            assert s.status == 200 and s.events[-1] == "[DONE]"
            assert s.events[-2]["error"]["message"] == "internal error while generating", s.events[-2]
        h = httpx.get(url + "/health", timeout=10)
        assert h.status_code == 503 and h.json()["error"]["code"] == "engine_unhealthy"
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503
        assert deaths == ["the engine core process exited unexpectedly (status -9)"]
    with pytest.raises(EngineFailedError):
        gather(ae, "late", [1, 2], SamplingParams(max_tokens=2))


def core_pid_of(server_pid: int) -> int | None:
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if ppid == server_pid and b"xserv_aot.engine.core" in cmd:
                return int(d)
    return None


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_serve_exits_non_zero_when_the_engine_core_dies(plan, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serve_process(plan, port, 5.0, tmp_path) as proc:
        wait_healthy(url, proc)
        stream = Stream(url, {"model": "tiny", "prompt": "orbit", "max_tokens": 200, "ignore_eos": True})
        stream.start()
        stream.wait_for_chunks(2)
        os.kill(core_pid_of(proc.pid), signal.SIGKILL)
        stream.join(30)
        assert stream.events[-1] == "[DONE]" and "error" in stream.events[-2]
        assert proc.wait(timeout=60) == 1
    out = serve_log(tmp_path)
    assert "error: the engine core process exited unexpectedly (status -9); the server stopped" in out, out[-2000:]
    assert "Traceback" not in out, out[-3000:]


def test_engine_core_exits_by_itself_when_the_server_is_sigkilled(plan, tmp_path):
    port = free_port()
    with serve_process(plan, port, 5.0, tmp_path) as proc:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        core = core_pid_of(proc.pid)
        assert core is not None and not gone(core)
        proc.kill()
        proc.wait()
    assert wait_until(lambda: gone(core), timeout=10), f"engine core {core} outlived its server"


def test_sigterm_drains_the_server_and_the_engine_core(plan, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serve_process(plan, port, 0.5, tmp_path) as proc:
        wait_healthy(url, proc)
        core = core_pid_of(proc.pid)
        stream = Stream(url, {"model": "tiny", "prompt": "meadow", "max_tokens": 200, "ignore_eos": True})
        stream.start()
        stream.wait_for_chunks(2)
        proc.send_signal(signal.SIGTERM)
        reason, text = stream.finish()
        assert reason == "abort" and text
        assert proc.wait(timeout=60) == 0
    assert gone(core)                                  # reaped by the server, not orphaned
    out = serve_log(tmp_path)
    assert "Traceback" not in out and "killing it" not in out, out[-3000:]

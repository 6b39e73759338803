"""The serving path's overlap and hand-off, as exact event orders (no timing): the engine launches step N+1
before it waits for step N whenever it may (by default, for a runner that overlaps; plans the builder compiles
today carry what overlap needs), the API process hands one core message's outputs to the event loop with one
wake-up, a lagging stream's queued outputs coalesce into one, and the step timer records what it wraps."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from tests.fake_runner import FakeRunner
from tests.test_engine import VOCAB, mkbuild, mkengine
from xserv_aot.bench.instant_runner import StepLog
from xserv_aot.bench.step_timer import COLUMNS, EmulatedDevice, StepTimer, summarize
from xserv_aot.engine.api import RequestOutput, SamplingParams, TokenLogprob
from xserv_aot.engine.async_engine import until_finished
from xserv_aot.engine.core_client import EngineCoreClient
from xserv_aot.engine.text_output import RequestStream


class RecordingRunner(FakeRunner):
    """FakeRunner whose launch/wait are recorded as ("launch", k) / ("wait", k), k = launch index."""
    overlaps = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.events: list[tuple[str, int]] = []

    def launch(self, batch):
        k = sum(1 for e in self.events if e[0] == "launch")
        self.events.append(("launch", k))
        return k, self.run(batch)

    def wait(self, handle):
        self.events.append(("wait", handle[0]))
        return handle[1]


def overlapped_order(n: int) -> list[tuple[str, int]]:
    """launch 0, then (launch k, wait k - 1) for every later step, then the last wait."""
    return [("launch", 0)] + [e for k in range(1, n) for e in (("launch", k), ("wait", k - 1))] + [("wait", n - 1)]


def test_decode_steps_launch_the_next_before_waiting_for_the_last():
    runner = RecordingRunner(mkbuild(), VOCAB, ())
    eng = mkengine(runner=runner)                                   # overlap not given: the runner's
    assert eng.overlap
    outs = eng.generate([[5, 6, 7], [8, 9], [1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=7,
                                                                         ignore_eos=True))
    assert [len(o.new_token_ids) for o in outs] == [7, 7, 7]
    steps = sum(1 for e in runner.events if e[0] == "launch")
    assert steps == 7                                               # one prefill + six decode steps, none wasted
    assert runner.events == overlapped_order(steps)


def test_a_host_sampled_step_completes_before_the_next_launch():
    runner = RecordingRunner(mkbuild(), VOCAB, ())
    eng = mkengine(runner=runner)
    eng.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2))
    assert runner.events == [e for k in range(3) for e in (("launch", k), ("wait", k))]


def test_plans_compiled_today_carry_what_overlap_needs(tmp_path):
    """CudaRunner.overlaps is `"prev_rows" in plan.arena`; a plan with the H200 build's bucket lists has it."""
    from xserv_aot.bench.host_overhead import TINY_CONFIG
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.plan.manifest import Plan
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CONFIG, "max_position_embeddings": 8192}))
    build = BuildConfig(max_num_seqs=256, decode_buckets=[1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256],
                        prefill_buckets=[128, 256, 384, 512, 640, 768, 1024, 2048, 4096, 8192],
                        mixed_prefill_tokens=512, max_seq_len=8192, block_size=16, num_blocks=512, dtype="float32",
                        target="cpu")
    compile_plan(tmp_path / "config.json", tmp_path / "plan", build, dummy_weights=True, force=True)
    plan = Plan.load(tmp_path / "plan")
    assert "prev_rows" in plan.arena
    assert all(bk.ops[0].op == "resolve_input_ids" for bk in plan.buckets)
    assert plan.bucket_for(256, 256, 300).name == "decode_256"      # not a prefill bucket of the same size


class CountingLoop:
    def __init__(self):
        self.calls = []

    def call_soon_threadsafe(self, fn, *args):
        self.calls.append((fn, args))


def test_one_core_message_wakes_each_event_loop_once():
    loops = [CountingLoop(), CountingLoop()]
    streams = [RequestStream(loops[i % 2], None, []) for i in range(5)]
    outs = [RequestOutput(f"r{i}", [i], f"t{i}") for i in range(5)]
    EngineCoreClient._put(list(zip(streams, outs)))
    assert [len(lp.calls) for lp in loops] == [1, 1]
    for lp in loops:
        fn, args = lp.calls[0]
        fn(*args)
    got = [s.queue.get_nowait() for s in streams]
    assert got == outs and all(s.queue.empty() for s in streams)


def test_a_lagging_stream_gets_its_queued_outputs_as_one():
    lp = [TokenLogprob(1, -0.5, []), TokenLogprob(2, -0.25, [])]
    outs = [RequestOutput("r", [1], "a", None, [lp[0]], 3, 1, 0), RequestOutput("r", [2], "b", None, [lp[1]], 3, 2, 0),
            RequestOutput("r", [3], "c", "length", None, 3, 3, 0)]

    async def consume(coalesce: bool):
        q = asyncio.Queue()
        for o in outs:
            q.put_nowait(RequestOutput(**o.__dict__))
        closed = []
        got = [o async for o in until_finished(q, closed.append, coalesce)]
        return got, closed

    got, closed = asyncio.run(consume(False))
    assert [o.new_token_ids for o in got] == [[1], [2], [3]] and closed == [True]
    got, closed = asyncio.run(consume(True))
    assert closed == [True] and len(got) == 1
    o = got[0]
    assert (o.new_token_ids, o.text, o.finish_reason, o.logprobs, o.num_generated_tokens) == \
        ([1, 2, 3], "abc", "length", lp, 3)


class FakeDev:
    """Events are ids; elapsed_ms(a, b) = b - a on a clock where event i is recorded at 10 * i ms."""

    def __init__(self):
        self.n = 0
        self.recorded = {}

    def event(self):
        self.n += 1
        return self.n

    def record(self, ev):
        self.recorded[ev] = 10.0 * len(self.recorded)

    def elapsed_ms(self, a, b):
        return self.recorded[b] - self.recorded[a]


def test_step_timer_records_each_step_and_keeps_overlap(tmp_path):
    runner = RecordingRunner(mkbuild(), VOCAB, ())
    runner.dev = FakeDev()
    StepLog.create(tmp_path / "steps", width=len(COLUMNS))
    timed = StepTimer(runner, step_log=tmp_path / "steps")
    eng = mkengine(runner=timed)
    assert eng.overlap
    eng.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert runner.events == overlapped_order(4)
    rows = StepLog(tmp_path / "steps", mode="r").rows()
    col = {c: rows[:, i] for i, c in enumerate(COLUMNS)}
    assert col["num_tokens"].tolist() == [5, 2, 2, 2] and col["num_seqs"].tolist() == [2] * 4
    assert col["gpu_ms"].tolist() == [10.0] * 4                     # each step's start and end event: adjacent
    assert np.isnan(col["gpu_idle_ms"][0]) and col["gpu_idle_ms"][1:].tolist() == [10.0] * 3   # end k-1, start k
    assert (col["launch_start"] <= col["launch_end"]).all() and (col["wait_start"] <= col["wait_end"]).all()
    s = summarize(rows, max_num_seqs=2)
    assert s["steps"] == 4 and s["mixed_or_prefill"]["steps"] == 1     # the last step has no next launch
    assert s["full_decode"]["steps"] == 2 and s["full_decode"]["gpu_ms"] == 10.0


def test_emulated_device_queues_steps_on_one_stream(tmp_path):
    from types import SimpleNamespace

    from xserv_aot.bench.host_overhead import make_tiny_plan
    from xserv_aot.plan.manifest import Plan
    from xserv_aot.runtime.batch import BatchDescription
    dev = EmulatedDevice(SimpleNamespace(plan=Plan.load(make_tiny_plan(tmp_path))), decode_ms=1e7,
                         prefill_ms_per_token=1.0)
    decode = BatchDescription(input_ids=[3, 4], positions=[5, 6], slot_mapping=[5, 22], query_start_loc=[0, 1, 2],
                              seq_lens=[6, 7], block_tables=[[0], [1]])
    prefill = BatchDescription(input_ids=[3, 4, 5], positions=[0, 1, 2], slot_mapping=[0, 1, 2],
                               query_start_loc=[0, 3], seq_lens=[3], block_tables=[[0]])
    assert dev.step_ms(decode) == 1e7 and dev.step_ms(prefill) == 1e7 + 3.0
    first, _ = dev.launch(decode)
    second, result = dev.launch(decode)
    assert second - first == pytest.approx(1e4)                     # queued behind the first: + decode_ms
    assert result.sampled_ids.shape == (2,)

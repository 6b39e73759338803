"""The host-overhead benchmark's parts: InstantRunner through the engine, the cross-process step log, the steady-state
gap statistics, and one small served run (a server child process, streaming clients on loopback)."""
from __future__ import annotations

import numpy as np
import pytest

from xserv_aot.bench import host_overhead
from xserv_aot.bench.instant_runner import InstantRunner, StepLog
from xserv_aot.engine.api import SamplingParams
from xserv_aot.engine.llm_engine import LLMEngine
from xserv_aot.plan.manifest import Plan


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    return host_overhead.make_tiny_plan(tmp_path_factory.mktemp("host-overhead"))


def test_tiny_plan_has_buckets_up_to_256(plan_dir):
    plan = Plan.load(plan_dir)
    assert plan.build.max_num_seqs == 256 and plan.build.decode_buckets == host_overhead.BUCKETS
    assert plan.has_tokenizer and plan.model.vocab_size == host_overhead.VOCAB


def test_instant_runner_through_the_engine(plan_dir, tmp_path):
    plan = Plan.load(plan_dir)
    log = StepLog.create(tmp_path / "steps", capacity=64)
    runner = InstantRunner(plan, step_log=tmp_path / "steps")
    engine = LLMEngine(runner, None)
    outs = engine.generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    token = runner._ids[0]
    assert token != host_overhead.EOS and [o.new_token_ids for o in outs] == [[token] * 6] * 3
    times, sizes = log.steps()
    assert sizes.tolist() == [3] * 6 and np.all(np.diff(times) >= 0)       # one prefill + five decode steps
    reader = StepLog(tmp_path / "steps", mode="r")                            # what another process sees
    assert reader.steps()[1].tolist() == [3] * 6


def test_step_log_stops_at_capacity(tmp_path):
    log = StepLog.create(tmp_path / "s", capacity=2)
    for t in range(4):
        log.record(float(t), 1)
    assert log.steps()[0].tolist() == [0.0, 1.0]


def test_steady_state_uses_only_full_batch_gaps():
    times = np.array([0.0, 1.0, 1.5, 2.5, 3.0, 3.1])
    sizes = np.array([1, 4, 4, 4, 3, 4])
    s = host_overhead.steady_state(times, sizes, 4)            # gaps 1.0->1.5, 1.5->2.5 only
    assert s["steps"] == 2 and s["host_ms_per_step"] == pytest.approx(750.0)
    assert s["steps_per_s"] == pytest.approx(1 / 0.75)
    assert host_overhead.steady_state(times, sizes, 8)["steps"] == 0


def test_hold_needs_a_step_log(plan_dir):
    with pytest.raises(ValueError, match="step_log"):
        InstantRunner(Plan.load(plan_dir), hold_first_step=True)


def test_engine_only_and_served_small(plan_dir):
    e = host_overhead.engine_only(plan_dir, 4, 8, 4)
    assert e["steps"] == 7 and e["host_ms_per_step"] > 0          # 8 full-batch steps (prefill + 7 decodes)
    s = host_overhead.served(plan_dir, 4, 8, 4)                    # raises unless all 4 streams got 8 tokens
    assert s["steps"] >= 1 and s["stream_tpot_ms"] > 0

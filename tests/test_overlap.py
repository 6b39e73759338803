"""Overlapped steps: step N+1 is scheduled and launched before step N's tokens are seen; its pending tokens come
from the device (prev_rows -> the plan's resolve_input_ids op, or FakeRunner's equivalent), stop conditions are
checked one step late and a token past a stop is dropped. Outputs must equal the non-overlapped engine's token
for token (and the unpaged reference), on FakeRunner and on the NumPy backend.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from tests.fake_engine import tiny_plan
from tests.fake_runner import FakeRunner, FakeTokenizer
from tests.test_engine import VOCAB, expected, mkbuild, mkengine, random_requests
from xserv_aot.engine.api import SamplingParams
from xserv_aot.engine.llm_engine import LLMEngine
from xserv_aot.runtime import numpy_ops
from xserv_aot.serve import build_engine

EOS = (3,)


def run(reqs, overlap: bool, build=None, eos=EOS):
    runner = FakeRunner(build or mkbuild(), VOCAB, eos)
    eng = mkengine(runner=runner, eos=eos, overlap=overlap)
    outs = eng.generate([p for p, _ in reqs], [s for _, s in reqs])
    assert not eng.has_unfinished() and eng.stats().kv_blocks_used == 0
    return outs, runner


def summary(o):
    return (o.new_token_ids, o.text, o.finish_reason, o.num_generated_tokens, o.num_prompt_tokens,
            [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs or []])


@pytest.mark.parametrize("seed,num_blocks", [(0, 0), (1, 16), (2, 24)])
def test_overlap_equals_non_overlapped_and_the_reference(seed, num_blocks):
    reqs = random_requests(random.Random(seed), 12)
    build = mkbuild(num_blocks=num_blocks) if num_blocks else mkbuild()      # small pools preempt
    if num_blocks:
        reqs = [(p, SamplingParams(**{**s.__dict__, "max_tokens": min(s.max_tokens, 60 - len(p))})) for p, s in reqs]
    plain, _ = run(reqs, False, build)
    overlapped, runner = run(reqs, True, build)
    for (prompt, params), a, b in zip(reqs, plain, overlapped):
        assert summary(b) == summary(a), seed
        assert b.new_token_ids == expected(prompt, params, EOS), seed
    assert any(b.prev_rows is not None and (np.asarray(b.prev_rows) >= 0).any() for b in runner.batches)


def test_one_step_late_stop_never_emits_past_eos_or_a_stop_string():
    tok = FakeTokenizer(EOS)
    prompt = [5, 9, 14, 2]
    full = expected(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    text = tok.decode(full)
    stop = text[12:15]
    reqs = [(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])),
            (prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[full[7]])),
            ([7, 7, 1], SamplingParams(temperature=0.0, max_tokens=60))]            # ends at EOS
    plain, plain_runner = run(reqs, False)
    over, over_runner = run(reqs, True)
    assert [summary(o) for o in over] == [summary(o) for o in plain]
    s, t, e = over
    assert s.finish_reason == "stop" and s.text == text[:text.index(stop)] and stop not in s.text
    assert t.new_token_ids == full[:full.index(full[7]) + 1] and t.text == tok.decode(full[:full.index(full[7])])
    assert e.finish_reason == "stop" and e.new_token_ids[-1] in EOS and EOS[0] not in e.new_token_ids[:-1]
    rows = lambda r: sum(b.num_tokens for b in r.batches)
    assert rows(over_runner) >= rows(plain_runner) + 3        # each stop was computed past once, then dropped


def test_a_pending_last_token_is_not_scheduled_again():
    """max_tokens and max_seq_len are known ahead: no wasted step for them."""
    reqs = [([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)) for n in (1, 5, 9)]
    reqs.append(([4] * 90, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))   # hits max_seq_len 96
    plain, a = run(reqs, False)
    over, b = run(reqs, True)
    assert [summary(o) for o in over] == [summary(o) for o in plain]
    assert [bt.num_tokens for bt in b.batches] == [bt.num_tokens for bt in a.batches]


def test_resolve_input_ids_reference_op():
    ids = np.array([5, 0, 0, 9], dtype=np.int32)
    prev = np.array([-1, 2, 0, -1], dtype=np.int32)
    sampled = np.array([70, 71, 72], dtype=np.int32)
    assert numpy_ops.resolve_input_ids(ids, prev, sampled).tolist() == [5, 72, 70, 9]


def test_overlap_on_the_numpy_backend_equals_non_overlapped(tmp_path_factory):
    plan = tiny_plan(tmp_path_factory)
    base = build_engine(plan, backend="cpu").engine
    tok = base.tokenizer
    prompts = [tok.encode(t) for t in ("river violet engine", "harbor", "quartz meadow signal orbit lantern")]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=50, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.2, logprobs=1)]
    want = base.generate(prompts, params)
    over = LLMEngine(base.runner.__class__(base.runner.plan), tok, overlap=True)
    got = over.generate(prompts, params)
    assert [summary(o) for o in got] == [summary(o) for o in want]


def test_a_failed_step_under_overlap_ends_only_the_requests_in_flight():
    from tests.fake_runner import FaultyRunner
    from tests.test_faults import assert_idle_and_free, run_all
    reqs = random_requests(random.Random(11), 8)
    runner = FaultyRunner(FakeRunner(mkbuild(max_num_seqs=2, decode_buckets=[1, 2]), VOCAB), fail_calls={4, 9})
    eng = mkengine(runner=runner, overlap=True)
    for i, (prompt, params) in enumerate(reqs):
        eng.add_request(f"r{i}", prompt, params)
    outs = run_all(eng)
    errored = {rid for rid, o in outs.items() if o[-1].finish_reason == "error"}
    assert 1 <= len(errored) <= 4 and runner.failures == 2          # at most two steps in flight, two rows each
    for i, (prompt, params) in enumerate(reqs):
        ids = [t for o in outs[f"r{i}"] for t in o.new_token_ids]
        want = expected(prompt, params)
        assert ids == want[:len(ids)] if f"r{i}" in errored else ids == want, f"r{i}"
    assert_idle_and_free(eng)


@pytest.mark.parametrize("overlap", [False, True])
def test_blocks_of_a_request_that_ends_in_its_first_step_are_cached(overlap):
    eng = mkengine(overlap=overlap)
    prompt = list(range(10, 23))                                   # 13 tokens: 3 full blocks of 4
    first = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0]
    again = eng.generate([prompt + [1]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 12
    assert again.new_token_ids == expected(prompt + [1], SamplingParams(temperature=0.0, max_tokens=3,
                                                                        ignore_eos=True))

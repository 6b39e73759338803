"""Non-finite logits at run time: the sample op answers -1, the engine ends that request with an error (never a
token), the step counts as a failure (what /health reports), and enough of them in a row fail the engine."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.fake_runner import FakeDetokenizer, FakeRunner, FakeTokenizer, reference_generate
from xserv_aot.config import BuildConfig
from xserv_aot.engine.api import EngineFailedError, SamplingParams
from xserv_aot.engine.llm_engine import NONFINITE_ERROR, LLMEngine
from xserv_aot.runtime import numpy_ops

VOCAB = 50
BUILD = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[8, 16], max_seq_len=96, block_size=4,
             target="cpu")


class NaNRunner:
    """FakeRunner whose logits turn to `value` for rows whose context is at least `poison_at` tokens long and
    starts with `marker`; sampled_ids come from the NumPy `sample` op on the (poisoned) logits."""

    def __init__(self, marker: int, poison_at: int, value=np.nan):
        self.inner = FakeRunner(BuildConfig(**BUILD), VOCAB)
        self.plan, self.marker, self.poison_at, self.value = self.inner.plan, marker, poison_at, value

    def run(self, batch):
        res = self.inner.run(dataclasses.replace(batch, need_logits=True))
        logits = res.logits.copy()
        for i in range(batch.num_seqs):
            first_slot = batch.block_tables[i][0] * self.inner.build.block_size
            if batch.seq_lens[i] >= self.poison_at and self.inner.kv_tokens[first_slot] == self.marker:
                logits[i, 7] = self.value
        sampled = numpy_ops.sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.seeds,
                                   batch.sample_offsets)
        self.inner.last_sampled = sampled.copy()              # what an overlapped next step reads (resolve_input_ids)
        return type(res)(sampled, logits if batch.need_logits else None)

    def launch(self, batch):
        return self.run(batch)

    def wait(self, handle):
        return handle

    def reset_kv(self):
        self.inner.reset_kv()


def engine(runner, **kw):
    return LLMEngine(runner, FakeTokenizer(), detokenizer_factory=FakeDetokenizer, seed=0, **kw)


def run_all(eng, requests):
    outs = {rid: [] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        eng.add_request(rid, prompt, params)
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                final[o.request_id] = o
    return outs, final


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_sample_op_refuses_non_finite_rows(value):
    logits = np.zeros((2, 8), np.float32)
    logits[1, 3] = value
    got = numpy_ops.sample(logits, [0.0, 0.0], [0, 0], [1.0, 1.0], [0, 0], [0, 0])
    assert got.tolist() == [0, -1]


def test_sample_op_takes_minus_inf_as_masked_and_all_masked_as_no_token():
    logits = np.array([[0.0, 5.0, 1.0, 2.0], [-np.inf] * 4, [0.0, 5.0, 1.0, 2.0]], np.float32)
    logits[0, 1] = -np.inf                                   # the best token masked (apply_token_bitmask)
    got = numpy_ops.sample(logits, [0.0, 0.0, 0.9], [0, 0, 0], [1.0, 1.0, 1.0], [0, 0, 3], [0, 0, 0])
    assert got[0] == 3 and got[1] == -1 and got[2] in (0, 1, 2, 3)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                                    SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True),
                                    SamplingParams(temperature=0.7, logprobs=2, repetition_penalty=1.3, seed=5,
                                                   max_tokens=10, ignore_eos=True)],
                         ids=["greedy", "device-sampled", "host-sampled"])
@pytest.mark.parametrize("overlap", [False, True])
def test_nan_logits_end_only_that_request(params, overlap):
    """Under overlap the next step is launched before the -1 is seen, its input id for that row read from the -1
    on the device: the request still ends with the error and none of that row's later output is used."""
    marker = 41
    runner = NaNRunner(marker, poison_at=6)
    eng = engine(runner, overlap=overlap)
    bad_prompt, good_prompt = [marker, 1, 2, 3], [5, 6, 7]
    outs, final = run_all(eng, [("bad", bad_prompt, params), ("good", good_prompt, params)])
    assert final["bad"].finish_reason == "error" and final["bad"].error == NONFINITE_ERROR
    assert len(outs["bad"]) == 2                           # positions 4 and 5; the context of 6 is poisoned
    assert not any(lp.logprob < -1e3 for lp in (final["bad"].logprobs or []))
    assert outs["good"] == reference_generate(good_prompt, params, params.seed or 0, VOCAB)
    assert final["good"].finish_reason == "length"
    s = eng.stats()
    assert s.healthy and s.num_step_failures == 1 and s.last_error == NONFINITE_ERROR
    assert s.consecutive_failures == 0                     # later clean steps of "good" reset the count
    if overlap and not params.needs_host_sampling:
        assert any((np.asarray(b.prev_rows) >= 0).any() for b in runner.inner.batches)   # tokens fed on the device


def test_nan_logits_count_toward_health_and_fail_the_engine():
    marker = 41
    eng = engine(NaNRunner(marker, poison_at=1), max_consecutive_failures=2)
    p = SamplingParams(temperature=0.0, max_tokens=5)
    _, final = run_all(eng, [("a", [marker, 3], p)])
    assert final["a"].finish_reason == "error" and final["a"].new_token_ids == []
    assert eng.stats().consecutive_failures == 1 and eng.healthy
    _, final = run_all(eng, [("b", [marker, 4], p)])
    assert final["b"].finish_reason == "error"
    assert not eng.healthy and NONFINITE_ERROR in eng.failed
    with pytest.raises(EngineFailedError):
        eng.add_request("c", [1, 2], p)


# through the engine core process and the HTTP server, on the real NumPy backend

POISON_SEED = 4242


class PoisonSeedRunner:
    """Wraps a runner (in the engine core process): rows of requests with seed POISON_SEED get a NaN logit and every
    row is re-sampled by the NumPy `sample` op, so those rows come back as -1 from the op itself."""

    def __init__(self, inner):
        self.inner, self.plan = inner, inner.plan

    def run(self, batch):
        res = self.inner.run(dataclasses.replace(batch, need_logits=True))
        logits = np.array(res.logits[:batch.num_seqs], np.float32)
        logits[np.asarray(batch.seeds) == POISON_SEED, 0] = np.nan
        sampled = numpy_ops.sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.seeds,
                                   batch.sample_offsets)
        return type(res)(sampled, logits if batch.need_logits else None)

    def reset_kv(self):
        self.inner.reset_kv()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.fake_engine import tiny_plan
    return tiny_plan(tmp_path_factory, num_blocks=64)


def test_nan_in_the_engine_core_process_is_a_500_and_a_counted_failure(tiny):
    import functools

    import httpx

    from tests.fake_engine import LiveServer
    from xserv_aot.serve import build_engine
    from xserv_aot.server import create_app

    ae = build_engine(tiny, backend="cpu", model_name="tiny", engine_process=True,
                      runner_wrapper=functools.partial(PoisonSeedRunner))
    body = {"model": "tiny", "prompt": "meadow signal", "max_tokens": 4, "temperature": 0.5, "ignore_eos": True}
    with LiveServer(create_app(ae, model_name="tiny", manage_engine=True)) as url:
        r = httpx.post(url + "/v1/completions", json={**body, "seed": POISON_SEED}, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal error while generating"
        st = ae.stats()
        assert st.healthy and st.num_step_failures == 1 and st.last_error == NONFINITE_ERROR
        h = httpx.get(url + "/health", timeout=10)                          # one failed step: degraded, not down
        assert h.status_code == 200 and h.json() == {"status": "degraded", "consecutive_step_failures": 1}
        r = httpx.post(url + "/v1/completions", json={**body, "seed": 7}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert ae.stats().consecutive_failures == 0

"""Grammar masks on the device path: the plan op apply_token_bitmask (NumPy reference against a bit-by-bit loop),
its place in every bucket, and the engine sending grammar rows through it (no logits copy) on the NumPy backend,
with the same greedy tokens as the host path and no effect on rows without a grammar."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.fake_engine import tiny_plan
from xserv_aot.engine.api import GuidedDecoding, SamplingParams
from xserv_aot.plan.manifest import Plan
from xserv_aot.runtime import numpy_ops
from xserv_aot.serve import build_engine


def test_reference_op_bit_by_bit():
    seed = 3
    rng = np.random.default_rng(seed)
    rows, v = 5, 70                                         # 3 words, the last one partly used
    logits = rng.standard_normal((rows, v)).astype(np.float32)
    mask = rng.integers(-2 ** 31, 2 ** 31, size=(rows, 3), dtype=np.int64).astype(np.int32)
    flags = np.array([1, 0, 1, 1, 0], dtype=np.int32)
    out = numpy_ops.apply_token_bitmask(logits, mask, flags)
    for r in range(rows):
        for i in range(v):
            allowed = not flags[r] or (int(mask[r, i // 32]) >> (i % 32)) & 1
            assert out[r, i] == (logits[r, i] if allowed else -np.inf), (seed, r, i)


def test_every_bucket_masks_right_before_sampling(tmp_path_factory):
    plan = Plan.load(tiny_plan(tmp_path_factory), verify="none")
    words = -(-plan.model.vocab_size // 32)
    assert plan.arena["token_bitmask"].shape == [plan.build.max_num_seqs, words]
    for bucket in plan.buckets:
        names = [op.op for op in bucket.ops]
        assert names[-2:] == ["apply_token_bitmask", "sample"], bucket.name
        assert bucket.ops[-2].rows == bucket.num_seqs and bucket.ops[-2].n == plan.model.vocab_size


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return build_engine(tiny_plan(tmp_path_factory), backend="cpu").engine


def spy(engine):
    batches = []
    real = engine.runner.run

    def run(batch):
        batches.append((list(batch.bitmask_rows), batch.need_logits, batch.num_seqs))
        return real(batch)
    engine.runner.run = run
    return batches, lambda: setattr(engine.runner, "run", real)


def test_grammar_rows_sample_on_the_device_and_match_the_host_path(engine):
    ids = engine.tokenizer.encode("Answer:")
    specs = [GuidedDecoding("regex", r"[a-c]{2,4}-[0-9]"), GuidedDecoding("choice", json.dumps(["yes", "no way"])),
             GuidedDecoding("json", json.dumps({"type": "object", "properties": {"n": {"type": "integer",
                                                "minimum": 0, "maximum": 99}}, "required": ["n"],
                                                "additionalProperties": False}))]
    batches, undo = spy(engine)
    try:
        device = engine.generate([ids] * 3, [SamplingParams(max_tokens=20, temperature=0, guided=g) for g in specs])
    finally:
        undo()
    assert all(not need for _, need, _ in batches)              # no logits came back to the host
    assert any(rows for rows, _, _ in batches) and all(len(r) in (0, n) for r, _, n in batches)
    host = engine.generate([ids] * 3, [SamplingParams(max_tokens=20, temperature=0, guided=g, logprobs=0)
                                       for g in specs])          # logprobs: the host sampler, mask on the host
    assert [o.new_token_ids for o in device] == [o.new_token_ids for o in host]
    assert all(o.finish_reason == "stop" for o in device)


def test_rows_without_a_grammar_pass_through(engine):
    ids = engine.tokenizer.encode("river violet")
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = engine.generate([ids], plain)[0].new_token_ids
    mixed = engine.generate([ids, ids + [11]], [plain, SamplingParams(max_tokens=6, temperature=0,
                                                   guided=GuidedDecoding("regex", "[0-9]{6}"))])
    assert mixed[0].new_token_ids == alone
    assert mixed[1].text.isdigit() and len(mixed[1].text) == 6


def test_grammar_rows_under_overlapped_steps(engine):
    """Overlap on: a step where a grammar row samples completes before the next is scheduled (its matcher must see
    the token first), other steps still overlap; outputs equal the non-overlapped engine's, forks (n > 1) too."""
    from xserv_aot.engine.llm_engine import LLMEngine
    tok = engine.tokenizer
    over = LLMEngine(engine.runner.__class__(engine.runner.plan), tok, overlap=True)
    launches, waited = [], {}                                   # step -> steps launched when it was waited for
    real_launch, real_wait = over.runner.launch, over.runner.wait

    def launch(batch):
        launches.append(len(batch.bitmask_rows) > 0)
        return len(launches), real_launch(batch)

    def wait(handle):
        waited[handle[0]] = len(launches)
        return real_wait(handle[1])
    over.runner.launch, over.runner.wait = launch, wait
    long = tok.encode("quartz meadow signal orbit lantern " * 3)
    prompts = [tok.encode("Answer:"), long, long, tok.encode("river violet")]
    specs = [GuidedDecoding("regex", r"[a-c]{2,4}-[0-9]"), None, None, GuidedDecoding("choice", '["yes", "no way"]')]
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=5 + i, guided=g, ignore_eos=g is None)
              for i, g in enumerate(specs)]
    want = engine.generate(prompts, params)
    got = over.generate(prompts, params)
    assert [(o.new_token_ids, o.text, o.finish_reason) for o in got] == \
           [(o.new_token_ids, o.text, o.finish_reason) for o in want]
    masked = [n for n, m in enumerate(launches, 1) if m]
    assert masked and all(waited[n] == n for n in masked)       # each masked step was waited for at once
    assert any(waited[n] > n for n in waited)                   # steps without masks overlapped

"""Overlapped steps on the GPU: the resolve_input_ids kernel against its NumPy op, a graph replay whose input ids
are placeholders resolved from the previous step's sampled_ids on the device against the same step with the real
ids, and the engine with overlap on against overlap off (greedy, seeded and host-sampled rows)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import lib, rng  # noqa: F401  (fixtures)
from tests.test_cuda_runner import SHAPE, plan, runner  # noqa: F401  (fixtures)
from xserv_aot.runtime import numpy_ops as ref

pytestmark = pytest.mark.gpu


def test_resolve_input_ids_kernel(lib, rng):  # noqa: F811
    T, S = 300, 40
    ids = rng.integers(0, 1000, T).astype(np.int32)
    prev = np.where(rng.random(T) < 0.5, rng.integers(0, S, T), -1).astype(np.int32)
    sampled = rng.integers(0, 1000, S).astype(np.int32)
    dev_ids = lib.to_device(ids)
    lib.launch("resolve_input_ids", [-(-T // 256)], [256], [("ptr", dev_ids), ("ptr", lib.to_device(prev)),
                                                           ("ptr", lib.to_device(sampled)), ("i32", T)])
    np.testing.assert_array_equal(dev_ids.numpy(), ref.resolve_input_ids(ids, prev, sampled))


def decode_batch(session, k: int, token: int, prev_row: int = -1):
    from xserv_aot.runtime.batch import BatchDescription
    pos = session.lens[k]
    session.lens[k] += 1
    table = session.table(k)
    slot = table[pos // session.block_size] * session.block_size + pos % session.block_size
    return BatchDescription([token], [pos], [slot], [0, 1], [pos + 1], [table], prev_rows=[prev_row])


def test_graph_replay_with_a_placeholder_equals_the_real_token(runner):  # noqa: F811
    from xserv_aot.runtime.session import Session
    prompt = np.random.default_rng(3).integers(3, SHAPE["vocab_size"], size=37).tolist()
    runner.reset_kv()
    s = Session(runner)
    tok, _ = s.prefill(0, prompt)
    want = runner.run(decode_batch(s, 0, tok))              # the real token, staged from the host
    want2 = runner.run(decode_batch(s, 0, int(want.sampled_ids[0])))
    runner.reset_kv()
    s = Session(runner)
    s.prefill(0, prompt)                                    # sampled_ids[0] on the device holds tok
    h = runner.launch(decode_batch(s, 0, 0x7fffffff, prev_row=0))      # placeholder: never read as a token
    h2 = runner.launch(decode_batch(s, 0, 0x7fffffff, prev_row=0))     # launched before h is waited
    got, got2 = runner.wait(h), runner.wait(h2)
    assert got.sampled_ids.tolist() == want.sampled_ids.tolist()
    assert got2.sampled_ids.tolist() == want2.sampled_ids.tolist()


def _generate(runner, prompts, params, overlap):
    from xserv_aot.engine.llm_engine import LLMEngine
    shapes = []
    orig = runner.launch

    def launch(batch):
        shapes.append((batch.num_tokens, batch.num_seqs))
        return orig(batch)
    runner.reset_kv()
    runner.launch = launch
    try:
        eng = LLMEngine(runner, None, seed=0, overlap=overlap)
        out = [(o.new_token_ids, o.finish_reason) for o in eng.generate(prompts, params)]
    finally:
        del runner.launch
    assert eng.stats().kv_blocks_used == 0
    return out, shapes


def _requests(seed: int, n: int):
    from xserv_aot.engine.api import SamplingParams
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, SHAPE["vocab_size"], size=int(k)).tolist() for k in rng.integers(5, 90, size=n)]
    params = [SamplingParams(max_tokens=int(rng.integers(4, 30)), temperature=float(t), top_p=0.9, seed=i,
                             ignore_eos=True, logprobs=2 if i % 3 == 0 else None)
              for i, t in enumerate(rng.choice([0.0, 0.7, 1.0], size=n))]
    return prompts, params


def test_engine_overlap_on_equals_off(runner):  # noqa: F811
    """As many requests as the plan has sequence slots: the steps have the same shapes with overlap on and off,
    so the same kernels run on the same inputs and every token must be identical (greedy, seeded, host-sampled)."""
    prompts, params = _requests(5, runner.plan.build.max_num_seqs)
    (off, shapes_off), (on, shapes_on) = (_generate(runner, prompts, params, o) for o in (False, True))
    assert shapes_on == shapes_off
    assert on == off


def test_engine_overlap_with_admissions(runner):  # noqa: F811
    """More requests than slots: a slot freed by a finished request is seen one step later with overlap on, so
    later steps can fall into other buckets (other kernels, bf16-level differences). Every request still gets
    its max_tokens tokens and finish reason, and greedy requests the same tokens."""
    prompts, params = _requests(5, 10)
    (off, _), (on, _) = (_generate(runner, prompts, params, o) for o in (False, True))
    assert [(len(t), r) for t, r in on] == [(len(t), r) for t, r in off]
    assert [t for (t, _), p in zip(on, params) if p.temperature == 0] == \
           [t for (t, _), p in zip(off, params) if p.temperature == 0]

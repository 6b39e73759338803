"""The engine (scheduler, block manager, host + device sampling) driving the CudaRunner, without the HTTP layer
(the device image lacks starlette/uvicorn)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.test_cuda_runner import SHAPE, plan, runner  # noqa: F401  (fixtures)

pytestmark = pytest.mark.gpu


def engine(runner):  # noqa: F811
    from xserv_aot.engine.llm_engine import LLMEngine
    return LLMEngine(runner, None, seed=0)


def test_single_request_equals_session(runner, seed):  # noqa: F811
    """One greedy request through the engine runs the same buckets as Session: identical tokens."""
    from xserv_aot.engine.api import SamplingParams
    from xserv_aot.runtime.session import Session
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, SHAPE["vocab_size"], size=40).tolist()
    runner.reset_kv()
    want, _ = Session(runner).greedy(prompt, 24)
    runner.reset_kv()
    got = engine(runner).generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert got.new_token_ids == want


def test_concurrent_requests_finish_and_free_blocks(runner, seed):  # noqa: F811
    from xserv_aot.engine.api import SamplingParams
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, SHAPE["vocab_size"], size=int(n)).tolist() for n in rng.integers(5, 90, size=10)]
    eng = engine(runner)
    params = [SamplingParams(max_tokens=int(rng.integers(4, 30)), temperature=float(t), top_p=0.9, seed=i,
                             ignore_eos=True, logprobs=2 if i % 3 == 0 else None)
              for i, t in enumerate(rng.choice([0.0, 0.7, 1.0], size=10))]
    outs = eng.generate(prompts, params)
    assert [len(o.new_token_ids) for o in outs] == [p.max_tokens for p in params]
    assert all(o.finish_reason == "length" for o in outs)
    assert all(0 <= t < SHAPE["vocab_size"] for o in outs for t in o.new_token_ids)
    assert all(o.logprobs and len(o.logprobs) == p.max_tokens for o, p in zip(outs, params) if p.logprobs)
    st = eng.stats()
    assert (st.num_running, st.num_waiting, st.kv_blocks_used) == (0, 0, 0)
    again = engine(runner).generate(prompts, params)          # same seeds, same batch: same tokens
    assert [o.new_token_ids for o in again] == [o.new_token_ids for o in outs]

"""A plan built with a wgmma prefill attention variant (BuildConfig.prefill_attention; auto: the default) serves a prompt longer than
its prefill chunk (the second chunk's queries start at an offset, over a partly filled KV block) and agrees with
the NumPy backend of the same plan: teacher-forced logits of the prefill and of the decode steps after it."""
from __future__ import annotations

import numpy as np
import pytest

from tests.test_cuda_runner import forced_logits, rel_err

pytestmark = pytest.mark.gpu

SHAPE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=128)
BUILD = dict(max_num_seqs=2, decode_buckets=[1, 2], prefill_buckets=[16, 256], max_seq_len=512, block_size=16,
             dtype="bfloat16", target="sm_90a")


@pytest.mark.parametrize("variant", ["auto", "wg3h1k64s4o", "ws2h2k128s3o", "ws3h1k64s4", "ws3h1k64s4o",
                                     "ws2h2k64s4oplq"])
def test_wgmma_variant_plan_matches_numpy_backend(tmp_path, seed, variant):
    from xserv_aot.runtime.select import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from tests.tiny_models import make_tiny_model
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.runtime.cuda.runner import CudaRunner
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    model_dir = make_tiny_model(tmp_path / "hf", "qwen3", seed=seed, **SHAPE)
    plan = compile_plan(model_dir, tmp_path / "plan", BuildConfig(**BUILD, prefill_attention=variant))
    fns = {op.cuda.kernel for bk in plan.buckets if bk.kind == "prefill" for op in bk.ops if op.op == "attention"}
    from xserv_aot.plan.attention_plan import default_prefill_variant
    m = {"num_heads": SHAPE["num_attention_heads"], "num_kv_heads": SHAPE["num_key_value_heads"], "head_dim": 128}
    want = {default_prefill_variant(m, rows) for rows in BUILD["prefill_buckets"]} if variant == "auto" else {variant}
    assert fns == {f"attn_prefill_{v}_hd128" for v in want}
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, SHAPE["vocab_size"], 300).tolist()     # chunks of 256 + 44 tokens
    forced = rng.integers(3, SHAPE["vocab_size"], 6).tolist()
    runner = CudaRunner(plan, log=print)
    try:
        got = forced_logits(runner, prompt, forced)
    finally:
        runner.close()
    want = forced_logits(NumpyRunner(plan), prompt, forced)
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    assert max(errs) <= 2e-2, f"{variant}: {errs} (seed {seed})"          # the tolerance of test_cuda_runner

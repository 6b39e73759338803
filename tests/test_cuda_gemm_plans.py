"""Plans whose prefill linears use the per-shape CUTLASS configs and the residual epilogue, on the GPU: a tiny
Qwen3 compiled three ways from the same weights (a gemm_configs table naming configs with a residual twin; the same
table with gemm_residual on; a table naming the other candidates: stream-K, ping-pong 128x128, cluster 1x2) runs
a 200-token prompt in one prefill_256 chunk (CUTLASS rows) plus teacher-forced decode steps. The residual plan's
logits equal the unfused plan's bit for bit (the epilogue rounds like linear + add_rmsnorm); every plan agrees
with the NumPy backend on the same plan.

The library: --gemm-lib (a built libxserv_gemm.so), else the one cutlass_build builds or has cached."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.test_cuda_runner import forced_logits, rel_err

pytestmark = pytest.mark.gpu

SHAPE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)
BUILD = dict(max_num_seqs=2, decode_buckets=[1, 2], prefill_buckets=[16, 256], max_seq_len=512, block_size=16,
             dtype="bfloat16", target="sm_90a")
# N x K: qkv 512x256, o_proj 256x256, gate_up 1024x256, down 256x512
TWINNED = {"256x256": "sm90_bf16_128x256x64_c2x1_coop", "256x512": "sm90_bf16_256x128x64_c2x1_coop",
           "512x256": "sm90_bf16_128x256x64_c2x1_coop", "1024x256": "sm90_bf16_256x128x64_c2x1_coop"}
OTHERS = {"256x256": "sm90_bf16_128x128x64_c1x2_pingpong", "256x512": "sm90_bf16_128x256x64_c2x1_streamk",
          "512x256": "sm90_bf16_128x256x64_c1x2_coop", "1024x256": "sm90_bf16_128x256x64_c2x1_streamk"}
VARIANTS = {"twinned": dict(gemm_configs=TWINNED), "residual": dict(gemm_configs=TWINNED, gemm_residual=True),
            "others": dict(gemm_configs=OTHERS)}


@pytest.fixture(scope="module")
def plans(tmp_path_factory, seed_for, pytestconfig):
    from xserv_aot.runtime.select import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from tests.tiny_models import make_tiny_model
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan import cutlass_build as cb
    from xserv_aot.plan.builder import compile_plan
    tmp = tmp_path_factory.mktemp("gemm_plans")
    model_dir = make_tiny_model(tmp / "hf", "qwen3", seed=seed_for("test_cuda_gemm_plans.model"), **SHAPE)
    given = pytestconfig.getoption("--gemm-lib")
    with pytest.MonkeyPatch.context() as mp:
        if given:
            mp.setattr(cb, "build_gemm_library",
                       lambda out_dir, target="sm_90a", progress=None, **kw: cb.install_library(Path(given), out_dir,
                                                                                               "given"))
        out = {name: compile_plan(model_dir, tmp / name, BuildConfig(**BUILD, **extra))
               for name, extra in VARIANTS.items()}
    for name, plan in out.items():
        if plan.kernels["gemm_library"] is None:
            pytest.skip(f"no CUTLASS library: {plan.kernels['gemm_library_skipped']}")
    ops = [op for bk in out["residual"].buckets if bk.name == "prefill_256" for op in bk.ops]
    assert sum(1 for op in ops if op.cuda.fused_residual) == 2 * SHAPE["num_hidden_layers"]
    return out


def run_cuda(plan, prompt, forced):
    from xserv_aot.runtime.cuda.runner import CudaRunner
    runner = CudaRunner(plan, log=print)
    try:
        return forced_logits(runner, prompt, forced)
    finally:
        runner.close()


def test_residual_epilogue_plan_equals_the_unfused_plan_bitwise(plans, seed):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, SHAPE["vocab_size"], 200).tolist()      # one prefill_256 chunk: CUTLASS rows
    forced = rng.integers(3, SHAPE["vocab_size"], 4).tolist()
    unfused = run_cuda(plans["twinned"], prompt, forced)
    fused = run_cuda(plans["residual"], prompt, forced)
    np.testing.assert_array_equal(fused, unfused)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_plans_match_the_numpy_backend(plans, name, seed):
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, SHAPE["vocab_size"], 200).tolist()
    forced = rng.integers(3, SHAPE["vocab_size"], 4).tolist()
    got = run_cuda(plans[name], prompt, forced)
    want = forced_logits(NumpyRunner(plans[name]), prompt, forced)
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    assert max(errs) <= 2e-2, errs          # the tolerance of test_cuda_runner.py (bf16 roundings differ)

"""On the GPU: fill_normal_bf16 writes exactly the NumPy generator's values (plan/dummy_weights.py) rounded to bf16,
so a dummy plan is one model on both backends: same weight bits, logits within the bf16 kernel tolerance."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.cuda_fixtures import lib  # noqa: F401  (fixture)
from xserv_aot.dtypes import to_bf16_bits
from xserv_aot.plan.dummy_weights import dummy_values

pytestmark = pytest.mark.gpu

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1024, "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
          "tie_word_embeddings": False}
BUILD = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[16, 64], max_seq_len=256, block_size=16,
             dtype="bfloat16", target="sm_90a")


@pytest.mark.parametrize("n,seed,mean,std", [(1, 3, 0.0, 1.0), (1000, 2**63 + 5, 1.0, 0.1),
                                             (65536 * 256 + 1001, 77, 0.0, 4096 ** -0.5)])
def test_kernel_writes_the_numpy_generator_bits(lib, n, seed, mean, std):
    out = lib.empty((n,), "bfloat16")
    lib.launch("fill_normal_bf16", [min(-(-n // 256), 65536)], [256],
               [("ptr", out), ("u64", n), ("u64", seed), ("f32", mean), ("f32", std)])
    got = to_bf16_bits(out.numpy())
    want = to_bf16_bits(dummy_values(seed, n, mean, std))
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} of {n} differ, first at {bad[:5]}"


def test_dummy_plan_is_one_model_on_both_backends(tmp_path):
    from xserv_aot.runtime.select import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from tests.test_cuda_runner import forced_logits, rel_err
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.runtime.cuda.runner import CudaRunner
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    (tmp_path / "c.json").write_text(json.dumps(CONFIG))
    plan = compile_plan(tmp_path / "c.json", tmp_path / "plan", BuildConfig(**BUILD), dummy_weights=True, dummy_seed=9)
    cpu = NumpyRunner(plan)
    gpu = CudaRunner(plan)
    try:
        for name, info in plan.weights.items():
            dev = gpu.dev.dtoh(gpu.weights_ptr + info.offset, info.shape, np.uint16 if info.dtype == "bfloat16"
                               else np.float32)
            host = to_bf16_bits(cpu.w[name]) if info.dtype == "bfloat16" else cpu.w[name]
            np.testing.assert_array_equal(dev, host, err_msg=name)
        rng = np.random.default_rng(4)
        prompt, forced = rng.integers(3, 1024, 40).tolist(), rng.integers(3, 1024, 6).tolist()
        errs = [rel_err(g, c) for g, c in zip(forced_logits(gpu, prompt, forced), forced_logits(cpu, prompt, forced))]
        assert max(errs) <= 2e-2, errs             # the tolerance of test_cuda_runner.test_matches_numpy_backend
    finally:
        gpu.close()

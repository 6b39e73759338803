"""The dummy-weight generator (plan/dummy_weights.py) against a per-element reference written from its docstring
with Python integers and NumPy float32 scalars; the NumPy backend holds those values rounded to the plan dtype."""
from __future__ import annotations

import json

import numpy as np

from xserv_aot.config import BuildConfig
from xserv_aot.dtypes import round_to
from xserv_aot.plan.builder import compile_plan
from xserv_aot.plan.dummy_weights import dummy_values, tensor_params
from xserv_aot.plan.manifest import Plan
from xserv_aot.runtime.numpy_backend import load_weights

M64 = (1 << 64) - 1
F = np.float32


def ref_splitmix64(seed: int, i: int) -> int:
    z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def ref_value(seed: int, i: int, mean: float, std: float) -> np.float32:
    z = ref_splitmix64(seed, i)
    s = F(sum((z >> sh) & 0xFFFF for sh in (0, 16, 32, 48)))
    g = F(F(F(s * F(1 / 65536)) - F(2)) * F(1.7320508))
    return F(F(g * F(std)) + F(mean))


def test_generator_matches_the_per_element_reference():
    rng = np.random.default_rng(11)
    print("seed 11")
    for _ in range(5):
        seed, n = int(rng.integers(0, 2**63)), int(rng.integers(1, 300))
        mean, std = float(rng.choice([0.0, 1.0])), float(rng.uniform(0.01, 1))
        got = dummy_values(seed, n, mean, std)
        want = np.array([ref_value(seed, i, mean, std) for i in range(n)], dtype=np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_values_look_normal_and_tensors_differ():
    a = dummy_values(tensor_params(0, 0, [512, 512])[0], 1 << 18, 0.0, 1.0)
    b = dummy_values(tensor_params(0, 1, [512, 512])[0], 1 << 18, 0.0, 1.0)
    assert abs(a.mean()) < 0.01 and abs(a.std() - 1) < 0.01 and abs(a).max() <= 2 * 3 ** 0.5
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.01
    assert tensor_params(0, 3, [64])[1:] == (1.0, 0.1) and tensor_params(0, 3, [8, 64])[1:] == (0.0, 0.125)


def test_numpy_backend_holds_the_generator_rounded_to_the_plan_dtype(tmp_path):
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 16, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1e4,
           "tie_word_embeddings": False}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    build = BuildConfig(max_num_seqs=2, decode_buckets=[1, 2], prefill_buckets=[8], max_seq_len=32, block_size=4,
                        dtype="bfloat16", target="cpu")
    plan = Plan.load(compile_plan(tmp_path / "c.json", tmp_path / "p", build, dummy_weights=True, dummy_seed=5).dir)
    w = load_weights(plan)
    names = [n for n in plan.weights if not n.startswith("rope_")]
    for index, name in enumerate(names):
        tseed, mean, std = tensor_params(5, index, plan.weights[name].shape)
        want = round_to(dummy_values(tseed, w[name].size, mean, std), "bfloat16").reshape(w[name].shape)
        np.testing.assert_array_equal(w[name], want)

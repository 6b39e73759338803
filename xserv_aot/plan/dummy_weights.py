"""Dummy weights from a config alone (benchmarks, CPU-vs-GPU comparisons): one generator, implemented here in NumPy
and as kernels/elementwise.cu fill_normal_bf16 on the GPU, bit-identical after rounding to the plan dtype.

Tensor t (in weight_specs order) of a plan seeded `seed` draws element i from z = splitmix64(splitmix64(seed, t), i):
g = (sum of the four 16-bit fields of z / 65536 - 2) * 1.7320508 (Irwin-Hall, mean 0, std 1) and value
mean + g * std, each step rounded to float32; norms (1-D) have mean 1, std 0.1, matrices mean 0, std 1/sqrt(cols).
An FP8 weight of the plan is those float32 values quantized at its scheme (plan/quantize.py quantized_stream), as a
compile from a checkpoint holding them would; runtime/cuda/dummy_upload.py computes them on the host too.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from xserv_aot.model_config import ModelConfig
from xserv_aot.plan.quantize import quantized_stream
from xserv_aot.plan.weights import rope_tables, weight_specs
from xserv_aot.rng import splitmix64

CHUNK = 1 << 22
_LOW16 = np.uint64(0xFFFF)


def tensor_params(seed: int, index: int, shape: list[int]) -> tuple[int, float, float]:
    """(tensor seed, mean, std) of dummy tensor `index`: the arguments of fill_normal_bf16 too."""
    mean, std = (1.0, 0.1) if len(shape) == 1 else (0.0, float(shape[1]) ** -0.5)
    return int(splitmix64(seed, [index])[0]), mean, std


def dummy_values(tensor_seed: int, n: int, mean: float, std: float) -> np.ndarray:
    """float32 [n]: the generator's values, before rounding to the plan dtype."""
    out = np.empty(n, dtype=np.float32)
    for lo in range(0, n, CHUNK):
        z = splitmix64(tensor_seed, np.arange(lo, min(n, lo + CHUNK), dtype=np.uint64))
        s = ((z & _LOW16) + ((z >> np.uint64(16)) & _LOW16) + ((z >> np.uint64(32)) & _LOW16)
             + (z >> np.uint64(48))).astype(np.float32)
        g = (s * np.float32(1 / 65536) - np.float32(2)) * np.float32(1.7320508)
        out[lo:lo + len(z)] = g * np.float32(std) + np.float32(mean)
    return out


def dummy_tensors(m: ModelConfig, max_seq_len: int, seed: int) -> Iterator[tuple[str, np.ndarray, bool]]:
    """(plan name, float32 array, is_rope_table) for every tensor of a dummy plan, in plan order."""
    for index, (name, (shape, _)) in enumerate(weight_specs(m).items()):
        tseed, mean, std = tensor_params(seed, index, shape)
        yield name, dummy_values(tseed, int(np.prod(shape)), mean, std).reshape(shape), False
    cos, sin = rope_tables(m, max_seq_len)
    yield "rope_cos", cos, True
    yield "rope_sin", sin, True


def dummy_plan_tensors(plan) -> Iterator[tuple[str, np.ndarray, bool]]:
    """Every tensor of a dummy-weight plan in its table order: dummy_tensors, FP8 weights quantized."""
    return quantized_stream(dummy_tensors(plan.model, plan.build.max_seq_len, int(plan.dummy_seed or 0)),
                            plan.fp8_schemes, plan.model.tie_word_embeddings)

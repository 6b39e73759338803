"""The one counter-based RNG (docs/plan-format.md): splitmix64 of (seed, offset) on 64-bit unsigned integers, the
same on every backend (kernels/common.cuh splitmix64). Sampling draws and dummy weights both come from it."""
from __future__ import annotations

import numpy as np

_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def splitmix64(seed: int, offsets) -> np.ndarray:
    """uint64 array: splitmix64(seed, offset) for every offset (arithmetic wraps modulo 2**64)."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + (np.asarray(offsets, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def uniform(seed: int, offset: int) -> float:
    """The sampler's draw in [0, 1): the top 24 bits of splitmix64(seed, offset)."""
    return float(splitmix64(seed, [offset])[0] >> np.uint64(40)) * 2.0 ** -24

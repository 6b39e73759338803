"""Shared fixtures of the kernel-level GPU tests: the standalone kernel library, a fresh RNG, bf16 rounding."""
from __future__ import annotations

import numpy as np
import pytest

from xserv_aot.dtypes import round_to


@pytest.fixture(scope="module")
def lib():
    from xserv_aot.runtime.select import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from xserv_aot.runtime.cuda.kernel_lib import KernelLib
    return KernelLib()


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)                 # recorded and printed on failure (tests/conftest.py)


def bf(x):
    return round_to(np.asarray(x, np.float32), "bfloat16")

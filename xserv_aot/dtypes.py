"""dtype names used in plans, and bfloat16 stored as raw uint16 words (round-to-nearest-even); float8_e4m3fn
(FP8 weights and activations) stored as its raw bytes through ml_dtypes."""
from __future__ import annotations

import ml_dtypes
import numpy as np

FP8 = "float8_e4m3fn"
FP8_MAX = 448.0                  # largest finite e4m3fn value (no infinities; 0x7f / 0xff are NaN)
STORAGE = {"bfloat16": np.uint16, "float32": np.float32, "int32": np.int32, "int64": np.int64,
           FP8: ml_dtypes.float8_e4m3fn}
ITEMSIZE = {name: np.dtype(t).itemsize for name, t in STORAGE.items()}


def storage_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(STORAGE[name])
    except KeyError:
        raise ValueError(f"unknown plan dtype {name!r}") from None


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = np.isnan(x)
    out = rounded.astype(np.uint16)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as the given plan dtype would hold them (still float32)."""
    if dtype == "bfloat16":
        return from_bf16_bits(to_bf16_bits(x))
    if dtype == FP8:
        return to_fp8(x).astype(np.float32)
    return np.asarray(x, dtype=np.float32)


def to_fp8(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn, round to nearest even; callers keep |x| <= FP8_MAX (a larger value becomes NaN)."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)


def encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 array -> storage array of the plan dtype."""
    if dtype == "bfloat16":
        return to_bf16_bits(x)
    if dtype == FP8:
        return np.ascontiguousarray(to_fp8(x))
    return np.ascontiguousarray(x, dtype=storage_dtype(dtype))


def decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    """storage array -> float32 (or the integer dtype itself)."""
    if dtype == "bfloat16":
        return from_bf16_bits(raw)
    if dtype == FP8:
        return np.asarray(raw).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return raw

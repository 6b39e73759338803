"""dtype names used in plans, and bfloat16 stored as raw uint16 words (round-to-nearest-even)."""
from __future__ import annotations

import numpy as np

STORAGE = {"bfloat16": np.uint16, "float32": np.float32, "int32": np.int32, "int64": np.int64}
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
    return np.asarray(x, dtype=np.float32)


def encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 array -> storage array of the plan dtype."""
    if dtype == "bfloat16":
        return to_bf16_bits(x)
    return np.ascontiguousarray(x, dtype=storage_dtype(dtype))


def decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    """storage array -> float32 (or the integer dtype itself)."""
    if dtype == "bfloat16":
        return from_bf16_bits(raw)
    return raw

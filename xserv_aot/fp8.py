"""FP8 (e4m3fn) numerics shared by compile-time weight quantization and the NumPy ops (docs/plan-format.md "FP8").

A scale is s = max(amax, 1e-12) / 448 in float32 (or, for weights with fp8_scale "mse", mse_scale's clipped one)
and a value is stored as e4m3(x / s), round to nearest even.
Weights: "fp8_channel" scale [N] (one per output row), "fp8_block128" scale [ceil(N/128), ceil(K/128)].
Activations (W8A8): per token row and K-group of act_group(scheme, k) columns, the last group possibly shorter.
"""
from __future__ import annotations

import numpy as np

from xserv_aot.dtypes import FP8_MAX, to_fp8

CHANNEL, BLOCK128 = "fp8_channel", "fp8_block128"
SCHEMES = (CHANNEL, BLOCK128)
BLOCK = 128
MIN_AMAX = 1e-12
CLIP_GRID = tuple(np.linspace(1.0, 0.5, 51))   # clip factors mse_scale tries, 1 (no clipping) first


def scale_of(amax: np.ndarray) -> np.ndarray:
    return np.maximum(np.asarray(amax, dtype=np.float32), np.float32(MIN_AMAX)) / np.float32(FP8_MAX)


def groups(k: int, group: int) -> int:
    return -(-k // group)


def act_group(scheme: str, k: int) -> int:
    """K-group of a W8A8 linear's activation scales: 128 against block weights, the whole row against channel."""
    check_scheme(scheme)
    return BLOCK if scheme == BLOCK128 else k


def weight_scale_shape(scheme: str, n: int, k: int) -> list[int]:
    check_scheme(scheme)
    return [n] if scheme == CHANNEL else [groups(n, BLOCK), groups(k, BLOCK)]


def check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown FP8 scheme {scheme!r} (known: {', '.join(SCHEMES)})")


def _blocks(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """[R, C] -> zero-padded [ceil(R/rows), rows, ceil(C/cols), cols] view of the blocks."""
    r, c = x.shape
    pad = np.zeros((groups(r, rows) * rows, groups(c, cols) * cols), dtype=np.float32)
    pad[:r, :c] = x
    return pad.reshape(groups(r, rows), rows, groups(c, cols), cols)


def _quantize_blocks(x: np.ndarray, rows: int, cols: int, s: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 values as float32 [R, C], scales [ceil(R/rows), ceil(C/cols)]) with one scale per rows x cols block:
    s, else scale_of(the block's amax)."""
    x = np.asarray(x, dtype=np.float32)
    b = _blocks(x, rows, cols)
    s = scale_of(np.abs(b).max(axis=(1, 3))) if s is None else np.asarray(s, dtype=np.float32)
    q = np.clip(b / s[:, None, :, None], -FP8_MAX, FP8_MAX)
    q = to_fp8(q).astype(np.float32).reshape(b.shape[0] * rows, b.shape[2] * cols)
    return q[:x.shape[0], :x.shape[1]], s


def quantize_rows(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Activations [M, K] -> (e4m3 values as float32 [M, K], scales [M, ceil(K/group)])."""
    return _quantize_blocks(x, 1, group)


def _weight_block(scheme: str, k: int) -> tuple[int, int]:
    check_scheme(scheme)
    return (1, k) if scheme == CHANNEL else (BLOCK, BLOCK)


def quantize_weight(w: np.ndarray, scheme: str, scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Weight [N, K] -> (e4m3 values as float32 [N, K], float32 scales of weight_scale_shape): at `scale` when
    given, else amax / 448 per row or block."""
    rows, cols = _weight_block(scheme, w.shape[1])
    blocks = None if scale is None else np.reshape(scale, (-1, groups(w.shape[1], cols)))
    q, s = _quantize_blocks(w, rows, cols, blocks)
    return q, (s[:, 0] if scheme == CHANNEL else s)


def mse_scale(w: np.ndarray, scheme: str) -> np.ndarray:
    """Per row or block the scale scale_of(alpha * amax), alpha on CLIP_GRID (1 included), of the least squared
    rounding error sum (w - dequantize(quantize(w)))^2 (values above alpha * amax saturate)."""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = _weight_block(scheme, w.shape[1])
    amax = np.abs(_blocks(w, rows, cols)).max(axis=(1, 3))
    best, best_err = None, None
    for alpha in CLIP_GRID:
        s = scale_of(np.float32(alpha) * amax)
        q, _ = _quantize_blocks(w, rows, cols, s)
        err = _blocks((q * expand_scale(s if scheme == BLOCK128 else s[:, 0], scheme, *w.shape) - w) ** 2, rows,
                      cols).sum(axis=(1, 3))
        take = np.ones_like(err, dtype=bool) if best is None else err < best_err
        best = s if best is None else np.where(take, s, best)
        best_err = err if best_err is None else np.where(take, err, best_err)
    return best[:, 0] if scheme == CHANNEL else best


def expand_scale(scale: np.ndarray, scheme: str, n: int, k: int) -> np.ndarray:
    """Weight scales -> [N, K], the scale of every element."""
    check_scheme(scheme)
    scale = np.asarray(scale, dtype=np.float32)
    if scheme == CHANNEL:
        return np.broadcast_to(scale.reshape(n, 1), (n, k))
    return np.repeat(np.repeat(scale, BLOCK, axis=0), BLOCK, axis=1)[:n, :k]


def dequantize(q: np.ndarray, scale: np.ndarray, scheme: str) -> np.ndarray:
    """W_real = float(W) * scale, float32."""
    n, k = q.shape
    return np.asarray(q, dtype=np.float32) * expand_scale(scale, scheme, n, k)

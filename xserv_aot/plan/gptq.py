"""Error-compensated rounding of one linear weight onto the e4m3 grid (GPTQ: optimal brain surgeon updates).

For W [N, K] with its scales fixed beforehand (fp8.quantize_weight's, one per element after fp8.expand_scale) and
the Hessian H = X^T X of calibration inputs X [T, K], columns are rounded one at a time (largest diag(H) first,
"act order"); the rounding error of column j, divided by U[j, j], is spread over the columns not yet rounded
along row j of U, the upper Cholesky factor of (H + damp * mean(diag H) * I)^-1 (so U^T U is that inverse). That
minimises ||X (W - Q * S)^T|| greedily, where round-to-nearest treats every column alone. float64 throughout;
blocks of BLOCK columns defer the update of the later columns to one matrix product.
"""
from __future__ import annotations

import numpy as np

from xserv_aot.dtypes import FP8_MAX, to_fp8

DAMP = 0.1          # added to diag(H): this fraction of its mean (keeps H invertible for dead or rare inputs; 0.1
                    # beat 0.01 on held-out texts, scripts/fp8_error_sources.py: docs/benchmarks/*-fp8-gptq-cpu.md)
BLOCK = 128         # columns rounded between two deferred updates of the rest


def round_column(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """e4m3(w / scale) as float32, saturated at +-FP8_MAX, in float32 as fp8.quantize_weight rounds."""
    return to_fp8(np.clip(w.astype(np.float32) / scale, -FP8_MAX, FP8_MAX)).astype(np.float32)


def inverse_factor(h: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """Upper U with U^T U = (H + damp * mean(diag H) * I)^-1 (a dead input, diag 0, gets diag 1 first): with J the
    order reversal and J H J = M M^T (Cholesky), U = J M^-1 J; one factorisation and one triangular inverse."""
    h = np.array(h, dtype=np.float64)
    d = np.diag(h).copy()
    d[d == 0] = 1.0
    h[np.diag_indices_from(h)] = d + damp * d.mean()
    return lower_inverse(np.linalg.cholesky(h[::-1, ::-1]))[::-1, ::-1].copy()


def lower_inverse(m: np.ndarray, leaf: int = 256) -> np.ndarray:
    """M^-1 of a lower-triangular M by halves: [[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]]."""
    k = len(m)
    if k <= leaf:
        return np.linalg.inv(m)
    half = k // 2
    a, c = lower_inverse(m[:half, :half], leaf), lower_inverse(m[half:, half:], leaf)
    out = np.zeros_like(m)
    out[:half, :half], out[half:, half:] = a, c
    out[half:, :half] = -(c @ (m[half:, :half] @ a))
    return out


def gptq_round(w: np.ndarray, scale: np.ndarray, h: np.ndarray, damp: float = DAMP, act_order: bool = True,
               block: int = BLOCK) -> np.ndarray:
    """w [N, K], scale [N, K] (float32, every element's), h [K, K] -> the e4m3 values Q [N, K] as float32."""
    n, k = w.shape
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    wt = np.array(np.asarray(w, dtype=np.float64).T[order])             # [K, N]: a column of W is a row here
    st = np.ascontiguousarray(np.asarray(scale, dtype=np.float32).T[order])
    u = inverse_factor(np.asarray(h)[np.ix_(order, order)], damp)
    qt = np.empty((k, n), dtype=np.float32)
    for lo in range(0, k, block):
        hi = min(k, lo + block)
        part, err = wt[lo:hi], np.empty((hi - lo, n))
        for j in range(hi - lo):
            qt[lo + j] = round_column(part[j], st[lo + j])
            err[j] = (part[j] - qt[lo + j] * st[lo + j].astype(np.float64)) / u[lo + j, lo + j]
            part[j + 1:] -= np.outer(u[lo + j, lo + j + 1:hi], err[j])
        wt[hi:] -= u[lo:hi, hi:].T @ err
    out = np.empty((n, k), dtype=np.float32)
    out[:, order] = qt.T
    return out

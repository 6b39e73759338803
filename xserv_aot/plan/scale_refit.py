"""Least-squares FP8 weight scales for fixed e4m3 values (build setting fp8_scale "refit", docs/plan-format.md "FP8").

For W [N, K], its e4m3 values Q (as floats) and the calibration Hessian H = X^T X, the scales S minimise the
output error on the calibration inputs, sum_n (w_n - q_n * s_n)^T H (w_n - q_n * s_n) (s_n: row n's scale of
every element):
- fp8_channel: one unknown per row, s_n = (q_n^T H w_n) / (q_n^T H q_n);
- fp8_block128: per block of 128 rows the G = ceil(K / 128) scales of its column blocks, the G x G normal
  equations A s = b with A[c, d] = sum_n q_nc^T H_cd q_nd and b[d] = sum_n w_n^T H_:d q_nd.
A scale the data does not determine (a row or block of zero values, a singular system) or that comes out <= 0
keeps the given one. One H product per row, N K^2 multiply-adds in float32 (sgemm: sums of K products, a relative
error ~1e-6 in a scale, against e4m3's 2^-4 steps); the dot products and the solve in float64.
"""
from __future__ import annotations

import numpy as np

from xserv_aot import fp8


def refit_scales(w: np.ndarray, q: np.ndarray, h: np.ndarray, scheme: str, scale: np.ndarray) -> np.ndarray:
    """w, q [N, K], h [K, K], scale (fp8.weight_scale_shape, the fallback) -> float32 scales of that shape."""
    fp8.check_scheme(scheme)
    w, q, h = (np.asarray(a, dtype=np.float32) for a in (w, q, h))
    scale = np.asarray(scale, dtype=np.float32)
    if scheme == fp8.CHANNEL:
        hq = (q @ h).astype(np.float64)                     # [N, K], H symmetric: row n is (H q_n)^T
        return _accept(np.einsum("nk,nk->n", hq, w.astype(np.float64)),
                       np.einsum("nk,nk->n", hq, q.astype(np.float64)), scale)
    n, k = w.shape
    groups = fp8.groups(k, fp8.BLOCK)
    out = scale.copy()
    for rb in range(fp8.groups(n, fp8.BLOCK)):
        rows = slice(rb * fp8.BLOCK, min(n, (rb + 1) * fp8.BLOCK))
        qr, wr = q[rows].astype(np.float64), w[rows].astype(np.float64)
        a, b = np.empty((groups, groups)), np.empty(groups)
        for d in range(groups):
            cols = slice(d * fp8.BLOCK, (d + 1) * fp8.BLOCK)
            hq = (q[rows, cols] @ h[cols]).astype(np.float64)  # row n: (H q_nd)^T, q_nd its values in block d
            a[:, d] = _block_sums((qr * hq).sum(axis=0), groups)
            b[d] = float((wr * hq).sum())
        out[rb] = _solve(a, b, scale[rb])
    return out


def _block_sums(v: np.ndarray, groups: int) -> np.ndarray:
    pad = np.zeros(groups * fp8.BLOCK)
    pad[:len(v)] = v
    return pad.reshape(groups, fp8.BLOCK).sum(axis=1)


def _accept(num: np.ndarray, den: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    ok = den > 0
    s = np.where(ok, num / np.where(ok, den, 1.0), 0.0)
    return _positive(s, fallback)


def _solve(a: np.ndarray, b: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """The scales of one row block: the columns blocks A determines (nonzero diagonal) solved together."""
    live = np.diag(a) > 0
    s = np.zeros(len(b))
    if live.any():
        sub = a[np.ix_(live, live)]
        try:
            s[live] = np.linalg.solve(sub, b[live])
        except np.linalg.LinAlgError:
            return fallback.copy()
        if not np.isfinite(s).all():
            return fallback.copy()
    return _positive(s, fallback)


def _positive(s: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    s32 = s.astype(np.float32)
    return np.where(np.isfinite(s32) & (s32 > 0), s32, fallback).astype(np.float32)

"""NumPy reference of every plan op (docs/plan-format.md). float32 math; each op small and obvious.

These are the oracle for the CUDA kernels: keep them literal, not fast.
"""
from __future__ import annotations

import numpy as np

from xserv_aot import fp8
from xserv_aot.dtypes import round_to
from xserv_aot.rng import uniform
from xserv_aot.runtime.batch import NONFINITE_ID


def resolve_input_ids(ids: np.ndarray, prev_rows: np.ndarray, sampled: np.ndarray) -> np.ndarray:
    """Overlapped steps: a token whose id is still on the device is taken from the previous step's sampled_ids."""
    prev_rows = np.asarray(prev_rows)
    return np.where(prev_rows >= 0, np.asarray(sampled)[np.maximum(prev_rows, 0)], ids).astype(np.int32)


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """ids clamped into [0, vocab) as the kernel does (a NONFINITE_ID fed forward by an overlapped step reads row 0)."""
    ids = np.clip(np.asarray(ids, dtype=np.int64), 0, table.shape[0] - 1)
    return table[ids].astype(np.float32, copy=False)        # [T, H]


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32, copy=False)
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (x * inv) * w.astype(np.float32, copy=False)


def add_rmsnorm(residual: np.ndarray, delta: np.ndarray, w: np.ndarray, eps: float):
    """Returns (new residual, normed). The caller rounds the residual to its dtype before the norm reads it."""
    res = residual.astype(np.float32, copy=False) + delta.astype(np.float32, copy=False)
    return res, rmsnorm(res, w, eps)


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    out = x.astype(np.float32, copy=False) @ w.astype(np.float32, copy=False).T                    # [T, K] @ [K, N]
    if b is not None:
        out = out + b.astype(np.float32, copy=False)
    return out


def quantize_fp8(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] -> (e4m3 values as float32 [M, K], float32 scales [M, ceil(K / group)])."""
    return fp8.quantize_rows(x, group)


def linear_w8a16(x: np.ndarray, w_real: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """bf16(x) @ W_real^T with W_real = fp8.dequantize(W, scale, quant) (float(W) * scale), fp32 accumulation."""
    return linear(round_to(x, "bfloat16"), w_real, b)


def linear_w8a8(xq: np.ndarray, x_scale: np.ndarray, w: np.ndarray, w_scale: np.ndarray, quant: str,
                b: np.ndarray | None = None) -> np.ndarray:
    """out[m, n] = sum_g x_scale[m, g] * w_scale[n or block, g] * sum_{k in g} xq[m, k] * W[n, k], fp32."""
    n, k = w.shape
    group = fp8.act_group(quant, k)
    out = np.zeros((xq.shape[0], n), dtype=np.float32)
    for g in range(fp8.groups(k, group)):
        cols = slice(g * group, min(k, (g + 1) * group))
        part = xq[:, cols].astype(np.float32, copy=False) @ w[:, cols].astype(np.float32, copy=False).T
        ws = w_scale if quant == fp8.CHANNEL else np.repeat(w_scale[:, g], fp8.BLOCK)[:n]
        out += x_scale[:, g:g + 1].astype(np.float32) * ws.astype(np.float32)[None, :] * part
    if b is not None:
        out = out + b.astype(np.float32, copy=False)
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, hd]; cos/sin [T, hd/2]. NeoX style: rotate the two halves."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def qk_norm_rope_cache(qkv, positions, slot_mapping, q_norm, k_norm, cos, sin, kv_layer, nh, nkv, hd, eps):
    """qkv [T, (nh + 2 nkv) hd]; kv_layer [2, num_slots, nkv, hd] written in place. Returns q [T, nh, hd]."""
    t = qkv.shape[0]
    qkv = qkv.astype(np.float32, copy=False)
    q = qkv[:, : nh * hd].reshape(t, nh, hd)
    k = qkv[:, nh * hd: (nh + nkv) * hd].reshape(t, nkv, hd)
    v = qkv[:, (nh + nkv) * hd:].reshape(t, nkv, hd)
    if q_norm is not None:
        q = rmsnorm(q, q_norm, eps)
        k = rmsnorm(k, k_norm, eps)
    pos = np.asarray(positions, dtype=np.int64)
    c, s = cos[pos].astype(np.float32, copy=False), sin[pos].astype(np.float32, copy=False)
    q, k = rope(q, c, s), rope(k, c, s)
    slots = np.asarray(slot_mapping, dtype=np.int64)
    write = slots >= 0
    kv_layer[0, slots[write]] = k[write]
    kv_layer[1, slots[write]] = v[write]
    return q


def attention(q, kv_layer, query_start_loc, seq_lens, block_tables, block_size, scale) -> np.ndarray:
    """q [T, nh, hd]; kv_layer [2, num_slots, nkv, hd]. Causal attention over each sequence's paged context."""
    t, nh, hd = q.shape
    nkv = kv_layer.shape[2]
    group = nh // nkv
    out = np.zeros((t, nh * hd), dtype=np.float32)
    for i, ctx in enumerate(np.asarray(seq_lens)):
        qs, qe = int(query_start_loc[i]), int(query_start_loc[i + 1])
        n, ctx = qe - qs, int(ctx)
        if n <= 0 or ctx <= 0:
            continue
        p = np.arange(ctx)
        slots = np.asarray(block_tables[i])[p // block_size] * block_size + p % block_size
        k = kv_layer[0, slots].astype(np.float32, copy=False).transpose(1, 2, 0)       # [nkv, hd, ctx]
        v = kv_layer[1, slots].astype(np.float32, copy=False).transpose(1, 0, 2)       # [nkv, ctx, hd]
        # query head h reads kv head h // group: stack each kv head's query heads as rows [nkv, group * n, hd]
        qi = q[qs:qe].astype(np.float32, copy=False).reshape(n, nkv, group, hd).transpose(1, 2, 0, 3)
        scores = (qi.reshape(nkv, group * n, hd) @ k).reshape(nkv, group, n, ctx)
        scores *= np.float32(scale)
        qpos = ctx - n + np.arange(n)
        scores[:, :, p[None, :] > qpos[:, None]] = -np.inf                             # causal
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        o = scores.reshape(nkv, group * n, ctx) @ v                                    # [nkv, group * n, hd]
        out[qs:qe] = o.reshape(nkv, group, n, hd).transpose(2, 0, 1, 3).reshape(n, nh * hd)
    return out


def silu_mul(x: np.ndarray) -> np.ndarray:
    inter = x.shape[-1] // 2
    g, u = x[:, :inter].astype(np.float32, copy=False), x[:, inter:].astype(np.float32, copy=False)
    return g / (1.0 + np.exp(-g)) * u


def gather_rows(x: np.ndarray, idx) -> np.ndarray:
    return x[np.asarray(idx, dtype=np.int64)]


def truncated_draw(p: np.ndarray, order: np.ndarray, top_p: float, min_p: float, seed: int, offset: int) -> int:
    """The seeded draw of the `sample` op from candidates `order` (most likely first) with normalized probabilities
    p (their dtype sets the precision): keep the smallest prefix whose mass reaches top_p (when < 1), then the ids
    with p >= min_p * p[0] (when > 0), and return the first whose cumulative mass exceeds u * total."""
    if top_p < 1.0:
        p = p[:min(len(p), int(np.searchsorted(np.cumsum(p), p.dtype.type(top_p), side="left")) + 1)]
    if min_p > 0:
        p = p[:max(1, int(np.count_nonzero(p >= min_p * p[0])))]
    cum = np.cumsum(p)
    j = int(np.searchsorted(cum, uniform(seed, offset) * cum[-1], side="right"))
    return int(order[min(j, len(p) - 1)])


def no_token(logits: np.ndarray) -> bool:
    """A row the sample op answers NONFINITE_ID for: a NaN or +Inf logit, or every logit -Inf (a -Inf alone is a
    token masked by apply_token_bitmask). kernels/sample.cu applies the same rule."""
    return bool(np.isnan(logits).any() or np.isposinf(logits).any() or not (logits > -np.inf).any())


def sample_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int, offset: int) -> int:
    logits = logits.astype(np.float32, copy=False)
    if no_token(logits):
        return NONFINITE_ID
    if temperature <= 0:
        return int(np.argmax(logits))
    order = np.argsort(-logits, kind="stable")                             # most likely first, ties: lower id
    z = logits[order] / np.float32(temperature)
    p = np.exp(z - z[0])
    p /= p.sum()
    keep = int(top_k) if 0 < top_k < len(p) else len(p)
    return truncated_draw(p[:keep] / p[:keep].sum(), order, top_p, 0.0, seed, offset)


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray, bitmask_rows) -> np.ndarray:
    """Rows with bitmask_rows[r] != 0: logits[r, i] = -inf unless bit i % 32 of bitmask[r, i // 32] is set."""
    out = np.array(logits, dtype=np.float32)
    v = out.shape[1]
    for r in np.flatnonzero(np.asarray(bitmask_rows)):
        bits = np.unpackbits(np.ascontiguousarray(bitmask[r], dtype="<i4").view(np.uint8), bitorder="little")[:v]
        out[r, bits == 0] = -np.inf
    return out


def sample(logits, temperature, top_k, top_p, seeds, offsets) -> np.ndarray:
    return np.array([sample_row(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]),
                                int(seeds[i]), int(offsets[i])) for i in range(logits.shape[0])], dtype=np.int32)


def all_reduce(parts: list[np.ndarray]) -> np.ndarray:
    """Sum of every rank's buffer, float32, added in rank order 0, 1, ... (the caller rounds to the dtype)."""
    total = parts[0].astype(np.float32, copy=True)
    for p in parts[1:]:
        total += p.astype(np.float32, copy=False)
    return total


def all_gather_columns(parts: list[np.ndarray]) -> np.ndarray:
    """[rows, n] per rank -> [rows, ranks * n]: rank r's columns at r*n .. (r+1)*n."""
    return np.concatenate(parts, axis=1)

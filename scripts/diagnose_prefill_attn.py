#!/usr/bin/env python3
"""Structured inputs that tell apart the ways a prefill attention kernel can go wrong (device machine):
  random  q, K, V random                      -> the whole kernel
  k_zero  K = 0: every visible key weighs the same, so out = running mean of V (the QK^T product drops out)
  v_onehot V[key] = e_key (keys < 128): out[row, d] = softmax probability of key d (the PV product is a copy)
  v_index V[key, d] = key / 64 for every d: out = the expected key index under the row's softmax
For each: relative error against NumPy float64, then per-row-class and per-dim-block error profiles of a failure
(row % 16, row // 16 % 4 within a 64-row tile; 8-dim blocks) and the first rows of got vs want.

  python3 scripts/diagnose_prefill_attn.py [--variants wg2h2s2,ws2h2s4o] [--seed 0]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xserv_aot.dtypes import round_to  # noqa: E402
from xserv_aot.plan import attention_plan  # noqa: E402
from xserv_aot.plan.op_records import Attention  # noqa: E402

BS, HD = 16, 128


def reference(q, kv, n, ctx, slots, scale, g):
    """float64 causal attention of one seq: q [n, nh, hd], keys at slots [ctx]; -> [n, nh, hd]."""
    k = kv[0, slots].astype(np.float64)                     # [ctx, nkv, hd]
    v = kv[1, slots].astype(np.float64)
    out = np.zeros(q.shape, np.float64)
    qpos = ctx - n + np.arange(n)
    for h in range(q.shape[1]):
        s = q[:, h].astype(np.float64) @ k[:, h // g].T * scale
        s[np.arange(ctx)[None, :] > qpos[:, None]] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // g]
    return out


def run(lib, variant, q, kv, n, ctx, table, nh, nkv):
    op = Attention(q="q", kv_cache="kv", layer=0, query_start_loc="qsl", seq_lens="lens", block_tables="bt",
                   out="o", rows=n, num_seqs=1, num_heads=nh, num_kv_heads=nkv, head_dim=HD, scale=HD ** -0.5)
    rec = attention_plan.prefill_attn_launch(op, {"num_heads": nh, "num_kv_heads": nkv, "head_dim": HD}, [], [],
                                             variant, 1)
    out = lib.empty((n, nh * HD), "bfloat16")
    dev = [lib.to_device(q, "bfloat16"), lib.to_device(kv, "bfloat16"), lib.to_device(np.array([0, n], np.int32)),
           lib.to_device(np.array([ctx], np.int32)), lib.to_device(table[None, :].astype(np.int32))]
    args = [("ptr", d) for d in dev] + [("ptr", out), ("i32", n), ("i32", 1), ("i32", nh), ("i32", nkv),
                                        ("i32", BS), ("i32", table.size), ("i32", kv.shape[1]), ("f32", HD ** -0.5),
                                        ("i32", 1)]
    lib.launch(rec.fn, rec.grid, rec.block, args, smem=rec.smem)
    return out.numpy().reshape(n, nh, HD)


def profile(got, want):
    err = np.abs(got - want)
    scale = np.abs(want).mean() + 1e-9
    rows = np.arange(got.shape[0])
    by_r16 = [float(err[rows % 16 == i].mean() / scale) for i in range(16)]
    by_w = [float(err[(rows // 16) % 4 == i].mean() / scale) for i in range(4)]
    by_d = [float(err[..., 8 * i:8 * i + 8].mean() / scale) for i in range(16)]
    bad_rows = np.nonzero(err.max(axis=(1, 2)) > 0.05 * np.abs(want).max())[0]
    print(f"      err by row % 16: {np.round(by_r16, 3).tolist()}")
    print(f"      err by warp (row // 16 % 4): {np.round(by_w, 3).tolist()}")
    print(f"      err by 8-dim block: {np.round(by_d, 3).tolist()}")
    print(f"      bad rows: {len(bad_rows)} of {got.shape[0]}, first {bad_rows[:12].tolist()}")
    for r in range(min(3, got.shape[0])):
        print(f"      row {r} head 0 got  {np.round(got[r, 0, :8], 3).tolist()}")
        print(f"      row {r} head 0 want {np.round(want[r, 0, :8], 3).tolist()}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(attention_plan.PREFILL_ATTN_WGMMA))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from xserv_aot.runtime.cuda.kernel_lib import KernelLib
    lib = KernelLib()
    nh, nkv = 8, 2                                       # 4 q heads a KV head: every variant fits
    for n, ctx in ((64, 64), (128, 128), (100, 300)):
        rng = np.random.default_rng(args.seed)
        nb = -(-ctx // BS)
        table = rng.permutation(nb + 4)[:nb]
        slots = (table[:, None] * BS + np.arange(BS)).reshape(-1)[:ctx]
        base_q = round_to(rng.standard_normal((n, nh, HD)).astype(np.float32), "bfloat16")
        base_kv = round_to(rng.standard_normal((2, (nb + 4) * BS, nkv, HD)).astype(np.float32), "bfloat16")
        cases = {"random": base_kv.copy(), "k_zero": base_kv.copy(), "v_onehot": base_kv.copy(),
                 "v_index": base_kv.copy()}
        cases["k_zero"][0] = 0
        cases["v_onehot"][1] = 0
        for key in range(min(ctx, HD)):
            cases["v_onehot"][1, slots[key], :, key] = 1
        cases["v_index"][1, slots] = (np.arange(ctx) / 64)[:, None, None]
        wants = {name: reference(base_q, kv, n, ctx, slots, HD ** -0.5, nh // nkv) for name, kv in cases.items()}
        for variant in args.variants.split(","):
            print(f"{variant} n {n} ctx {ctx} (nh {nh}, nkv {nkv}, seed {args.seed})")
            for name, kv in cases.items():
                want = wants[name]
                try:
                    got = run(lib, variant, base_q, kv, n, ctx, table, nh, nkv)
                except Exception as e:                      # noqa: BLE001  (a fault ends the context: stop)
                    print(f"   {name}: launch failed: {e}")
                    return
                rel = float(np.linalg.norm(np.nan_to_num(got, nan=1e3) - want) / np.linalg.norm(want))
                print(f"   {name:9} rel err {rel:.2e}  nan {int(np.isnan(got).sum())}")
                if rel > 1e-2:
                    profile(np.nan_to_num(got, nan=1e3), want)


if __name__ == "__main__":
    main()

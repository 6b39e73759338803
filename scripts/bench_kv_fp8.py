"""`bench_kernels.py kv-fp8`: batched decode attention over a bf16 vs an FP8 (e4m3, per-layer scales) KV cache,
Qwen3-8B heads: the tensor-core kernels attn_decode_tc_s{2,3}, attn_decode_tc_f8kv_s{TC_F8KV_STAGES} and its
heads-on-n twin attn_decode_tc_f8kvn_b{blocks}_s{stages} (TC_F8KVN_VARIANTS; * = the plan's choice) with the
plan's splits, for every batch of --batches >= 3 (smaller ones run the fused few-seq kernel: the step benchmark
covers them). Each output is checked against torch float32 attention over the cache as the kernel reads it (the
FP8 one dequantized: float(e4m3) x scale); times are graph-replay medians over cache copies that together exceed
L2; GB/s counts the KV bytes read (K and V of every context token, 2 or 1 bytes an element).
"""
from __future__ import annotations

import torch

from bench_kernels import L2_BYTES, Kernels, rel_err, stream, time_graph
from xserv_aot.plan import attention_plan as ap
from xserv_aot.plan.op_records import Attention
from xserv_aot.runtime.cuda.driver import Launch

NH, NKV, HD, BS, EPS = 32, 8, 128, 16, 1e-6
K_SCALE, V_SCALE = 0.03, 0.02


def bench_kv_fp8(args) -> None:
    torch.zeros(1, device="cuda")
    kern = Kernels("attention_decode_tc.cu")
    gen = torch.Generator(device="cuda").manual_seed(777)
    print(f"{'batch':>5} {'ctx':>5} {'kernel':34} {'us':>9} {'GB/s':>7} {'err':>8}")
    for B in [int(b) for b in args.batches.split(",")]:
        if B < ap.BATCHED_ATTN_MIN_SEQS:
            continue
        for ctx in [int(c) for c in args.contexts.split(",")]:
            nb = -(-ctx // BS)
            max_blocks = nb + 1
            num_slots = (B * nb + 3) * BS
            raw = torch.randn(2, num_slots, NKV, HD, device="cuda", generator=gen) * 2
            c16 = raw.bfloat16()
            scale = torch.tensor([K_SCALE, V_SCALE], device="cuda").view(2, 1, 1, 1)
            c8 = (c16.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            bt = torch.randperm(B * nb + 3, device="cuda", generator=gen)[:B * nb].int().view(B, nb)
            bt = torch.cat([bt, torch.zeros(B, 1, dtype=torch.int32, device="cuda")], 1).contiguous()
            lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
            qsl = torch.arange(B + 1, dtype=torch.int32, device="cuda")
            q = torch.randn(B, NH, HD, device="cuda", generator=gen).bfloat16()
            out = torch.empty(B, NH * HD, device="cuda", dtype=torch.bfloat16)
            counters = torch.zeros(B * NKV, dtype=torch.int32, device="cuda")
            for fp8 in (False, True):
                cache, elem = (c8, 1) if fp8 else (c16, 2)
                kv_bytes = B * ctx * NKV * HD * 2 * elem
                ncopy = max(1, -(-3 * L2_BYTES // kv_bytes))
                copies = [cache.clone() for _ in range(ncopy)]
                dq = (cache.float() * scale) if fp8 else cache.float()
                ref = reference(q, dq, bt, ctx)
                extra = [("f32", K_SCALE), ("f32", V_SCALE)] if fp8 else []
                splits = max(1, min(-(-ctx // ap.BATCHED_ATTN_TILE), -(-ap.BATCHED_ATTN_BLOCKS // (B * NKV))))
                part_o = torch.empty(B * NH * splits * HD, device="cuda")
                part_ml = torch.empty(B * NH * splits * 2, device="cuda")
                chosen = ap.batched_attn_launch(Attention(q="q", kv_cache="kv", layer=0, query_start_loc="qsl",
                                                          seq_lens="l", block_tables="bt", out="o", rows=B,
                                                          num_seqs=B, num_heads=NH, num_kv_heads=NKV, head_dim=HD,
                                                          scale=HD ** -0.5),
                                                {"num_heads": NH, "num_kv_heads": NKV, "head_dim": HD}, ctx, [], [],
                                                (K_SCALE, V_SCALE) if fp8 else None).fn
                variants = [("_f8kv", st) for st in ap.TC_F8KV_STAGES] + [(f"_f8kvn_b{b}", st)
                                                                      for b, st in ap.TC_F8KVN_VARIANTS] \
                    if fp8 else [("", 2), ("", 3)]
                for sfx, stages in variants:
                    name = f"attn_decode_tc{sfx}_s{stages}_hd{HD}"
                    smem = ap.tc_ring_smem(stages, HD, fp8)
                    fn = kern.fn("attention_decode_tc.cu", name, smem)

                    def launch(kvc, fn=fn, smem=smem, name=name):
                        return Launch(name, fn, (B, NKV, splits), (128, 1, 1), smem,
                                      [("ptr", q.data_ptr()), ("ptr", kvc.data_ptr()), ("ptr", qsl.data_ptr()),
                                       ("ptr", lens.data_ptr()), ("ptr", bt.data_ptr()), ("ptr", part_o.data_ptr()),
                                       ("ptr", part_ml.data_ptr()), ("ptr", counters.data_ptr()),
                                       ("ptr", out.data_ptr()), ("i32", B), ("i32", NH), ("i32", NKV), ("i32", BS),
                                       ("i32", max_blocks), ("i32", num_slots), ("f32", HD ** -0.5)] + extra,
                                      pdl=False)
                    out.fill_(float("nan"))
                    launch(cache)(stream())
                    torch.cuda.synchronize()
                    err = rel_err(out, ref)
                    lts = [launch(c) for c in copies]
                    ms = time_graph(lambda j: lts[j](stream()), ncopy)
                    mark = "*" if name == chosen else ""
                    print(f"{B:5} {ctx:5} {name + mark:34} {ms * 1e3:9.1f} {kv_bytes / ms / 1e6:7.0f} {err:8.1e}",
                          flush=True)
                del copies
            torch.cuda.empty_cache()


def reference(q, kv, bt, ctx):
    """torch float32 attention of each row's query over its ctx keys (float32 cache [2, slots, nkv, hd])."""
    B, g = q.shape[0], NH // NKV
    res = torch.empty(B, NH, HD, device="cuda")
    for i in range(B):
        slots = (bt[i].long()[:, None] * BS + torch.arange(BS, device="cuda")).flatten()[:ctx]
        k = kv[0, slots].repeat_interleave(g, dim=1)
        v = kv[1, slots].repeat_interleave(g, dim=1)
        s = torch.einsum("hd,lhd->hl", q[i].float(), k) * HD ** -0.5
        res[i] = torch.einsum("hl,lhd->hd", s.softmax(-1), v)
    return res.view(B, NH * HD)

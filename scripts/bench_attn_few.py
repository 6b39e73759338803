"""`bench_kernels.py attn-few`: decode attention of buckets with 1-2 sequences (Qwen3-8B heads), the old pair of
launches (qk_norm_rope_cache + the split-KV attn_decode_hd128) against the fused kernel (attn_decode_fused_*:
QK-norm, RoPE, KV write and attention in one launch) over variants: s stages, mt min tiles a split, o solo tiles
(one split up to that many), z grid z; the plan's variant is marked *.
Each variant's output is checked against the old pair's (rel. err); times are graph-replay medians over KV
copies that together exceed L2; GB/s counts the KV read (K and V of every context token) against the 4.6 TB/s read
ceiling. "pdl": launched with programmatic dependent launch (the graph's previous kernel is the same kernel, so
this shows how much of a launch its pre-wait prologue hides, an upper bound for the plan's other neighbours).
Then the step's real neighbour: the plan's qkv GEMV (weights rotated over 3 copies, writing the qkv row the
attention reads) alone and followed by the old pair / the fused kernel, PDL off and on; "attention after the
GEMV" = pair - GEMV alone.
"""
from __future__ import annotations

import torch

from bench_kernels import L2_BYTES, Kernels, rel_err, stream, time_graph
from xserv_aot.plan import attention_plan as ap
from xserv_aot.plan.kernel_build import plan_linear
from xserv_aot.plan.kernel_constants import P_KEYS
from xserv_aot.plan.op_records import Linear
from xserv_aot.runtime.cuda.driver import Launch

READ_TBS = 4.6
STAGES = (2, 3, 4, 6)
NH, NKV, HD, BS, MAX_SEQ_LEN, EPS = 32, 8, 128, 16, 8192, 1e-6
QKV_N, QKV_K = (NH + 2 * NKV) * HD, 4096


def ptrs(*ts):
    return [("ptr", t.data_ptr() if t is not None else 0) for t in ts]


def bench_attn_few(args) -> None:
    torch.zeros(1, device="cuda")
    kern = Kernels("rope_cache.cu", "attention_decode.cu", "attention_decode_tc.cu", "gemv.cu")
    rope_fn = kern.fn("rope_cache.cu", f"qk_norm_rope_cache_hd{HD}")
    old_fn = kern.fn("attention_decode.cu", f"attn_decode_hd{HD}")
    fused = {st: kern.fn("attention_decode_tc.cu", f"attn_decode_fused_s{st}_hd{HD}", ap.few_seq_smem(st, HD, 1024))
             for st in STAGES}
    gen = torch.Generator(device="cuda").manual_seed(4321)
    print(f"{'batch':>5} {'ctx':>5} {'variant':28} {'us':>8} {'GB/s':>7} {'%4.6TB/s':>8} {'err':>8}")
    max_blocks, s_old = MAX_SEQ_LEN // BS, MAX_SEQ_LEN // P_KEYS
    ang = torch.arange(MAX_SEQ_LEN, device="cuda")[:, None].double() / \
        10000.0 ** (torch.arange(0, HD, 2, device="cuda").double() / HD)[None, :]
    cos, sin = ang.cos().float().contiguous(), ang.sin().float().contiguous()
    wq = [torch.randn(QKV_N, QKV_K, device="cuda", generator=gen).mul_(QKV_K ** -0.5).bfloat16() for _ in range(3)]
    for B in [int(b) for b in args.batches.split(",")]:
        ns_plan = ap.few_seq_splits(B, NKV, MAX_SEQ_LEN)
        gemv = plan_linear(Linear(inp="h", weight="w", bias=None, out="qkv", rows=B, n=QKV_N, k=QKV_K), "bfloat16",
                           None, None, True).launch[0]          # the plan's qkv GEMV for B rows
        gemv_fn = kern.fn("gemv.cu", gemv.fn)
        for ctx in [int(c) for c in args.contexts.split(",")]:
            nb = -(-ctx // BS)
            num_slots = (B * nb + 3) * BS
            kv_bytes = B * ctx * NKV * HD * 2 * 2
            ncopy = min(128, max(1, -(-3 * L2_BYTES // kv_bytes)))
            kvs = [torch.randn(2, num_slots, NKV, HD, device="cuda", generator=gen).bfloat16() for _ in range(ncopy)]
            bt = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
            bt[:, :nb] = torch.randperm(B * nb + 3, device="cuda", generator=gen)[:B * nb].int().view(B, nb)
            lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
            pos = lens - 1
            slots = (bt[:, (ctx - 1) // BS] * BS + (ctx - 1) % BS).int().contiguous()
            qsl = torch.arange(B + 1, dtype=torch.int32, device="cuda")
            qkv = torch.randn(B, (NH + 2 * NKV) * HD, device="cuda", generator=gen).bfloat16()
            qn, kn = [(1 + 0.2 * torch.randn(HD, device="cuda", generator=gen)).bfloat16() for _ in range(2)]
            q = torch.empty(B, NH, HD, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(B, NH * HD, device="cuda", dtype=torch.bfloat16)
            s_cap = max(s_old, 2 * ns_plan)
            part_o = torch.empty(B * NH * s_cap * HD, device="cuda")
            part_ml = torch.empty(B * NH * s_cap * 2, device="cuda")
            counters = torch.zeros(B * NKV, dtype=torch.int32, device="cuda")
            geo = [("i32", BS), ("i32", max_blocks), ("i32", num_slots)]
            h = torch.randn(B, QKV_K, device="cuda", generator=gen).bfloat16()

            def gemv_launch(j, pdl):
                return Launch("qkv", gemv_fn, gemv.grid, gemv.block, 0,
                              ptrs(h, wq[j % len(wq)], None, qkv) + [("i32", B), ("i32", QKV_N), ("i32", QKV_K)],
                              pdl=pdl)

            def old_pair(kv, attn_only=False):
                rope = Launch("rope", rope_fn, (B, -(-(NH + 2 * NKV) // 4), 1), (128, 1, 1), 0,
                              ptrs(qkv, pos, slots, qn, kn, cos, sin, q, kv) + [("i32", NH), ("i32", NKV),
                                                                                ("f32", EPS), ("i32", num_slots)])
                attn = Launch("old", old_fn, (B, NKV, s_old), (128, 1, 1), 0,
                              ptrs(q, kv, qsl, lens, bt, part_o, part_ml, counters, out)
                              + [("i32", B), ("i32", NH), ("i32", NKV), *geo, ("f32", HD ** -0.5), ("i32", s_old)])
                return [attn] if attn_only else [rope, attn]

            def fused_launch(kv, st, min_tiles, solo, ns, pdl=False):
                smem = ap.few_seq_smem(st, HD, ap.few_seq_block_ids(MAX_SEQ_LEN, ns, min_tiles, solo, BS))
                return [Launch("fused", fused[st], (B, NKV, ns), (128, 1, 1), smem,
                               ptrs(qkv, pos, slots, qn, kn, cos, sin, q, kv, qsl, lens, bt, part_o, part_ml, counters,
                                    out) + [("i32", B), ("i32", NH), ("i32", NKV), *geo, ("f32", EPS),
                                            ("f32", HD ** -0.5), ("i32", min_tiles), ("i32", solo)], pdl=pdl)]

            variants = [("old rope+attn", lambda kv: old_pair(kv)), ("old attn only", lambda kv: old_pair(kv, True))]
            for st in STAGES:
                for mt in (1, 2, 4):
                    configs = {(st - 1, ns_plan, False), (0, ns_plan, False), (st - 1, ns_plan, True)}
                    if ctx >= 2048:
                        configs.add((st - 1, 2 * ns_plan, False))
                    for solo, ns, pdl in sorted(configs):
                        plan_like = (st, mt, solo, ns) == (ap.FEW_ATTN_STAGES, ap.FEW_ATTN_MIN_TILES,
                                                           ap.FEW_ATTN_STAGES - 1, ns_plan)
                        variants.append((f"fused s{st} mt{mt} o{solo} z{ns}{' pdl' if pdl else ''}"
                                         f"{'*' if plan_like and not pdl else ''}",
                                         lambda kv, a=(st, mt, solo, ns, pdl): fused_launch(kv, *a)))
            want = None
            for vname, mk in variants:
                kv0 = kvs[0].clone()
                out.fill_(float("nan"))
                for ln in mk(kv0):
                    ln(stream())
                torch.cuda.synchronize()
                got = out.float().clone()
                want = got if want is None else want
                err = rel_err(got, want) if vname != "old attn only" else float("nan")   # its KV lacks the new k
                lts = [mk(kv) for kv in kvs]
                ms = time_graph(lambda j: [ln(stream()) for ln in lts[j]], ncopy)
                gbs = kv_bytes / ms / 1e6
                print(f"{B:5} {ctx:5} {vname:28} {ms * 1e3:8.2f} {gbs:7.0f} {gbs / READ_TBS / 10:7.1f}% {err:8.1e}",
                      flush=True)

            def with_gemv(pdl, attn):                  # the qkv GEMV (writing qkv) then the attention launches
                return lambda j: [gemv_launch(j, pdl)] + (attn(kvs[j]) if attn else [])

            pairs = [("qkv gemv alone", with_gemv(False, None)), ("qkv gemv alone pdl", with_gemv(True, None)),
                     ("gemv + old pair", with_gemv(False, old_pair))]
            for st, mt, pdl in ((ap.FEW_ATTN_STAGES, ap.FEW_ATTN_MIN_TILES, False),
                                (ap.FEW_ATTN_STAGES, ap.FEW_ATTN_MIN_TILES, True), (3, 1, True), (6, 1, True)):
                pairs.append((f"gemv + fused s{st} mt{mt} o{st - 1}{' pdl' if pdl else ''}",
                               with_gemv(pdl, lambda kv, a=(st, mt, st - 1, ns_plan, pdl): fused_launch(kv, *a))))
            alone = {}
            for vname, mk in pairs:
                lts = [mk(j) for j in range(ncopy)]
                ms = time_graph(lambda j: [ln(stream()) for ln in lts[j]], ncopy)
                pdl = vname.endswith("pdl")
                if vname.startswith("qkv gemv alone"):
                    alone[pdl] = ms
                    extra = ""
                else:
                    extra = f"  attention after the GEMV: {(ms - alone[pdl]) * 1e3:.2f} us"
                print(f"{B:5} {ctx:5} {vname:28} {ms * 1e3:8.2f}{extra}", flush=True)
            del kvs
            torch.cuda.empty_cache()

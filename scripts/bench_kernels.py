#!/usr/bin/env python3
"""Kernel variants for batched decode on one GPU, checked and timed side by side (device machine, torch there).

  python3 scripts/bench_kernels.py gemm --lib PATH/libxserv_gemm.so [--rows 16,32,64,128,256]
  python3 scripts/bench_kernels.py attn [--batches 16,64,256 --contexts 256,1024,4096]
  python3 scripts/bench_kernels.py prefill [--prompts 2048,4096,8192,4x1024 --variants v1,w8s2]
  python3 scripts/bench_kernels.py fp8 [--lib PATH/libxserv_gemm.so] [--rows 1,2,16,64]   (scripts/bench_fp8.py)
  python3 scripts/bench_kernels.py fp8-batched [--lib PATH/libxserv_gemm.so] [--rows 16,32,64,128,256]
      [--both-schemes]   (old vs new FP8 decode linears, scripts/bench_fp8.py)
  python3 scripts/bench_kernels.py fp8-wgmma [--lib PATH/libxserv_gemm.so] [--rows 64,128,256] [--both-schemes]
      (the W8A8 wgmma GEMMs, cp.async and TMA, vs CUTLASS W8A8 and the bf16 plan's kernels,
      scripts/bench_fp8_wgmma.py; --variants all: the cp.async kernel's cluster / mb / n256 sweep too)
  python3 scripts/bench_kernels.py fp8-configs --lib PATH/libxserv_gemm.so [--rows 64,128,256,2048]
      (every W8A8 CUTLASS config on every linear, scripts/bench_fp8_configs.py)
  python3 scripts/bench_kernels.py attn-few --batches 1,2 --contexts 128,512,4096
  python3 scripts/bench_kernels.py prefill-gemm --lib PATH/libxserv_gemm.so [--rows 2048,4096,8192]
  python3 scripts/bench_kernels.py prefill-elementwise [--rows 2048,4096,8192] [--variants rows_r,u3]
  python3 scripts/bench_kernels.py kv-fp8 --batches 16,64,256 --contexts 1024,4096   (scripts/bench_kv_fp8.py)

gemm: every decode linear shape of Qwen3-8B (qkv, o, gate_up, down, lm_head) x rows: the CUTLASS swap-AB
stream-K / split-K configs, the NVRTC skinny kernel (rows <= 64) and the CUTLASS tile configs (rows >= 128);
each output poisoned with NaN, checked against torch float32 (rel. err), then timed in a CUDA graph of launches
rotating over weight copies that together exceed L2 (median of replays). GB/s counts weights + activations.
attn: the split-KV decode kernel (attention_decode.cu) vs the batched flash-decoding kernel
(attention_decode_batched.cu) over a shuffled paged KV, checked against torch, timed the same way.
attn-few: decode buckets of 1-2 seqs, the old rope + split-KV pair vs the fused kernel (scripts/bench_attn_few.py).
prefill-gemm: every bf16 CUTLASS tile config on every prefill linear x M, and the gemm_configs table the
measurements suggest (scripts/bench_prefill_gemm.py). prefill-elementwise: add_rmsnorm / rmsnorm / silu_mul /
qk_norm_rope_cache at prefill rows against the copy rate (scripts/bench_prefill_elementwise.py). kv-fp8: batched
decode attention over a bf16 vs an FP8 KV cache (scripts/bench_kv_fp8.py).
Reference and timing use torch only as memory and as the oracle; kernels come from the project's build.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xserv_aot.plan import nvrtc_build  # noqa: E402
from xserv_aot.plan.cutlass_build import library_config_names, library_workspace_size  # noqa: E402
from xserv_aot.runtime.cuda.driver import Launch, _cu, allow_dynamic_smem, check  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
L2_BYTES = 60 << 20


class Kernels:
    def __init__(self, *sources: str):
        self.funcs = {}
        cu = _cu()
        for src in sources:
            cubin = nvrtc_build.compile_source(src, "sm_90a").cubin
            mod = check(cu.cuModuleLoadData(cubin), "cuModuleLoadData")
            self.funcs[src] = mod

    def fn(self, src: str, name: str, smem: int = 0):
        cu = _cu()
        f = check(cu.cuModuleGetFunction(self.funcs[src], name.encode()), name)
        allow_dynamic_smem(f, smem, name)
        return f


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def time_graph(body, copies: int, reps: int = 20) -> float:
    """Median ms of one call of body(j) over a graph of `copies` x 4 calls rotating j (warm-up first)."""
    for j in range(copies):
        body(j)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            for _ in range(4):
                for j in range(copies):
                    body(j)
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / (4 * copies))
    return sorted(out)[len(out) // 2]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm())


# ---- GEMM ------------------------------------------------------------------------------------------------
class Gemm:
    def __init__(self, lib: Path):
        so = ctypes.CDLL(str(lib))
        so.xserv_gemm_bf16_ex.restype = ctypes.c_int
        so.xserv_gemm_bf16_ex.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4 + \
            [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.lib, self.so = lib, so
        self.names = library_config_names(lib)
        self.ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def ws_size(self, cfg, M, N, K, splits) -> int:
        return library_workspace_size(self.lib, cfg, M, N, K, splits)

    def __call__(self, cfg, x, w, y, M, N, K, splits):
        st = self.so.xserv_gemm_bf16_ex(cfg, x.data_ptr(), w.data_ptr(), y.data_ptr(), None, M, N, K, splits,
                                        self.ws.data_ptr(), self.ws.numel(), stream())
        if st:
            raise RuntimeError(f"gemm {self.names[cfg]} M={M} N={N} K={K} splits={splits}: status {st}")


def bench_gemm(args) -> None:
    from xserv_aot.plan.kernel_build import plan_skinny
    from xserv_aot.plan.op_records import Linear
    gemm = Gemm(Path(args.lib))
    kern = Kernels("gemm_skinny.cu")
    idx = {n: i for i, n in enumerate(gemm.names)}
    print(f"configs: {gemm.names}")
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"{'shape':8} {'rows':>4} {'variant':42} {'ms':>8} {'GB/s':>7} {'TFLOP/s':>8} {'err':>8}")
    for name, (N, K) in SHAPES.items():
        f32 = name == "lm_head"
        wbytes = N * K * 2
        copies = max(2, -(-3 * L2_BYTES // wbytes))
        ws = [torch.randn(N, K, device="cuda").mul_(K ** -0.5).bfloat16() for _ in range(copies)]
        for M in rows_list:
            x = torch.randn(M, K, device="cuda").bfloat16()
            ref = x.float() @ ws[0].float().t()
            y = torch.empty(M, N, device="cuda", dtype=torch.float32 if f32 else torch.bfloat16)
            variants = []
            tag = "f32out" if f32 else "bf16"
            swaps = sorted((int(c.split("_")[3].split("x")[1]), ci) for c, ci in idx.items()
                           if "swap" in c and c.startswith(f"sm90_{tag}_"))
            fits = [(tn, ci) for tn, ci in swaps if tn >= M][:2]
            for tn, ci in fits:
                for sp in (0, 1, 2, 3, 4):
                    variants.append((f"{gemm.names[ci]} s{sp}",
                                     lambda j, ci=ci, sp=sp: gemm(ci, x, ws[j], y, M, N, K, sp)))
            if M >= 128:
                for cname in (("sm90_f32out_128x128x64_c2x1_coop",) if f32 else
                              ("sm90_bf16_128x128x64_c2x1_coop", "sm90_bf16_128x256x64_c2x1_coop")):
                    ci = idx[cname]
                    variants.append((cname, lambda j, ci=ci: gemm(ci, x, ws[j], y, M, N, K, 0)))
            if M <= 64:
                rec = plan_skinny(Linear(inp="x", weight="w", bias=None, out="y", rows=M, n=N, k=K),
                                  "f32" if f32 else "bf16", None).launch[0]      # the plan's kernel and geometry
                fn = kern.fn("gemm_skinny.cu", rec.fn, rec.smem)
                launches = [Launch(rec.fn, fn, rec.grid, rec.block, rec.smem,
                                   [("ptr", x.data_ptr()), ("ptr", w.data_ptr()), ("ptr", 0), ("ptr", y.data_ptr()),
                                    ("i32", M), ("i32", N), ("i32", K)], pdl=False) for w in ws]
                variants.append((rec.fn, lambda j, ls=launches: ls[j](stream())))
            for vname, body in variants:
                try:
                    y.fill_(float("nan"))
                    body(0)
                    torch.cuda.synchronize()
                    err = rel_err(y, ref)
                    ms = time_graph(body, copies)
                except RuntimeError as e:
                    print(f"{name:8} {M:4} {vname:42} failed: {e}")
                    continue
                gbs = (wbytes + M * K * 2 + M * N * y.element_size()) / ms / 1e6
                tf = 2 * M * N * K / ms / 1e9
                print(f"{name:8} {M:4} {vname:42} {ms:8.4f} {gbs:7.0f} {tf:8.1f} {err:8.1e}", flush=True)
        del ws
        torch.cuda.empty_cache()


# ---- attention --------------------------------------------------------------------------------------------
def bench_attn(args) -> None:
    nh, nkv, hd, bs = 32, 8, 128, 16
    G = nh // nkv
    torch.zeros(1, device="cuda")                      # torch makes the primary context current
    kern = Kernels("attention_decode.cu", "attention_decode_batched.cu", "attention_decode_tc.cu")
    old_fn = kern.fn("attention_decode.cu", f"attn_decode_hd{hd}")
    tiled = {}                                          # name -> (function, dynamic smem, tile)
    for name, tile, stages in (("attn_decode_b_t64s2_hd128_g4", 64, 2), ("attn_decode_b_t32s2_hd128_g4", 32, 2)):
        smem = stages * 2 * tile * hd * 2
        tiled[name] = (kern.fn("attention_decode_batched.cu", name, smem), smem, tile)
    for stages in (2, 3, 4):
        name, smem = f"attn_decode_tc_s{stages}_hd128", stages * 2 * 64 * (hd + 8) * 2
        tiled[name] = (kern.fn("attention_decode_tc.cu", name, smem), smem, 64)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    print(f"{'batch':>5} {'ctx':>5} {'variant':18} {'ms':>8} {'GB/s':>7} {'err':>8}")  # * = plan's splits
    for B in [int(b) for b in args.batches.split(",")]:
        for ctx in [int(c) for c in args.contexts.split(",")]:
            max_blocks = -(-ctx // bs)
            num_blocks = B * max_blocks + 7
            num_slots = num_blocks * bs
            kv_bytes = B * ctx * nkv * hd * 2 * 2
            ncopy = max(1, -(-3 * L2_BYTES // kv_bytes))
            kvs = [torch.randn(2, num_slots, nkv, hd, device="cuda", generator=gen).bfloat16() for _ in range(ncopy)]
            kv = kvs[0]
            perm = torch.randperm(num_blocks, device="cuda", generator=gen)[:B * max_blocks].int()
            block_tables = perm.view(B, max_blocks).contiguous()
            lens_check = torch.randint(max(1, ctx // 2), ctx + 1, (B,), device="cuda", generator=gen).int()
            lens_check[0] = ctx
            lens_time = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(B, nh, hd, device="cuda", generator=gen).bfloat16()
            qsl = torch.arange(B + 1, dtype=torch.int32, device="cuda")
            scale = hd ** -0.5
            S_old = -(-8192 // 128)
            S_cap = max(S_old, 2 * -(-ctx // 32))                      # every split count tried below
            part_o = torch.empty(B * nh * S_cap * hd, device="cuda")
            part_ml = torch.empty(B * nh * S_cap * 2, device="cuda")
            counters = torch.zeros(B * nkv, dtype=torch.int32, device="cuda")
            out = torch.empty(B, nh * hd, device="cuda", dtype=torch.bfloat16)

            def ref_attn(lens):
                res = torch.empty(B, nh, hd, device="cuda")
                for i in range(B):
                    L = int(lens[i])
                    slots = (block_tables[i].long()[:, None] * bs + torch.arange(bs, device="cuda")).flatten()[:L]
                    k = kv[0, slots].float().repeat_interleave(G, dim=1)        # [L, nh, hd]
                    v = kv[1, slots].float().repeat_interleave(G, dim=1)
                    s = torch.einsum("hd,lhd->hl", q[i].float(), k) * scale
                    res[i] = torch.einsum("hl,lhd->hd", s.softmax(-1), v)
                return res.view(B, nh * hd)

            def launch(fn, grid, smem, lens, extra, kvc=None):
                return Launch("attn", fn, grid, (128, 1, 1), smem,
                              [("ptr", q.data_ptr()), ("ptr", (kv if kvc is None else kvc).data_ptr()), ("ptr", qsl.data_ptr()),
                               ("ptr", lens.data_ptr()), ("ptr", block_tables.data_ptr()), ("ptr", part_o.data_ptr()),
                               ("ptr", part_ml.data_ptr()), ("ptr", counters.data_ptr()), ("ptr", out.data_ptr()),
                               ("i32", B), ("i32", nh), ("i32", nkv), ("i32", bs), ("i32", max_blocks),
                               ("i32", num_slots), ("f32", scale)] + extra, pdl=False)

            variants = [("old", lambda lens, kvc=None: launch(old_fn, (B, nkv, S_old), 0, lens, [("i32", S_old)], kvc))]
            splits_auto = max(1, min(-(-ctx // 64), -(-(132 * 4) // (B * nkv))))
            for name, (fn, smem, tile) in tiled.items():
                short = name.replace("attn_decode_", "").replace("_hd128_g4", "").replace("_hd128", "")
                for sp in sorted({1, 2, 4, 8, splits_auto, 2 * splits_auto}):
                    if sp <= -(-ctx // tile):
                        variants.append((f"{short} s{sp}" + ("*" if sp == splits_auto else ""),
                                         lambda lens, kvc=None, sp=sp, fn=fn, smem=smem:
                                         launch(fn, (B, nkv, sp), smem, lens, [], kvc)))
            ref = ref_attn(lens_check)
            for vname, mk in variants:
                ln = mk(lens_check)
                out.fill_(float("nan"))
                ln(stream())
                torch.cuda.synchronize()
                err = rel_err(out, ref)
                lts = [mk(lens_time, kvc) for kvc in kvs]
                ms = time_graph(lambda j: lts[j](stream()), ncopy)
                print(f"{B:5} {ctx:5} {vname:18} {ms:8.4f} {kv_bytes / ms / 1e6:7.0f} {err:8.1e}", flush=True)
            del kv, kvs
            torch.cuda.empty_cache()


def bench_prefill(args) -> None:
    """The flash prefill kernels (attention_plan.PREFILL_ATTN_VARIANTS, launched with the plan's geometry) on
    causal prompts over a shuffled paged KV: `--prompts 2048,4096,8192,4x1024,640@256` (N x L @ S: N seqs of L new
    tokens in a bucket of S seq slots, the rest empty, as the plan's buckets have 256; S defaults to N). Each output
    poisoned, checked against torch float32 (per seq and q head); ms is one layer; causal TFLOP/s counts
    4 x sum over queries of the keys each attends x head_dim x num_heads (QK^T and PV), against 790; fill TB/s:
    the K/V bytes the kernel's blocks copy from L2 into shared memory (attention_plan.prefill_tiles) per second.
    `f8kv:VARIANT` (attention_plan.PREFILL_ATTN_F8KV): the kernel over an FP8 cache; every case's KV is then e4m3
    values x 2^-4, exact in bf16, so one reference checks both caches."""
    from xserv_aot.plan import attention_plan
    from xserv_aot.plan.op_records import Attention
    nh, nkv, hd, bs = 32, 8, 128, 16
    G, scale = nh // nkv, hd ** -0.5
    torch.zeros(1, device="cuda")
    variants = args.variants.split(",") if args.variants else list(attention_plan.PREFILL_ATTN_VARIANTS)
    f8_scale = 2.0 ** -4
    kern = Kernels(*sorted({attention_plan.prefill_attn_source(v.removeprefix("f8kv:")) for v in variants}))
    gen = torch.Generator(device="cuda").manual_seed(1234)
    cases = []
    for c in args.prompts.split(","):                            # [N x] L [@ S]
        spec, _, slots = c.partition("@")
        N, L = spec.split("x") if "x" in spec else ("1", spec)
        cases.append(([int(L)] * int(N), int(slots) if slots else int(N)))
    print(f"prefill attention, Qwen3-8B shape (nh {nh}, nkv {nkv}, hd {hd}), block_size {bs}; ms per layer; "
          f"TFLOP/s = 4 * sum(keys attended) * hd * nh / t, vs 790 dense bf16; "
          "plan defaults: " + ", ".join(f"buckets >= {least} rows {t[hd][0]}"
                                        for least, t in attention_plan.PREFILL_ATTN_TIERS))
    print(f"{'prompts':>10} {'S':>4} {'variant':18} {'ms':>8} {'TFLOP/s':>8} {'%790':>5} {'err':>8} {'fill TB/s':>9}")
    for lens_list, S in cases:
        T = sum(lens_list)
        blocks = [-(-L // bs) for L in lens_list]
        max_blocks = max(blocks)
        num_blocks = sum(blocks) + 3
        kv = torch.randn(2, num_blocks * bs, nkv, hd, device="cuda", generator=gen).bfloat16()
        if any(v.startswith("f8kv:") for v in variants):
            kv8 = (kv.float() / f8_scale).to(torch.float8_e4m3fn)
            kv = (kv8.float() * f8_scale).bfloat16()
        q = torch.randn(T, nh, hd, device="cuda", generator=gen).bfloat16()
        perm = torch.randperm(num_blocks, device="cuda", generator=gen).int()
        bt = torch.zeros(S, max_blocks, dtype=torch.int32, device="cuda")
        qsl = torch.full((S + 1,), T, dtype=torch.int32, device="cuda")
        lens = torch.zeros(S, dtype=torch.int32, device="cuda")
        used = 0
        for i, L in enumerate(lens_list):
            bt[i, :blocks[i]] = perm[used:used + blocks[i]]
            used += blocks[i]
            qsl[i] = sum(lens_list[:i])
            lens[i] = L
        out = torch.empty(T, nh * hd, device="cuda", dtype=torch.bfloat16)
        ref = torch.empty(T, nh, hd, device="cuda")
        for i, L in enumerate(lens_list):
            q0 = sum(lens_list[:i])
            slots = (bt[i].long()[:, None] * bs + torch.arange(bs, device="cuda")).flatten()[:L]
            mask = torch.ones(L, L, device="cuda", dtype=torch.bool).tril()
            for h in range(nh):
                k, v = kv[0, slots, h // G].float(), kv[1, slots, h // G].float()
                sc = (q[q0:q0 + L, h].float() @ k.t() * scale).masked_fill(~mask, float("-inf"))
                ref[q0:q0 + L, h] = sc.softmax(-1) @ v
        ref = ref.view(T, nh * hd)
        flops = 4 * sum(L * (L + 1) // 2 for L in lens_list) * hd * nh

        def fill_bytes(var):
            """K/V bytes the variant's blocks copy into shared memory (each block: the tiles up to its last row)."""
            rows, heads, keys = attention_plan.prefill_tiles(var)
            tiles = sum(-(-min((t + 1) * rows, L) // keys) for L in lens_list for t in range(-(-L // rows)))
            return tiles * keys * hd * 2 * 2 * nh // heads
        op = Attention(q="q", kv_cache="kv_cache", layer=0, query_start_loc="qsl", seq_lens="lens",
                       block_tables="bt", out="attn", rows=T, num_seqs=S, num_heads=nh, num_kv_heads=nkv,
                       head_dim=hd, scale=scale)
        m = {"num_heads": nh, "num_kv_heads": nkv, "head_dim": hd}
        ptrs = [("ptr", q.data_ptr()), ("ptr", kv.data_ptr()), ("ptr", qsl.data_ptr()), ("ptr", lens.data_ptr()),
                ("ptr", bt.data_ptr())]
        tail = [("i32", bs), ("i32", max_blocks), ("i32", kv.shape[1]), ("f32", scale)]
        name = f"{len(lens_list)}x{lens_list[0]}"
        for var in variants:
            base, f8 = var.removeprefix("f8kv:"), var.startswith("f8kv:")
            rec = attention_plan.prefill_attn_launch(op, m, [], [], base, scales=(f8_scale, f8_scale) if f8 else None)
            fn = kern.fn(attention_plan.prefill_attn_source(base), rec.fn, rec.smem)
            kv_ptr = [("ptr", kv8.data_ptr())] if f8 else [ptrs[1]]
            lp = Launch(rec.fn, fn, rec.grid, rec.block, rec.smem,
                        ptrs[:1] + kv_ptr + ptrs[2:] + [("ptr", out.data_ptr()), ("i32", T), ("i32", S), ("i32", nh),
                                                        ("i32", nkv), *tail, ("i32", 2)]
                        + ([("f32", f8_scale)] * 2 if f8 else []), pdl=False)
            out.fill_(float("nan"))
            lp(stream())
            torch.cuda.synchronize()
            err = rel_err(out, ref)
            ms = time_graph(lambda j: lp(stream()), 1)
            tf = flops / ms / 1e9
            print(f"{name:>10} {S:4} {var:18} {ms:8.4f} {tf:8.1f} {100 * tf / 790:5.1f} {err:8.1e} "
                  f"{fill_bytes(base) / (1 + f8) / ms / 1e9:7.2f}", flush=True)
        del kv, q, out, ref
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["gemm", "attn", "attn-few", "prefill", "fp8", "fp8-batched", "fp8-wgmma",
                                     "fp8-configs", "prefill-gemm", "prefill-elementwise", "kv-fp8"])
    ap.add_argument("--lib")
    ap.add_argument("--rows", default=None, help="gemm: 16,32,64,128,256; fp8: 1,2,16,64; "
                    "prefill-gemm, prefill-elementwise: 2048,4096,8192")
    ap.add_argument("--both-schemes", action="store_true", help="fp8-batched: fp8_channel too (default block128)")
    ap.add_argument("--batches", default="1,16,64,128,256")
    ap.add_argument("--contexts", default="256,1024,4096,8192")
    ap.add_argument("--prompts", default="2048,4096,8192,4x1024,640@256,4096@256",
                    help="prefill: [N x] L [@ S]: N seqs of L tokens in S seq slots")
    ap.add_argument("--variants", default=None, help="prefill: comma list of attention_plan.PREFILL_ATTN_VARIANTS; "
                    "prefill-elementwise: label substrings of the variants to time (and the plan's); fp8-wgmma: "
                    "all (also sweep the cp.async kernel's variants)")
    args = ap.parse_args()
    args.rows = args.rows or {"fp8": "1,2,16,64", "fp8-wgmma": "64,128,256", "fp8-configs": "64,128,256,2048",
                               "prefill-gemm": "2048,4096,8192",
                               "prefill-elementwise": "2048,4096,8192"}.get(args.what, "16,32,64,128,256")
    torch.cuda.init()
    if args.what == "prefill-gemm":
        from bench_prefill_gemm import bench_prefill_gemm
        return bench_prefill_gemm(args, Gemm(Path(args.lib)), time_graph, rel_err, L2_BYTES)
    if args.what == "prefill-elementwise":
        from bench_prefill_elementwise import bench_prefill_elementwise
        return bench_prefill_elementwise(args, Kernels, time_graph, stream)
    if args.what == "attn-few":
        from bench_attn_few import bench_attn_few
        return bench_attn_few(args)
    if args.what == "kv-fp8":
        from bench_kv_fp8 import bench_kv_fp8
        return bench_kv_fp8(args)
    if args.what == "fp8-configs":
        from bench_fp8_configs import bench_fp8_configs
        return bench_fp8_configs(args, time_graph, stream, rel_err, L2_BYTES)
    {"gemm": bench_gemm, "attn": bench_attn, "prefill": bench_prefill, "fp8": bench_fp8,
     "fp8-batched": bench_fp8_batched, "fp8-wgmma": bench_fp8_wgmma}[args.what](args)


def bench_fp8(args) -> None:
    from scripts.bench_fp8 import bench_fp8 as run
    run(args, Kernels, time_graph, stream, rel_err, L2_BYTES)


def bench_fp8_batched(args) -> None:
    from scripts.bench_fp8 import bench_fp8_batched as run
    run(args, Kernels, time_graph, stream, rel_err, L2_BYTES)


def bench_fp8_wgmma(args) -> None:
    from scripts.bench_fp8_wgmma import bench_fp8_wgmma as run
    run(args, Kernels, time_graph, stream, rel_err, L2_BYTES)


if __name__ == "__main__":
    main()

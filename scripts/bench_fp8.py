"""`scripts/bench_kernels.py fp8`: the FP8 linears of Qwen3-8B on one GPU, checked and timed (device machine).

W8A16 (rows <= 64): the kernel and geometry the plan picks (plan/fp8_build.py), per scheme, plus the GEMV's R/U
sweep variants at rows 1 and the fused gate_up + silu_mul GEMV; GB/s counts weights + scales + activations and is
compared with 4.6 TB/s (H200 HBM3e). W8A8 (--lib, rows 256 / 2048): quantize_fp8 + the CUTLASS FP8 GEMM, TFLOP/s
against 1580 (the dense FP8 ceiling used here: 1979 spec at boost clock x 0.8, what dense FP8 GEMMs reach on H100/H200
at sustained clocks). Weights rotate over copies that together exceed L2 (timing of HBM streaming, not of L2).
"""
from __future__ import annotations

import ctypes
from dataclasses import replace
from pathlib import Path

import torch

from xserv_aot import fp8
from xserv_aot.plan.cutlass_build import fp8_config, library_fp8_config_names, library_fp8_workspace_size
from xserv_aot.plan.kernel_build import GEMV_MAX_ROWS
from xserv_aot.plan.fp8_build import SCHEME_TAG, plan_fp8_linear, plan_quantize
from xserv_aot.plan.kernel_constants import GT_MAX_ROWS
from xserv_aot.plan.op_records import Linear, QuantizeFp8
from xserv_aot.runtime.cuda.driver import Launch

HBM_GBS = 4600.0
FP8_TFLOPS = 1580.0
FP8_SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
              "lm_head": (151936, 4096)}
SWEEP = [(1, 4), (1, 8), (2, 2), (2, 8), (4, 2), (4, 4)]     # gemv_fp8_{ch,blk}_r{R}u{U}_m1_bf16 (kernels/gemv_fp8.cu)
BT_SWEEP = [("bt_m1_bf16", 2), ("bt_r1u4_m1_bf16", 1)]       # the integer-conversion variants (rows per warp)


def weights(N: int, K: int, scheme: str, copies: int):
    """[(e4m3 weight, float32 scale, dequantized float32 reference of copy 0)] on the GPU."""
    out = []
    for j in range(copies):
        w = (torch.randn(N, K, device="cuda") * 16).clamp_(-448, 448).to(torch.float8_e4m3fn)
        shape = fp8.weight_scale_shape(scheme, N, K)
        s = torch.rand(*shape, device="cuda") * 1e-3 + 1e-4
        out.append((w, s))
    w0, s0 = out[0]
    full = s0[:, None] if scheme == fp8.CHANNEL else s0.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return out, w0.float() * full


class Fp8Gemm:
    def __init__(self, lib: Path):
        so = ctypes.CDLL(str(lib))
        so.xserv_gemm_fp8_ex.restype = ctypes.c_int
        so.xserv_gemm_fp8_ex.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 4 + \
            [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        so.xserv_gemm_fp8_config_out_bytes.restype = ctypes.c_int
        self.lib, self.so = lib, so
        self.names = library_fp8_config_names(lib)
        self.out_bytes = [so.xserv_gemm_fp8_config_out_bytes(i) for i in range(len(self.names))]
        self.ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")

    def ws_size(self, cfg: int, M: int, N: int, K: int, splits: int = 0) -> int:
        return library_fp8_workspace_size(self.lib, cfg, M, N, K, splits)

    def __call__(self, cfg, splits, xq, xs, w, s, y, M, N, K, stream):
        """xserv_gemm_fp8_ex (the plans' entry points): the splits of stream-K configs, a 64 MB workspace."""
        st = self.so.xserv_gemm_fp8_ex(cfg, xq.data_ptr(), xs.data_ptr(), w.data_ptr(), s.data_ptr(), y.data_ptr(),
                                       None, M, N, K, splits, self.ws.data_ptr(), self.ws.numel(), stream)
        if st:
            raise RuntimeError(f"{self.names[cfg]} splits {splits} M={M} N={N} K={K}: status {st}")


def launches(kern, rec, arg_sets):
    src = ("gemm_skinny_w8a8.cu" if rec.fn.startswith("skinny_w8a8") else "gemm_w8a8_wgmma.cu"
           if rec.fn.startswith("w8a8_wgmma") else "gemm_w8a8_tma.cu" if rec.fn.startswith("w8a8_tma")
           else "gemm_skinny_fp8.cu" if rec.fn.startswith("skinny") else "gemv_tc.cu"
           if rec.fn.startswith("gemv_fp8_tc") else "gemv_fp8.cu")
    fn = kern.fn(src, rec.fn, rec.smem)
    return [Launch(rec.fn, fn, rec.grid, rec.block, rec.smem, a, pdl=rec.pdl) for a in arg_sets]


def bench_fp8(args, Kernels, time_graph, stream, rel_err, l2_bytes) -> None:
    torch.zeros(1, device="cuda")                  # the primary context, current before the modules load
    kern = Kernels("gemv_fp8.cu", "gemm_skinny_fp8.cu", "gemv_tc.cu")
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    print(f"{'scheme':12} {'shape':8} {'rows':>4} {'kernel':28} {'grid':>5} {'ms':>8} {'GB/s':>7} {'%4.6T':>6} "
          f"{'err':>8}")
    step, step_skinny, step_tc = {}, {}, {}
    for scheme in (fp8.CHANNEL, fp8.BLOCK128):
        for name, (N, K) in FP8_SHAPES.items():
            f32 = name == "lm_head"
            copies = max(2, -(-3 * l2_bytes // (N * K)))
            ws, wref = weights(N, K, scheme, copies)
            for M in rows_list:
                x = torch.randn(M, K, device="cuda").bfloat16()
                y = torch.empty(M, N, device="cuda", dtype=torch.float32 if f32 else torch.bfloat16)
                silu = torch.empty(M, N // 2, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ wref.t()
                op = Linear(inp="x", weight="w", bias=None, out="y", rows=M, n=N, k=K, weight_scale="w.scale",
                            quant=scheme)
                recs = [(plan_fp8_linear(op, "float32" if f32 else "bfloat16", None, None).launch[0], y, ref)]
                if name == "gate_up" and M <= 2:
                    g, u = ref[:, :N // 2].bfloat16().float(), ref[:, N // 2:].bfloat16().float()
                    gref = torch.nn.functional.silu(g) * u
                    grec = plan_fp8_linear(op, "bfloat16", "silu", None).launch[0]
                    recs.append((grec, silu, gref))
                    if M == 1:
                        recs.append((type(grec)(f"gemv_fp8_{SCHEME_TAG[scheme]}_bt_gate_m1", grec.args, grec.grid,
                                                grec.block, 0), silu, gref))
                if M <= GT_MAX_ROWS:                # build setting gemv "tc" (kernels/gemv_tc.cu)
                    recs.append((plan_fp8_linear(op, "float32" if f32 else "bfloat16", None, None,
                                                 gemv="tc").launch[0], y, ref))
                    if name == "gate_up":
                        tc = plan_fp8_linear(op, "bfloat16", "silu", None, gemv="tc").launch[0]
                        gref = (torch.nn.functional.silu(ref[:, :N // 2].bfloat16().float())
                                * ref[:, N // 2:].bfloat16().float())
                        recs.append((tc, silu, gref))                        # persistent: the resident blocks
                        recs.append((replace(tc, grid=(N // 16, 1, 1)), silu, gref))   # a block a tile
                if M <= GEMV_MAX_ROWS:                   # the tensor-core skinny kernel at GEMV rows (m8 tile)
                    recs.append((plan_fp8_linear(replace(op, rows=8), "float32" if f32 else "bfloat16", None,
                                                 None).launch[0], y, ref))
                if M == 1 and not f32:
                    base = recs[0][0]
                    variants = [(f"r{r}u{u}_m1_bf16", r) for r, u in SWEEP] + BT_SWEEP
                    for v, r in variants:
                        recs.append((type(base)(f"gemv_fp8_{SCHEME_TAG[scheme]}_{v}", base.args,
                                                (-(-N // (8 * r)), 1, 1), base.block, 0), y, ref))
                for rec, out, want in recs:
                    gate = "_gate_" in rec.fn or rec.fn.endswith("_gate")
                    arg_sets = [[("ptr", x.data_ptr()), ("ptr", w.data_ptr()), ("ptr", s.data_ptr())] +
                                ([("ptr", out.data_ptr()), ("i32", M), ("i32", N // 2), ("i32", K)] if gate else
                                 [("ptr", 0), ("ptr", out.data_ptr()), ("i32", M), ("i32", N), ("i32", K)])
                                for w, s in ws]
                    if rec.fn.startswith("gemv_fp8_tc"):
                        arg_sets = [a + [rec.args[-1]] for a in arg_sets]          # its stages
                    ls = launches(kern, rec, arg_sets)
                    out.fill_(float("nan"))
                    ls[0](stream())
                    torch.cuda.synchronize()
                    err = rel_err(out, want)
                    ms = time_graph(lambda j: ls[j](stream()), copies)
                    nbytes = N * K + ws[0][1].numel() * 4 + M * K * 2 + out.numel() * out.element_size()
                    gbs = nbytes / ms / 1e6
                    print(f"{scheme:12} {name:8} {M:4} {rec.fn:28} {rec.grid[0]:5} {ms:8.4f} {gbs:7.0f} {gbs / HBM_GBS:6.0%} "
                          f"{err:8.1e}", flush=True)
                    if rec.fn.startswith("gemv_fp8_tc"):
                        if gate or name != "gate_up":
                            step_tc[(scheme, name, M)] = ms
                    elif rec.fn.startswith("skinny") and M <= GEMV_MAX_ROWS:
                        step_skinny[(scheme, name, M)] = ms
                    elif "_r" not in rec.fn.split("_m")[0] and "_bt" not in rec.fn and (gate or name != "gate_up" or M > 2):
                        step[(scheme, name, M)] = ms
            del ws
            torch.cuda.empty_cache()
    for scheme in (fp8.CHANNEL, fp8.BLOCK128):
        for M in rows_list:
            if all((scheme, n, M) in step for n in ("qkv", "o_proj", "gate_up", "down")):
                t = 36 * sum(step[(scheme, n, M)] for n in ("qkv", "o_proj", "gate_up", "down"))
                print(f"Qwen3-8B FP8 linears ({scheme}, rows {M}, 36 layers, lm_head not counted): {t:.3f} ms/step")
            if all((scheme, n, M) in step_tc for n in ("qkv", "o_proj", "gate_up", "down")):
                t = 36 * sum(step_tc[(scheme, n, M)] for n in ("qkv", "o_proj", "gate_up", "down"))
                print(f"  the same with gemv tc at rows {M} (gate_up + silu fused): {t:.3f} ms/step")
            if all((scheme, n, M) in step_skinny for n in ("qkv", "o_proj", "gate_up", "down")):
                t = 36 * sum(step_skinny[(scheme, n, M)] for n in ("qkv", "o_proj", "gate_up", "down"))
                print(f"  the same with the skinny kernel at rows {M} (gate_up unfused, silu_mul not counted): "
                      f"{t:.3f} ms/step")
    if args.lib:
        bench_w8a8(args, kern, time_graph, stream, rel_err)


def bench_w8a8(args, kern, time_graph, stream, rel_err) -> None:
    so = Fp8Gemm(Path(args.lib))
    print(f"{'scheme':12} {'shape':8} {'rows':>5} {'part':22} {'ms':>8} {'TFLOP/s':>8} {'%1580':>6} {'err':>8}")
    for scheme in (fp8.CHANNEL, fp8.BLOCK128):
        for name, (N, K) in FP8_SHAPES.items():
            if name == "lm_head":
                continue
            ws, wref = weights(N, K, scheme, 1)
            (w, s), = ws
            for M in (256, 2048):
                group = fp8.act_group(scheme, K)
                x = torch.randn(M, K, device="cuda").bfloat16()
                xq = torch.empty(M, K, device="cuda", dtype=torch.uint8)
                xs = torch.empty(M, fp8.groups(K, group), device="cuda", dtype=torch.float32)
                y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                qrec = plan_quantize(QuantizeFp8(rows=M, inp="x", out="xq", scale="xs", k=K, group=group)).launch[0]
                (ql,) = launches(kern, qrec, [[("ptr", x.data_ptr()), ("ptr", xq.data_ptr()), ("ptr", xs.data_ptr()),
                                               ("i32", M), ("i32", K), ("i32", group)]])
                cfg, splits = fp8_config(scheme, "bfloat16", M, N, K)   # the config plans take

                def gemm(j):
                    so(cfg, splits, xq, xs, w, s, y, M, N, K, stream())
                y.fill_(float("nan"))
                ql(stream())
                gemm(0)
                torch.cuda.synchronize()
                err = rel_err(y, x.float() @ wref.t())
                for part, body in (("quantize_fp8", lambda j: ql(stream())), ("gemm", gemm),
                                   ("quantize + gemm", lambda j: (ql(stream()), gemm(j)))):
                    ms = time_graph(body, 1)
                    tf = 2 * M * N * K / ms / 1e9
                    print(f"{scheme:12} {name:8} {M:5} {part:22} {ms:8.4f} {tf:8.1f} {tf / FP8_TFLOPS:6.0%} "
                          f"{err:8.1e}", flush=True)


BATCHED_SHAPES = ("qkv", "o_proj", "gate_up", "down")
CLUSTER_SWEEP_ROWS = (16, 64, 128)     # rows at which the GEMM alone is timed at every cluster size


def bench_fp8_batched(args, Kernels, time_graph, stream, rel_err, l2_bytes) -> None:
    """`bench_kernels.py fp8-batched`: old vs new FP8 decode linears on the Qwen3-8B layer shapes, per row count:
    old = what fp8_w8a16_max_rows 64 plans run (W8A16 skinny up to 64 rows, quantize_fp8 + CUTLASS W8A8 above);
    new = the W8A8 routing (quantize_fp8 + the W8A8 skinny kernel up to W8A8_SKINNY_MAX_ROWS, CUTLASS above, --lib);
    skinny = quantize_fp8 + the W8A8 skinny kernel at any rows (above 128 in 128-row slices), then at
    CLUSTER_SWEEP_ROWS the GEMM alone at every built cluster size; blkq = the block128 kernel quantizing its bf16
    input itself; -r1 = 128-row blocks at 33-64 rows. ms per call (graph replay, weights rotated over copies beyond
    L2), GB/s of weight bytes; the last lines sum 36 layers per row count."""
    from xserv_aot.plan.fp8_build import (W8A8_SKINNY_CLUSTERS, W8A8_SKINNY_FALLBACK_ROWS, W8A8_SKINNY_MAX_ROWS,
                                          plan_w8a8_skinny)
    torch.zeros(1, device="cuda")
    kern = Kernels("gemv_fp8.cu", "gemm_skinny_fp8.cu", "gemm_skinny_w8a8.cu")
    so = Fp8Gemm(Path(args.lib)) if args.lib else None
    rows_list = [int(r) for r in args.rows.split(",")]
    schemes = [fp8.BLOCK128] + ([fp8.CHANNEL] if args.both_schemes else [])
    torch.manual_seed(0)
    print(f"{'scheme':12} {'shape':8} {'rows':>4} {'variant':40} {'ms':>8} {'W GB/s':>7} {'%4.6T':>6} {'err':>8}")
    total = {}
    for scheme in schemes:
        for name in BATCHED_SHAPES:
            N, K = FP8_SHAPES[name]
            copies = max(2, -(-3 * l2_bytes // (N * K)))
            ws, wref = weights(N, K, scheme, copies)
            group = fp8.act_group(scheme, K)
            for M in rows_list:
                x = torch.randn(M, K, device="cuda").bfloat16()
                ref = x.float() @ wref.t()
                y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                xq = torch.empty(M, K, device="cuda", dtype=torch.uint8)
                xs = torch.empty(M, fp8.groups(K, group), device="cuda", dtype=torch.float32)
                qrec = plan_quantize(QuantizeFp8(rows=M, inp="x", out="xq", scale="xs", k=K, group=group)).launch[0]
                (ql,) = launches(kern, qrec, [[("ptr", x.data_ptr()), ("ptr", xq.data_ptr()), ("ptr", xs.data_ptr()),
                                               ("i32", M), ("i32", K), ("i32", group)]])
                bodies = []                                        # (variant, kinds, body(j))
                op8 = Linear(inp="xq", inp_scale="xs", weight="w", bias=None, out="y", rows=M, n=N, k=K,
                             weight_scale="w.scale", quant=scheme)
                if M <= W8A8_SKINNY_FALLBACK_ROWS:
                    op = Linear(inp="x", weight="w", bias=None, out="y", rows=M, n=N, k=K, weight_scale="w.scale",
                                quant=scheme)
                    rec = plan_fp8_linear(op, "bfloat16", None, None).launch[0]
                    ls = launches(kern, rec, [[("ptr", x.data_ptr()), ("ptr", w.data_ptr()), ("ptr", s.data_ptr()),
                                               ("ptr", 0), ("ptr", y.data_ptr()), ("i32", M), ("i32", N), ("i32", K)]
                                              for w, s in ws])
                    bodies.append((f"W8A16 {rec.fn}", ("old",), lambda j, ls=ls: ls[j](stream())))
                if so is not None and M > W8A8_SKINNY_MAX_ROWS:
                    cfg, splits = fp8_config(scheme, "bfloat16", M, N, K)   # the config plans take

                    def gemm(j, cfg=cfg, splits=splits, ws=ws):
                        w, s = ws[j]
                        so(cfg, splits, xq, xs, w, s, y, M, N, K, stream())
                    kinds = ("old", "new") if M > W8A8_SKINNY_FALLBACK_ROWS else ("new",)
                    bodies.append(("quantize + CUTLASS W8A8", kinds, lambda j, g=gemm: (ql(stream()), g(j))))
                    bodies.append(("  gemm alone CUTLASS W8A8", (), gemm))
                planned = plan_w8a8_skinny(op8, "bfloat16").launch[0]
                for c in (None,) + (W8A8_SKINNY_CLUSTERS if M in CLUSTER_SWEEP_ROWS else ()):
                    rec = plan_w8a8_skinny(op8, "bfloat16", c).launch[0]
                    if c is not None and rec.fn == planned.fn:
                        continue
                    ls = launches(kern, rec, [[("ptr", xq.data_ptr()), ("ptr", xs.data_ptr()), ("ptr", w.data_ptr()),
                                               ("ptr", s.data_ptr()), ("ptr", 0), ("ptr", y.data_ptr()),
                                               ("i32", M), ("i32", N), ("i32", K)] for w, s in ws])
                    if c is None:
                        kinds = ("new", "skinny") if M <= W8A8_SKINNY_MAX_ROWS else ("skinny",)
                        bodies.append((f"quantize + {rec.fn}", kinds,
                                       lambda j, ls=ls: (ql(stream()), ls[j](stream()))))
                    bodies.append((f"  gemm alone {rec.fn}", (), lambda j, ls=ls: ls[j](stream())))
                half = plan_w8a8_skinny(op8, "bfloat16", half=True).launch[0]
                if half.fn != planned.fn:                  # 33-64 rows: the 128-row blocks (r1) too
                    ls = launches(kern, half, [[("ptr", xq.data_ptr()), ("ptr", xs.data_ptr()),
                                                ("ptr", w.data_ptr()), ("ptr", s.data_ptr()), ("ptr", 0),
                                                ("ptr", y.data_ptr()), ("i32", M), ("i32", N), ("i32", K)]
                                               for w, s in ws])
                    bodies.append((f"quantize + {half.fn}", ("skinny-r1",),
                                   lambda j, ls=ls: (ql(stream()), ls[j](stream()))))
                for h in (False, True) if scheme == fp8.BLOCK128 and M <= W8A8_SKINNY_FALLBACK_ROWS else ():
                    rec = plan_w8a8_skinny(op8, "bfloat16", quantized_from="x", half=h).launch[0]
                    if h and rec.fn.replace("r1", "") == rec.fn:
                        continue
                    ls = launches(kern, rec, [[("ptr", x.data_ptr()), ("ptr", w.data_ptr()), ("ptr", s.data_ptr()),
                                               ("ptr", 0), ("ptr", y.data_ptr()), ("i32", M), ("i32", N),
                                               ("i32", K)] for w, s in ws])
                    bodies.append((f"{rec.fn} (quantize in it)", ("blkq-r1" if h else "blkq",),
                                   lambda j, ls=ls: ls[j](stream())))
                for variant, kinds, body in bodies:
                    y.fill_(float("nan"))
                    body(0)
                    torch.cuda.synchronize()
                    err = rel_err(y, ref)
                    ms = time_graph(body, copies)
                    gbs = N * K / ms / 1e6
                    print(f"{scheme:12} {name:8} {M:4} {variant:40} {ms:8.4f} {gbs:7.0f} {gbs / HBM_GBS:6.0%} "
                          f"{err:8.1e}", flush=True)
                    for k in kinds:
                        total[(scheme, M, k)] = total.get((scheme, M, k), 0.0) + 36 * ms
            del ws
            torch.cuda.empty_cache()
    for scheme in schemes:
        for M in rows_list:
            old = total.get((scheme, M, "old"))
            news = [(k, total[(scheme, M, k)]) for k in ("new", "skinny", "blkq", "skinny-r1", "blkq-r1")
                    if (scheme, M, k) in total]
            if old is not None and news:
                print(f"Qwen3-8B FP8 layer linears ({scheme}, rows {M}, 36 layers, quantize included): old "
                      f"{old:.3f} ms/step; " + ", ".join(f"{k} {t:.3f} ({old / t:.2f}x)" for k, t in news))


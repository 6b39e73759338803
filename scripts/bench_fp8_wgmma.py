"""`scripts/bench_kernels.py fp8-wgmma`: the W8A8 wgmma GEMMs (kernels/gemm_w8a8_wgmma.cu: cp.async tiles;
kernels/gemm_w8a8_tma.cu: TMA tiles) on the Qwen3-8B layer shapes at 64 / 128 / 256 rows (device machine), against
the CUTLASS W8A8 GEMM (what those rows run without fp8_w8a8_wgmma / fp8_w8a8_tma) and the bf16 kernels a bf16
decode plan picks for those rows (plan_linear, --lib). Each output poisoned with NaN and checked against torch
float32 on the unquantized activations (err), then timed in a CUDA graph rotating over weight copies beyond L2;
TB/s = weight bytes (e4m3: 1 B, bf16: 2 B a weight) / time. First pass, per shape and row count: quantize_fp8
alone, then each GEMM alone (the cp.async and the TMA kernel as planned, CUTLASS W8A8, the bf16 plan's), and lines
summing 36 layers per row count (GEMMs alone; + quantize where the plan launches it: 1 of 4 linears a layer with
fp8_quantize_in_producer, o_proj); second pass: the TMA kernel at every other built cluster size (--variants all:
the cp.async kernel's too, its `mb` ring and above 128 rows its n256 tile), and the sums again with the best
variant per shape.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from scripts.bench_fp8 import BATCHED_SHAPES, FP8_SHAPES, Fp8Gemm, launches, weights
from xserv_aot import fp8
from xserv_aot.plan.cutlass_build import fp8_config, library_config_names
from xserv_aot.plan.fp8_build import (W8A8_TMA_CLUSTERS, W8A8_TMA_CLUSTERS_R256, W8A8_TMA_SHAPES,
                                      W8A8_WGMMA_CLUSTERS, W8A8_WGMMA_MBAR, W8A8_WGMMA_TILES, W8A8_WGMMA_WIDE,
                                      plan_quantize, plan_w8a8_tma, plan_w8a8_wgmma, tma_shape)
from xserv_aot.plan.linear_plan import plan_linear
from xserv_aot.plan.op_records import Linear, QuantizeFp8

CTYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int, "u64": ctypes.c_size_t}


def library_body(so, rec, bufs_of, stream):
    """body(j) calling the library entry of LaunchRecord rec, ("ptr", name) bound to bufs_of(j)[name]."""
    f = getattr(so, rec.fn)
    f.restype = ctypes.c_int

    def args(j):
        bufs = bufs_of(j)
        return [CTYPES[t](bufs[v].data_ptr() if t == "ptr" and bufs.get(v) is not None else (None if t == "ptr" else v))
                for t, v in rec.args]
    arg_sets = {}

    def body(j):
        if j not in arg_sets:
            arg_sets[j] = args(j)
        st = f(*arg_sets[j], ctypes.c_void_p(stream()))
        if st:
            raise RuntimeError(f"{rec.fn} {rec.args}: status {st}")
    return body


def bench_fp8_wgmma(args, Kernels, time_graph, stream, rel_err, l2_bytes) -> None:
    torch.zeros(1, device="cuda")
    from xserv_aot.runtime.cuda.tensor_map import encode
    kern = Kernels("gemv_fp8.cu", "gemm_w8a8_wgmma.cu", "gemm_w8a8_tma.cu")
    sweep_cp_async = args.variants == "all"
    fp8_gemm = Fp8Gemm(Path(args.lib)) if args.lib else None
    so = fp8_gemm.so if fp8_gemm else None
    cutlass = {"path": Path(args.lib), "configs": library_config_names(Path(args.lib))} if args.lib else None
    rows_list = [int(r) for r in args.rows.split(",")]
    schemes = [fp8.BLOCK128] + ([fp8.CHANNEL] if args.both_schemes else [])
    torch.manual_seed(0)
    print(f"{'scheme':12} {'shape':8} {'rows':>4} {'variant':40} {'us':>8} {'W TB/s':>7} {'err':>8}")
    total, best = {}, {}

    def run(scheme, name, M, variant, body, copies, wbytes, ref, y, kind=None):
        y.fill_(float("nan"))
        body(0)
        torch.cuda.synchronize()
        err = rel_err(y, ref) if ref is not None else float("nan")
        ms = time_graph(body, copies)
        print(f"{scheme:12} {name:8} {M:4} {variant:40} {ms * 1e3:8.2f} {wbytes / ms / 1e9:7.2f} {err:8.1e}",
              flush=True)
        if kind:
            total[(scheme, M, kind)] = total.get((scheme, M, kind), 0.0) + 36 * ms
            if kind == "quantize" and name == "o_proj":
                total[(scheme, M, "quantize_o")] = 36 * ms
        return ms

    extras, keep = [], []                                  # (scheme, name, M, variant, body, copies, ref, y)
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
                run(scheme, name, M, "quantize_fp8", lambda j: ql(stream()), 1, 0, None, y, "quantize")
                op8 = Linear(inp="xq", inp_scale="xs", weight="w", bias=None, out="y", rows=M, n=N, k=K,
                             weight_scale="w.scale", quant=scheme)
                planned = plan_w8a8_wgmma(op8, "bfloat16").launch[0]
                variants = [(None, W8A8_WGMMA_MBAR, W8A8_WGMMA_WIDE)] + [
                    (c, mb, wide) for mb, wide in ((False, False), (True, False), (False, True))
                    if sweep_cp_async and (not wide or M > W8A8_WGMMA_TILES[-1]) for c in W8A8_WGMMA_CLUSTERS]
                for c, mb, wide in variants:
                    rec = plan_w8a8_wgmma(op8, "bfloat16", c, mb, wide).launch[0]
                    if c is not None and rec.fn == planned.fn:
                        continue
                    ls = launches(kern, rec, [[("ptr", xq.data_ptr()), ("ptr", xs.data_ptr()), ("ptr", w.data_ptr()),
                                               ("ptr", s.data_ptr()), ("ptr", 0), ("ptr", y.data_ptr()),
                                               ("i32", M), ("i32", N), ("i32", K)] for w, s in ws])
                    body = lambda j, ls=ls: ls[j](stream())  # noqa: E731
                    if c is None:
                        ms = run(scheme, name, M, f"{rec.fn} (planned)", body, copies, N * K, ref, y, "wgmma")
                        best[(scheme, name, M, "wgmma")] = ms
                    else:                                  # timed after every shape's planned kernel
                        keep.append((ws, x, xq, xs))           # the launches hold raw pointers into these
                        extras.append((scheme, name, M, rec.fn, body, copies, N * K, ref, y, "wgmma"))
                for shape, tag in W8A8_TMA_SHAPES.items():
                    if shape != (2, 1) and M > 64:
                        continue                       # 256-row blocks: 33-64 rows only
                    tma_kind = f"tma{tag}"
                    built = W8A8_TMA_CLUSTERS if shape == (2, 1) else W8A8_TMA_CLUSTERS_R256
                    tma_planned = plan_w8a8_tma(op8, "bfloat16", None, shape).launch[0]
                    for c, early in ((None, True), (None, False), *((c, True) for c in built)):
                        rec = plan_w8a8_tma(op8, "bfloat16", c, shape, early).launch[0]
                        if c is not None and rec.fn == tma_planned.fn:
                            continue
                        tw, tx = rec.args[0][1], rec.args[1][1]
                        ls = launches(kern, rec, [[("tmap", encode(tw, w.data_ptr())),
                                                   ("tmap", encode(tx, xq.data_ptr())), ("ptr", xs.data_ptr()),
                                                   ("ptr", s.data_ptr()), ("ptr", 0), ("ptr", y.data_ptr()),
                                                   ("i32", M), ("i32", N), ("i32", K)] for w, s in ws])
                        body = lambda j, ls=ls: ls[j](stream())  # noqa: E731
                        label = rec.fn + (" pdl" if rec.pdl else "")
                        if c is None and early:
                            ms = run(scheme, name, M, f"{label} (planned" + (", the plan's shape)" if shape ==
                                     tma_shape(N, M) else ")"), body, copies, N * K, ref, y, tma_kind)
                            best[(scheme, name, M, tma_kind)] = ms
                            if shape == tma_shape(N, M):
                                total[(scheme, M, "tma plan")] = total.get((scheme, M, "tma plan"), 0.0) + 36 * ms
                        else:
                            keep.append((ws, x, xq, xs))
                            extras.append((scheme, name, M, label, body, copies, N * K, ref, y, tma_kind))
                if so is not None:
                    cfg, splits = fp8_config(scheme, "bfloat16", M, N, K)   # the config plans take

                    def gemm(j, cfg=cfg, splits=splits, ws=ws, xq=xq, xs=xs, y=y, M=M, N=N, K=K):
                        w, s = ws[j]
                        fp8_gemm(cfg, splits, xq, xs, w, s, y, M, N, K, stream())
                    run(scheme, name, M, "CUTLASS W8A8", gemm, copies, N * K, ref, y, "cutlass")
            if so is not None and scheme == schemes[0]:
                bench_bf16(name, N, K, rows_list, cutlass, so, run, stream, l2_bytes)
    summary(total, schemes, rows_list)
    print("\nthe TMA kernel at every built cluster size" +
          (", the cp.async kernel at every cluster size, its mb ring and n256 tile:" if sweep_cp_async else ":"))
    for scheme, name, M, variant, body, copies, wbytes, ref, y, kind in extras:
        best[(scheme, name, M, kind)] = min(best[(scheme, name, M, kind)],
                                            run(scheme, name, M, variant, body, copies, wbytes, ref, y))
    for (scheme, name, M, kind), ms in best.items():
        total[(scheme, M, f"{kind} best")] = total.get((scheme, M, f"{kind} best"), 0.0) + 36 * ms
    summary(total, schemes, rows_list)


def summary(total, schemes, rows_list) -> None:
    for scheme in schemes:
        for M in rows_list:
            t = {k: v for (s, m, k), v in total.items() if s in (scheme, "bf16") and m == M}
            q = t.get("quantize_o", 0.0)
            kinds = ["wgmma", "wgmma best", "tma plan"] + [k for tag in W8A8_TMA_SHAPES.values()
                                                           for k in (f"tma{tag}", f"tma{tag} best")]
            parts = [f"{k} {t[k]:.3f} (+ o_proj quantize {t[k] + q:.3f})" for k in kinds + ["cutlass"] if k in t]
            print(f"Qwen3-8B layer linears, 36 layers, rows {M}, {scheme}: " + "; ".join(parts) +
                  (f"; bf16 plan {t['bf16']:.3f}" if "bf16" in t else ""), flush=True)


def bench_bf16(name, N, K, rows_list, cutlass, so, run, stream, l2_bytes) -> None:
    """The bf16 decode plan's kernel for these rows (plan_linear: CUTLASS swap-AB or tiles here)."""
    copies = max(2, -(-3 * l2_bytes // (2 * N * K)))
    ws = [torch.randn(N, K, device="cuda").mul_(K ** -0.5).bfloat16() for _ in range(copies)]
    for M in rows_list:
        x = torch.randn(M, K, device="cuda").bfloat16()
        y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ ws[0].float().t()
        choice = plan_linear(Linear(inp="x", weight="w", bias=None, out="y", rows=M, n=N, k=K), "bfloat16", None,
                             cutlass, decode=True)
        (rec,) = choice.launch
        if rec.library != "gemm_library":
            print(f"bf16 {name} {M}: {rec.fn} is not a library call, not timed here")
            continue
        gws = torch.empty(max(cutlass.get("workspace", 0), 1), dtype=torch.uint8, device="cuda")
        body = library_body(so, rec, lambda j: {"x": x, "w": ws[j], "y": y, "gemm_ws": gws}, stream)
        run("bf16", name, M, f"bf16 plan {cutlass['configs'][choice.gemm_config]}", body, copies, 2 * N * K, ref, y,
            "bf16")
    del ws
    torch.cuda.empty_cache()

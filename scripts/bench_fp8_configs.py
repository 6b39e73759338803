"""`scripts/bench_kernels.py fp8-configs --lib PATH/libxserv_gemm.so [--rows 64,128,256,2048]`: every bf16-output
CUTLASS W8A8 config of the library (tiles, ping-pong, stream-K at each of SPLITS) on the Qwen3-8B linears, per
scheme and row count (device machine).

Activations are quantized here with torch (per row and 128-k group for block128, per row for channel), so the
reference (the dequantized operands' float32 product) checks the GEMM alone; each output is poisoned with NaN first.
Times: graph replay, weights rotated over copies that together exceed L2. The last lines sum 36 layers per row count
for the config the plans take (cutlass_build.fp8_config) and for the fastest config of each shape.
"""
from __future__ import annotations

from pathlib import Path

import torch

from scripts.bench_fp8 import FP8_SHAPES, FP8_TFLOPS, Fp8Gemm, weights
from xserv_aot import fp8
from xserv_aot.plan.cutlass_build import fp8_config

SHAPES = ("qkv", "o_proj", "gate_up", "down")


def quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 bytes [M, K], float32 scales [M, K / group], the dequantized float32 rows)."""
    M, K = x.shape
    g = x.float().view(M, K // group, group)
    sc = (g.abs().amax(-1) / 448.0).clamp_min(1e-12)
    q = (g / sc[..., None]).to(torch.float8_e4m3fn)
    return q.view(M, K).view(torch.uint8).contiguous(), sc.contiguous(), (q.float() * sc[..., None]).view(M, K)


SPLITS = (0, 2, 3, 4, 6, 8)          # the stream-K configs' scheduler modes timed: 0 stream-K, > 1 split-K


def bench_fp8_configs(args, time_graph, stream, rel_err, l2_bytes) -> None:
    gemm = Fp8Gemm(Path(args.lib))
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    print(f"{'scheme':12} {'shape':8} {'rows':>5} {'config':52} {'ms':>8} {'TFLOP/s':>8} {'%1580':>6} {'err':>8}")
    for scheme in (fp8.BLOCK128, fp8.CHANNEL):
        cfgs = [i for i, n in enumerate(gemm.names) if f"_{scheme.removeprefix('fp8_')}_" in n and
                gemm.out_bytes[i] == 2]
        plan_ms, best_ms = {}, {}
        for name in SHAPES:
            N, K = FP8_SHAPES[name]
            copies = max(2, -(-3 * l2_bytes // (N * K)))
            wts, wref = weights(N, K, scheme, copies)
            for M in rows_list:
                xq, xs, xref = quantize_rows(torch.randn(M, K, device="cuda"), fp8.act_group(scheme, K))
                ref = xref @ wref.t()
                y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                chosen = fp8_config(scheme, "bfloat16", M, N, K)
                for cfg in cfgs:
                    for splits in SPLITS if "streamk" in gemm.names[cfg] else (0,):
                        label = gemm.names[cfg] + (f" splits {splits}" if "streamk" in gemm.names[cfg] else "")
                        if gemm.ws_size(cfg, M, N, K, splits) > gemm.ws.numel():
                            print(f"{scheme:12} {name:8} {M:5} {label:52} workspace too large")
                            continue
                        y.fill_(float("nan"))
                        gemm(cfg, splits, xq, xs, wts[0][0], wts[0][1], y, M, N, K, stream())
                        torch.cuda.synchronize()
                        err = rel_err(y, ref)
                        ms = time_graph(lambda j: gemm(cfg, splits, xq, xs, wts[j][0], wts[j][1], y, M, N, K,
                                                       stream()), copies)
                        tf = 2 * M * N * K / ms / 1e9
                        mark = "*" if (cfg, splits) == chosen else " "
                        print(f"{scheme:12} {name:8} {M:5} {label + mark:52} {ms:8.4f} {tf:8.1f} "
                              f"{tf / FP8_TFLOPS:6.0%} {err:8.1e}", flush=True)
                        if err < 2e-2:
                            best_ms[(name, M)] = min(best_ms.get((name, M), float("inf")), ms)
                        if (cfg, splits) == chosen:
                            plan_ms[(name, M)] = ms
            wts = None
            torch.cuda.empty_cache()
        for M in rows_list:
            flop = 36 * sum(2 * M * FP8_SHAPES[n][0] * FP8_SHAPES[n][1] for n in SHAPES)
            for label, t in (("plan's configs", plan_ms), ("fastest per shape", best_ms)):
                if all((n, M) in t for n in SHAPES):
                    ms = 36 * sum(t[(n, M)] for n in SHAPES)
                    print(f"Qwen3-8B W8A8 linears ({scheme}, rows {M}, 36 layers, {label}): {ms:.3f} ms/step, "
                          f"{flop / ms / 1e9:.0f} TFLOP/s")

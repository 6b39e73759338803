"""`scripts/bench_kernels.py prefill-gemm --lib PATH [--rows 2048,4096,8192]`: every bf16 tile config of the CUTLASS
library (cutlass_build.TABLE_CONFIGS) on every prefill linear of Qwen3-8B at each M, plus torch.matmul (cuBLAS) and
the residual-epilogue twins on o_proj / down; each output NaN-poisoned (the residual configs' output holds the
residual), checked against torch float32, timed in a CUDA graph rotating over weight copies that exceed L2.
Prints TFLOP/s (and % of 790) per cell, then the build config's gemm_configs table the measurements suggest:
the fastest config per "NxK" when one config wins at every M, else one "MxNxK" entry per M; shapes where the
tile model's pick is within 1% of the best are left out (the model stays the rule there)."""
from __future__ import annotations

import json

import torch

from xserv_aot.plan import cutlass_build as cb

PEAK = 790.0
PREFILL_SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
RESIDUAL_SHAPES = ("o_proj", "down")


def suggest_table(best: dict, model: dict) -> dict:
    """best / model: {(M, N, K): (config name, TFLOP/s)} -> gemm_configs entries where the best beats the model's
    pick by more than 1%."""
    table: dict[str, str] = {}
    shapes = sorted({(n, k) for _, n, k in best})
    for n, k in shapes:
        cells = {m: best[m, nn, kk] for m, nn, kk in best if (nn, kk) == (n, k)}
        wins = {m: c for m, c in cells.items() if c[1] > 1.01 * model.get((m, n, k), ("", 0.0))[1]}
        if not wins:
            continue
        names = {c[0] for c in cells.values()}
        if len(names) == 1 and len(wins) == len(cells):
            table[f"{n}x{k}"] = names.pop()
        else:
            table.update({f"{m}x{n}x{k}": c[0] for m, c in sorted(wins.items())})
    return table


def bench_prefill_gemm(args, gemm, time_graph, rel_err, l2_bytes: int) -> None:
    rows = [int(r) for r in (args.rows or "2048,4096,8192").split(",")]
    configs = list(cb.TABLE_CONFIGS.items())
    print(f"configs: {[name for name, _ in configs]}; residual twins: "
          f"{ {cb.GEMM_CONFIGS[a]: cb.GEMM_CONFIGS[b] for a, b in cb.RESIDUAL_TWIN.items()} }")
    print(f"{'shape':8} {'M':>5} {'variant':40} {'ms':>8} {'TFLOP/s':>8} {'%790':>5} {'err':>8}")
    torch.manual_seed(0)
    best, model = {}, {}
    for shape, (N, K) in PREFILL_SHAPES.items():
        copies = max(2, -(-3 * l2_bytes // (N * K * 2)))
        ws = [torch.randn(N, K, device="cuda").mul_(K ** -0.5).bfloat16() for _ in range(copies)]
        for M in rows:
            x = torch.randn(M, K, device="cuda").bfloat16()
            ref = x.float() @ ws[0].float().t()
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            variants = [("torch.matmul (cuBLAS)", None, lambda j: torch.matmul(x, ws[j].t(), out=y))]
            for name, ci in configs:
                variants.append((name, ci, lambda j, ci=ci: gemm(ci, x, ws[j], y, M, N, K, 0)))
            if shape in RESIDUAL_SHAPES:
                for ci in cb.RESIDUAL_TWIN.values():
                    variants.append((cb.GEMM_CONFIGS[ci], ci, lambda j, ci=ci: gemm(ci, x, ws[j], y, M, N, K, 0)))
            flop = 2.0 * M * N * K
            chosen = cb.GEMM_CONFIGS[cb.choose_gemm_config(M, N, K)]
            for vname, ci, body in variants:
                residual = ci in cb.RESIDUAL_TWIN.values()
                r = torch.randn(M, N, device="cuda").bfloat16() if residual else None
                try:
                    if residual:
                        y.copy_(r)
                    else:
                        y.fill_(float("nan"))
                    body(0)
                    torch.cuda.synchronize()
                    err = rel_err(y, ref.bfloat16().float() + r.float() if residual else ref)
                    ms = time_graph(body, copies)
                except RuntimeError as e:
                    print(f"{shape:8} {M:5} {vname:40} failed: {e}")
                    continue
                tf = flop / ms / 1e9
                tag = " (model)" if vname == chosen else ""
                print(f"{shape:8} {M:5} {vname:40} {ms:8.4f} {tf:8.1f} {100 * tf / PEAK:5.1f} {err:8.1e}{tag}",
                      flush=True)
                if err > 2e-2 or ci is None or residual:
                    continue
                if tf > best.get((M, N, K), ("", 0.0))[1]:
                    best[M, N, K] = (vname, tf)
                if vname == chosen:
                    model[M, N, K] = (vname, tf)
        del ws
        torch.cuda.empty_cache()
    for key, (name, tf) in sorted(best.items()):
        m, n, k = key
        print(f"best {m}x{n}x{k}: {name} {tf:.1f} TFLOP/s (model: {model.get(key, ('?', 0))[0]} "
              f"{model.get(key, ('?', 0.0))[1]:.1f})")
    print("suggested gemm_configs:", json.dumps(suggest_table(best, model), sort_keys=True))

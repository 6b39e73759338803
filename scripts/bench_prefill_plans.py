#!/usr/bin/env python3
"""Prefill of several plans in one run (device machine, --dummy-weights plans): for each plan, TTFT of one
prompt per length (host-timed Session.prefill, median of --reps) and the per-op profile of each prefill bucket
named (graph step, ms and TFLOP/s per op:kernel, e.g. linear:cutlass, attention:..., add_rmsnorm:...), then a
summary table. Compare plans that differ in one build setting (gemm_configs, gemm_residual).

  python3 scripts/bench_prefill_plans.py PLAN [PLAN ...] [--prompts 1024,4096,8192] [--profile 2048,4096] [--reps 3]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import ttft  # noqa: E402
from xserv_aot.plan.manifest import Plan  # noqa: E402
from xserv_aot.runtime.cuda.profile import format_table, profile_runner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("plans", nargs="+")
    ap.add_argument("--prompts", default="1024,4096,8192", help="TTFT prompt lengths")
    ap.add_argument("--profile", default="2048", help="prefill buckets (token counts) to profile")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from xserv_aot.runtime.cuda.runner import CudaRunner
    summary = []
    for path in args.plans:
        plan = Plan.load(path)
        b = plan.build
        print(f"== {path}: gemm_residual={b.gemm_residual} gemm_configs={b.gemm_configs} "
              f"prefill_row_kernels={b.prefill_row_kernels} prefill buckets {b.prefill_buckets}", flush=True)
        runner = CudaRunner(plan, log=lambda m: None)
        try:
            row = {"plan": Path(path).name}
            for n in (int(x) for x in args.prompts.split(",")):
                if n <= b.max_seq_len:
                    row[f"ttft_{n}"] = ttft(runner, n, args.reps)
                    print(f"TTFT {n}: {row[f'ttft_{n}']:.1f} ms", flush=True)
            for n in (int(x) for x in args.profile.split(",")):
                if f"prefill_{n}" in runner.buckets:
                    prof = profile_runner(runner, f"prefill_{n}", n)
                    row[f"step_{n}"] = prof["graph_ms"]
                    print(format_table(prof, b.target), flush=True)
            summary.append(row)
        finally:
            runner.close()
    keys = sorted({k for r in summary for k in r if k != "plan"})
    print("\nsummary (ms): " + "  ".join(f"{k:>10}" for k in keys))
    for r in summary:
        print(f"{r['plan']:>12}: " + "  ".join(f"{r[k]:10.2f}" if k in r else f"{'-':>10}" for k in keys))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Decode steps of 1-2 sequences on one GPU, plan against plan (e.g. main's vs this branch's, PDL off / on):
graph-replay step time of decode_1 / decode_2 at each context, the attention + rope ops' share of it (eager,
events between ops), and the decode_1 per-op tables at the first and last context.

  python3 scripts/bench_decode_few.py PLAN_DIR [PLAN_DIR ...] [--contexts 128,512,4096] [--reps 50]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xserv_aot.plan.manifest import Plan  # noqa: E402
from xserv_aot.runtime.cuda.profile import format_table, profile_runner  # noqa: E402

ATTN_OPS = ("attention", "qk_norm_rope_cache")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("plans", nargs="+")
    ap.add_argument("--contexts", default="128,512,4096")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    from xserv_aot.runtime.cuda.runner import CudaRunner
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for pdir in args.plans:
        plan = Plan.load(pdir)
        runner = CudaRunner(plan, log=lambda m: None)
        try:
            for bucket in ("decode_1", "decode_2"):
                if bucket not in runner.buckets:
                    continue
                for ctx in contexts:
                    prof = profile_runner(runner, bucket, ctx, reps=args.reps)
                    attn = [(kind, kernel, ms) for _, kind, kernel, ms, _, _ in prof["ops"] if kind in ATTN_OPS]
                    attn_ms = sum(ms for *_, ms in attn)
                    kernels = sorted({k for _, k, _ in attn})
                    rows.append((Path(pdir).name, bucket, ctx, prof["graph_ms"], attn_ms, len(attn), kernels))
                    print(f"{Path(pdir).name:24} {bucket:9} ctx {ctx:5}: graph {prof['graph_ms']:.3f} ms = "
                          f"{1e3 / prof['graph_ms'] * int(bucket[-1]):.1f} tok/s; attention+rope {attn_ms:.3f} ms "
                          f"in {len(attn)} launches ({attn_ms / max(len(attn), 1) * 1e3:.2f} us each) {kernels}",
                          flush=True)
                    if bucket == "decode_1" and ctx in (contexts[0], contexts[-1]):
                        print(format_table(prof, plan.build.target), flush=True)
        finally:
            runner.close()
    print("\nplan                     bucket      ctx  graph ms   attn+rope ms  launches")
    for name, bucket, ctx, g, a, n, _ in rows:
        print(f"{name:24} {bucket:9} {ctx:5}  {g:8.3f}  {a:12.3f}  {n:8d}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Decode steps of several plans in one run (device machine, --dummy-weights plans): for each plan and each
batch x context, the host-timed step (runner.run: staging, H2D, graph replay, D2H, sync; median), the graph replay
alone (profile_runner), tok/s and the plan's floor (bytes over 4.6 TB/s or FLOPs over 790 TFLOP/s, e4m3 GEMMs 1580).

  python3 scripts/bench_steps.py PLAN [PLAN ...] [--steps 1x128,1x4096,64x1024,256x1024] [--reps 50]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import step_floor_ms, step_times  # noqa: E402
from xserv_aot.plan.manifest import Plan  # noqa: E402
from xserv_aot.runtime.cuda.profile import decode_batch, profile_runner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("plans", nargs="+")
    ap.add_argument("--steps", default="1x128,1x4096,64x1024,256x1024", help="batch x context, comma separated")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    from xserv_aot.runtime.cuda.runner import CudaRunner
    specs = [tuple(int(v) for v in s.split("x")) for s in args.steps.split(",")]
    rows = []
    for pdir in args.plans:
        plan = Plan.load(pdir)
        runner = CudaRunner(plan, log=lambda m: None)
        try:
            for bsz, ctx in specs:
                if bsz > plan.build.max_num_seqs or ctx > plan.build.max_seq_len:
                    continue
                batch = decode_batch(plan, bsz, ctx)
                bk = runner.bucket_for(batch)
                ms = float(np.median(step_times(runner, batch, args.reps)))
                graph = profile_runner(runner, bk.name, ctx, reps=args.reps)["graph_ms"]
                floor = step_floor_ms(plan, bk, ctx)
                rows.append((Path(pdir).name, bsz, ctx, ms, graph, bsz * 1e3 / ms, floor))
                print(f"{Path(pdir).name:16} batch {bsz:3} ctx {ctx:5}: step {ms:.3f} ms, graph {graph:.3f} ms, "
                      f"{bsz * 1e3 / ms:.1f} tok/s (floor {floor:.3f} ms)", flush=True)
        finally:
            runner.close()
    print(f"\n{'plan':16} {'batch':>5} {'ctx':>5} {'step ms':>8} {'graph ms':>8} {'tok/s':>8} {'floor ms':>8}")
    for r in rows:
        print(f"{r[0]:16} {r[1]:5} {r[2]:5} {r[3]:8.3f} {r[4]:8.3f} {r[5]:8.1f} {r[6]:8.3f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A / B of plans of one model, one load each (device machine, --dummy-weights plans compiled from one config: the
weights are the same): the same steps through every plan, a 512-token prefill then decode steps of 1 - 256
sequences over the KV it wrote (each three times: the repeats must agree within a plan), each step's float32 logits
compared with the first plan's bit for bit; then, with --steps, bench_steps' timings (host-timed step and graph
replay, median) of each plan. For plans that differ only in how kernels are launched (build.pdl, a library built
with other flags) any difference is a race. Exit 1 on one.

  python3 scripts/compare_plans.py PLAN_A PLAN_B [...] [--decode 1,2,8,64,256] [--context 700]
                                   [--steps 1x128,64x1024,256x256 --reps 30]
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import step_times  # noqa: E402
from xserv_aot.plan.manifest import Plan  # noqa: E402
from xserv_aot.runtime.cuda.profile import decode_batch, prefill_batch, profile_runner  # noqa: E402


def steps(plan, decode: list[int], context: int):
    yield "prefill 512", replace(prefill_batch(plan, 512, 512), need_logits=True)
    for n in decode:
        if n <= plan.build.max_num_seqs:
            for rep in range(3):                 # the same step again: state a graph replay may race on
                yield f"decode {n} x {context} #{rep}", replace(decode_batch(plan, n, context), need_logits=True)


def run_plan(pdir: str, decode: list[int], context: int, timed: list[tuple[int, int]], reps: int):
    """(logits of each step, [(batch x context, step ms, graph ms)])."""
    from xserv_aot.runtime.cuda.runner import CudaRunner
    plan = Plan.load(pdir)
    runner = CudaRunner(plan, log=lambda m: None)
    try:
        logits = {name: runner.run(b).logits.copy() for name, b in steps(plan, decode, context)}
        times = []
        for bsz, ctx in timed:
            if bsz <= plan.build.max_num_seqs and ctx <= plan.build.max_seq_len:
                batch = decode_batch(plan, bsz, ctx)
                ms = float(np.median(step_times(runner, batch, reps)))
                graph = profile_runner(runner, runner.bucket_for(batch).name, ctx, reps=reps)["graph_ms"]
                times.append((f"{bsz}x{ctx}", ms, graph))
                print(f"{Path(pdir).name:16} {bsz:3} x {ctx:5}: step {ms:.3f} ms, graph {graph:.3f} ms", flush=True)
        return logits, times
    finally:
        runner.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("plans", nargs="+")
    ap.add_argument("--decode", default="1,2,8,64,256")
    ap.add_argument("--context", type=int, default=700)
    ap.add_argument("--steps", default="", help="batch x context to time, comma separated (none by default)")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    decode = [int(v) for v in args.decode.split(",")]
    timed = [tuple(int(v) for v in s.split("x")) for s in args.steps.split(",") if s]
    ref, bad, table = None, 0, []
    for pdir in args.plans:
        got, times = run_plan(pdir, decode, args.context, timed, args.reps)
        table += [(Path(pdir).name, *t) for t in times]
        for name, g in got.items():              # a repeat of a step within one plan: a race there, whatever B is
            first = got[name.rsplit("#", 1)[0] + "#0"] if "#" in name else g
            if not np.array_equal(g.view(np.uint32), first.view(np.uint32)):
                bad += 1
                print(f"{Path(pdir).name:16} {name:22} DIFFERENT from its own #0 (a race within the plan)", flush=True)
        if ref is None:
            ref = got
            continue
        for name, want in ref.items():
            g = got[name]
            same = g.shape == want.shape and np.array_equal(g.view(np.uint32), want.view(np.uint32))
            bad += not same
            diff = "" if same else (f", max |diff| {np.nanmax(np.abs(g - want)):.3g}, relative "
                                    f"{np.linalg.norm(g.astype(np.float64) - want) / np.linalg.norm(want):.3g}")
            print(f"{Path(pdir).name:16} {name:22} {'equal' if same else 'DIFFERENT'}{diff}", flush=True)
    if table:
        print(f"\n{'plan':16} {'steps':>10} {'step ms':>8} {'graph ms':>8}")
        for name, spec, ms, graph in table:
            print(f"{name:16} {spec:>10} {ms:8.3f} {graph:8.3f}")
    print(f"{bad} step(s) differ" if bad else "every step bit for bit equal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-op GPU timing of one bucket (CUDA events between the ops, recorded inside one captured graph of the step:
op_times) and the whole-graph step time, with each op's bytes and FLOPs, achieved GB/s and TFLOP/s and the share of
the binding ceiling (plan/roofline.py); optional Chrome-trace JSON; the one step `profile --ncu` runs under ncu."""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np

from xserv_aot.plan.roofline import bucket_costs, ceilings_for, floor_s, fp8_mma, launches
from xserv_aot.runtime.batch import BatchDescription
from xserv_aot.runtime.ncu_report import TIMING, profiled_ops

NULL = contextlib.nullcontext()


def decode_batch(plan, num_seqs: int, context: int) -> BatchDescription:
    """num_seqs sequences, each decoding its token at position context - 1 (blocks laid out contiguously)."""
    b = plan.build
    per = -(-context // b.block_size)
    if num_seqs * per > b.num_blocks or context > b.max_seq_len:
        raise ValueError(f"{num_seqs} x {context} tokens do not fit the plan's KV pool / max_seq_len")
    tables = [list(range(i * per, (i + 1) * per)) for i in range(num_seqs)]
    p = context - 1
    return BatchDescription(
        input_ids=[1 + i for i in range(num_seqs)], positions=[p] * num_seqs,
        slot_mapping=[t[p // b.block_size] * b.block_size + p % b.block_size for t in tables],
        query_start_loc=list(range(num_seqs + 1)), seq_lens=[context] * num_seqs, block_tables=tables)


def prefill_batch(plan, num_tokens: int, context: int) -> BatchDescription:
    """One sequence whose last num_tokens of `context` tokens are new."""
    b = plan.build
    per = -(-context // b.block_size)
    table = list(range(per))
    pos = list(range(context - num_tokens, context))
    return BatchDescription(input_ids=[1] * num_tokens, positions=pos,
                            slot_mapping=[table[p // b.block_size] * b.block_size + p % b.block_size for p in pos],
                            query_start_loc=[0, num_tokens], seq_lens=[context], block_tables=[table])


def op_times(runner, bucket: str, reps: int = 20) -> tuple[dict[int, float], str]:
    """({op index: median ms} for the ops of `bucket` that launch something, how they were timed). "graph": CUDA
    events recorded as nodes of one captured graph of the step between the ops (no host launch gaps; each op finds
    L2 as the ops before it left it, as in a serving replay; what remains is the node-to-node launch latency, about
    a microsecond). "eager": events between eager launches (the host's launch gaps count when the GPU catches up
    with it), the fallback where the driver refuses event nodes or their times. The bucket's inputs must be staged."""
    from xserv_aot.runtime.cuda.driver import CudaError
    try:
        return _op_times(runner, bucket, reps, in_graph=True), "graph"
    except CudaError:
        return _op_times(runner, bucket, reps, in_graph=False), "eager"


def _op_times(runner, bucket: str, reps: int, in_graph: bool) -> dict[int, float]:
    dev = runner.dev
    ops = [(i, lns) for i, lns in enumerate(runner.launches[bucket]) if lns]
    ev = [dev.event() for _ in range(len(ops) + 1)]
    nv, names = runner.nvtx, runner.op_names.get(bucket)

    def step(stream, record, ranged):
        record(ev[0])
        for n, (i, lns) in enumerate(ops):
            with nv.range(names[i]) if ranged and names else NULL:
                for ln in lns:
                    ln(stream)
            record(ev[n + 1])
    graph = dev.capture(lambda s: step(s, dev.record_in_graph, False)) if in_graph else None
    per_op = np.zeros((reps, len(ops)))
    for r in range(reps):
        if graph is not None:
            dev.graph_launch(graph)
        else:
            step(dev.stream, dev.record, True)
        dev.sync()
        per_op[r] = [dev.elapsed_ms(ev[n], ev[n + 1]) for n in range(len(ops))]
    med = np.median(per_op, axis=0)
    return {i: float(med[n]) for n, (i, _) in enumerate(ops)}


def profile_runner(runner, bucket: str = "decode_1", context: int = 128, reps: int = 20) -> dict:
    """{ops: [(index, op, kernel, ms, bytes, flops)] (ops that launch something), ops_ms (their sum), timing
    (op_times), graph_ms (the step's own graph)} for one bucket at the given context."""
    plan, dev = runner.plan, runner.dev
    bk = runner.buckets[bucket]
    runner.stage(step_batch(plan, bk, context), bk)
    runner.enqueue(bucket)                               # one eager step (with NVTX ranges per op when on)
    dev.sync()
    times, timing = op_times(runner, bucket, reps)
    graph, nv = runner.graphs.get(bucket), runner.nvtx
    g0, g1 = dev.event(), dev.event()
    steps = []
    for _ in range(reps):
        dev.record(g0)
        with nv.range(f"replay {bucket}"):
            if graph is not None:
                dev.graph_launch(graph)
            else:
                runner.enqueue(bucket)
        dev.record(g1)
        steps.append(dev.elapsed_ms(g0, g1))
    costs = [c for c in bucket_costs(plan, bk, context) if launches(c[1])]
    ops = [(i, op.op, op.cuda.kernel, times[i], nbytes, flops) for i, op, nbytes, flops in costs]
    fp8_ops = [i for i, op, _, _ in costs if fp8_mma(op)]
    return {"bucket": bucket, "context": context, "ops": ops, "graph_ms": float(np.median(steps)),
            "ops_ms": sum(t for _, _, _, t, _, _ in ops), "timing": timing, "fp8_ops": fp8_ops}


def format_table(prof: dict, target: str = "sm_90a") -> str:
    """One row per op:kernel (ops that launch nothing have none): bytes, FLOPs, time, GB/s, TFLOP/s and the share
    of whichever ceiling binds that op."""
    c = ceilings_for(target)
    fp8_ops = set(prof.get("fp8_ops", ()))
    agg: dict[str, list] = {}
    for i, kind, kernel, ms, nbytes, flops in prof["ops"]:
        a = agg.setdefault(f"{kind}:{kernel}", [0, 0.0, 0, 0, c.flops_per_s])
        a[0] += 1
        a[1] += ms
        a[2] += nbytes
        a[3] += flops
        if i in fp8_ops:
            a[4] = c.fp8_flops_per_s                 # e4m3 GEMMs: their own peak (a kernel runs one kind)
    total_bytes, total_flops = sum(a[2] for a in agg.values()), sum(a[3] for a in agg.values())
    floor, bound = floor_s(total_bytes, total_flops, c, sum(a[3] / a[4] for a in agg.values()))
    peaks = f"{c.flops_per_s / 1e12:.0f} TFLOP/s" + (f", e4m3 {c.fp8_flops_per_s / 1e12:.0f}" if fp8_ops else "")
    lines = [f"bucket {prof['bucket']} context {prof['context']}: graph step {prof['graph_ms']:.3f} ms, "
             f"sum of ops {prof['ops_ms']:.3f} ms ({TIMING[prof['timing']]}), {total_bytes / 1e9:.3f} GB, "
             f"{total_flops / 1e9:.1f} GFLOP, "
             f"floor {floor * 1e3:.3f} ms ({bound}-bound at {c.read_bytes_per_s / 1e12:.1f} TB/s, "
             f"{peaks}; the graph reaches {floor * 1e3 / prof['graph_ms']:.0%} of it)",
             f"{'op:kernel':44s} {'n':>4s} {'ms':>8s} {'share':>6s} {'MB':>9s} {'GFLOP':>8s} {'GB/s':>7s} "
             f"{'TFLOP/s':>8s} {'bound':>7s} {'of ceil':>7s}"]
    for name, (n, ms, nbytes, flops, peak) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        s = ms * 1e-3
        gbs, tfs = (nbytes / s / 1e9, flops / s / 1e12) if s > 0 else (0.0, 0.0)
        _, op_bound = floor_s(nbytes, flops, c, flops / peak)
        frac = gbs * 1e9 / c.read_bytes_per_s if op_bound == "memory" else tfs * 1e12 / peak
        lines.append(f"{name:44s} {n:4d} {ms:8.3f} {ms / prof['ops_ms']:6.1%} {nbytes / 1e6:9.2f} {flops / 1e9:8.2f} "
                     f"{gbs:7.0f} {tfs:8.2f} {op_bound:>7s} {frac:7.1%}")
    return "\n".join(lines)


def chrome_trace(prof: dict) -> dict:
    events, t = [], 0.0
    for i, kind, kernel, ms, nbytes, flops in prof["ops"]:
        events.append({"name": kernel, "cat": kind, "ph": "X", "ts": t * 1e3, "dur": ms * 1e3, "pid": 0, "tid": 0,
                       "args": {"op_index": i, "bytes": nbytes, "flops": flops}})
        t += ms
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def step_batch(plan, bk, context: int) -> BatchDescription:
    return (decode_batch(plan, bk.num_seqs, context) if bk.kind == "decode"
            else prefill_batch(plan, bk.num_tokens, max(context, bk.num_tokens)))


def profiled_step(runner, bucket: str, ops: set[int], start, stop) -> None:
    """One eager step of `bucket` (inputs staged) with the profiler on (start()) for the launches of the ops in `ops`
    and off (stop()) for the others; NVTX ranges per op as runner.enqueue puts them (ncu decides at each launch)."""
    dev, nv, names = runner.dev, runner.nvtx, runner.op_names.get(bucket)
    on = False
    with nv.range(f"eager {bucket}"):
        for i, lns in enumerate(runner.launches[bucket]):
            if not lns:
                continue
            if (i in ops) != on:
                (stop if on else start)()
                on = not on
            with nv.range(names[i]) if names else NULL:
                for ln in lns:
                    ln(dev.stream)
    if on:
        stop()
    dev.sync()


def run_one_step(plan_dir, bucket: str = "decode_1", context: int = 128, nvtx: bool = True, layers: int = 0,
                 events_out: Path | None = None) -> str:
    """What `profile --ncu` runs under ncu: one eager step of `bucket` with the profiler on (cuProfilerStart/Stop)
    for the ops ncu_report.profiled_ops(bucket, layers) selects only; before it, with the profiler off, op_times of the
    same step written to events_out as JSON {"timing", "ops": {index: ms}} for the parent to set beside ncu's."""
    from cuda.bindings import driver

    from xserv_aot.plan.manifest import Plan
    from xserv_aot.runtime.cuda.driver import check
    from xserv_aot.runtime.cuda.runner import CudaRunner
    from xserv_aot.runtime.nvtx import ranges
    try:
        ranges(nvtx)
    except RuntimeError as e:                           # no NVTX library: the ncu table says it got no ranges
        print(f"note: {e}; profiling without NVTX ranges", file=sys.stderr)
        nvtx = False
    runner = CudaRunner(Plan.load(plan_dir), capture=False, nvtx=nvtx)
    try:
        if bucket not in runner.buckets:
            raise ValueError(f"no bucket {bucket!r} (have: {', '.join(runner.buckets)})")
        bk = runner.buckets[bucket]
        runner.stage(step_batch(runner.plan, bk, context), bk)
        runner.enqueue(bucket)
        runner.dev.sync()
        if events_out is not None:
            times, timing = op_times(runner, bucket)
            Path(events_out).write_text(json.dumps({"timing": timing, "ops": times}))
        ops = profiled_ops(bk, layers)
        profiled_step(runner, bucket, ops, lambda: check(driver.cuProfilerStart(), "cuProfilerStart"),
                      lambda: check(driver.cuProfilerStop(), "cuProfilerStop"))
    finally:
        runner.close()
    n = sum(1 for op in bk.ops if launches(op))
    return f"ran one eager step of {bucket} at context {context}, profiler on for {len(ops)} of {n} launching ops"


def profile_plan(plan_dir, bucket: str = "decode_1", context: int = 128, trace: Path | None = None,
                 reps: int = 20, nvtx: bool = False) -> str:
    from xserv_aot.plan.manifest import Plan
    from xserv_aot.runtime.cuda.runner import CudaRunner
    runner = CudaRunner(Plan.load(plan_dir), nvtx=nvtx)
    try:
        prof = profile_runner(runner, bucket, context, reps)
    finally:
        runner.close()
    if trace:
        Path(trace).write_text(json.dumps(chrome_trace(prof)))
    return format_table(prof, runner.plan.build.target)

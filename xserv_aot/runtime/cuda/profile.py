"""Per-op GPU timing of one bucket (CUDA events around each op, run eagerly) and the whole-graph step time, with
each op's bytes and FLOPs, achieved GB/s and TFLOP/s and the share of the binding ceiling (plan/roofline.py);
optional Chrome-trace JSON."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

from xserv_aot.plan.roofline import bucket_costs, ceilings_for, floor_s, launches
from xserv_aot.runtime.batch import BatchDescription

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


def profile_runner(runner, bucket: str = "decode_1", context: int = 128, reps: int = 20) -> dict:
    """{ops: [(index, op, kernel, ms, bytes, flops)] (ops that launch something), graph_ms, eager_ms} for one bucket
    at the given context."""
    plan, dev = runner.plan, runner.dev
    bk = runner.buckets[bucket]
    batch = step_batch(plan, bk, context)
    runner.stage(batch, bk)
    runner.enqueue(bucket)
    dev.sync()
    ev = [dev.event() for _ in range(len(bk.ops) + 1)]
    per_op = np.zeros((reps, len(bk.ops)))
    nv, names = runner.nvtx, runner.op_names.get(bucket)
    for r in range(reps):
        dev.record(ev[0])
        for i, op_lns in enumerate(runner.launches[bucket]):
            with nv.range(names[i]) if names and op_lns else NULL:
                for ln in op_lns:
                    ln(dev.stream)
            dev.record(ev[i + 1])
        dev.sync()
        per_op[r] = [dev.elapsed_ms(ev[i], ev[i + 1]) for i in range(len(bk.ops))]
    graph = runner.graphs.get(bucket)
    g0, g1 = dev.event(), dev.event()
    times = []
    for _ in range(reps):
        dev.record(g0)
        with nv.range(f"replay {bucket}"):
            if graph is not None:
                dev.graph_launch(graph)
            else:
                runner.enqueue(bucket)
        dev.record(g1)
        times.append(dev.elapsed_ms(g0, g1))
    med = np.median(per_op, axis=0)
    ops = [(i, op.op, op.cuda.kernel, float(med[i]), nbytes, flops)
           for i, op, nbytes, flops in bucket_costs(plan, bk, context) if launches(op)]
    return {"bucket": bucket, "context": context, "ops": ops, "graph_ms": float(np.median(times)),
            "eager_ms": float(med.sum())}


def format_table(prof: dict, target: str = "sm_90a") -> str:
    """One row per op:kernel (ops that launch nothing have none): bytes, FLOPs, time, GB/s, TFLOP/s and the share
    of whichever ceiling binds that op."""
    c = ceilings_for(target)
    agg: dict[str, list] = {}
    for _, kind, kernel, ms, nbytes, flops in prof["ops"]:
        a = agg.setdefault(f"{kind}:{kernel}", [0, 0.0, 0, 0])
        a[0] += 1
        a[1] += ms
        a[2] += nbytes
        a[3] += flops
    total_bytes, total_flops = sum(a[2] for a in agg.values()), sum(a[3] for a in agg.values())
    floor, bound = floor_s(total_bytes, total_flops, c)
    lines = [f"bucket {prof['bucket']} context {prof['context']}: graph step {prof['graph_ms']:.3f} ms, "
             f"eager sum of ops {prof['eager_ms']:.3f} ms, {total_bytes / 1e9:.3f} GB, {total_flops / 1e9:.1f} GFLOP, "
             f"floor {floor * 1e3:.3f} ms ({bound}-bound at {c.read_bytes_per_s / 1e12:.1f} TB/s, "
             f"{c.flops_per_s / 1e12:.0f} TFLOP/s; the graph reaches {floor * 1e3 / prof['graph_ms']:.0%} of it)",
             f"{'op:kernel':44s} {'n':>4s} {'ms':>8s} {'share':>6s} {'MB':>9s} {'GFLOP':>8s} {'GB/s':>7s} "
             f"{'TFLOP/s':>8s} {'bound':>7s} {'of ceil':>7s}"]
    for name, (n, ms, nbytes, flops) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        s = ms * 1e-3
        gbs, tfs = (nbytes / s / 1e9, flops / s / 1e12) if s > 0 else (0.0, 0.0)
        _, op_bound = floor_s(nbytes, flops, c)
        frac = gbs * 1e9 / c.read_bytes_per_s if op_bound == "memory" else tfs * 1e12 / c.flops_per_s
        lines.append(f"{name:44s} {n:4d} {ms:8.3f} {ms / prof['eager_ms']:6.1%} {nbytes / 1e6:9.2f} {flops / 1e9:8.2f} "
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


def run_one_step(plan_dir, bucket: str = "decode_1", context: int = 128, nvtx: bool = True) -> str:
    """One eager step of `bucket` between cuProfilerStart and cuProfilerStop (what `profile --ncu` measures)."""
    from cuda.bindings import driver

    from xserv_aot.plan.manifest import Plan
    from xserv_aot.runtime.cuda.runner import CudaRunner
    runner = CudaRunner(Plan.load(plan_dir), capture=False, nvtx=nvtx)
    try:
        if bucket not in runner.buckets:
            raise ValueError(f"no bucket {bucket!r} (have: {', '.join(runner.buckets)})")
        batch = step_batch(runner.plan, runner.buckets[bucket], context)
        runner.dev.sync()
        driver.cuProfilerStart()
        runner.run_eager(bucket, batch)
        driver.cuProfilerStop()
    finally:
        runner.close()
    return f"ran one eager step of {bucket} at context {context}"


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

"""Per-op GPU timing of one bucket (CUDA events around each op, run eagerly) and the whole-graph step time,
with bytes moved, achieved GB/s and share of the bandwidth roofline; optional Chrome-trace JSON."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from xserv_aot.runtime.batch import BatchDescription

HBM_BYTES_PER_S = 4.28e12          # measured device-to-device copy on this workplace's H200 (KINDS.md)


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


def op_bytes(op: dict, plan, context: int, num_seqs: int) -> int:
    """Fewest bytes the op must move through device memory (inputs once, outputs once)."""
    m = plan.model
    rows, H, dt = op.rows, m.hidden_size, 2
    kind = op.op
    if kind == "linear":
        out_b = 4 if plan.arena[op.out].dtype == "float32" else 2
        n, k = op.n, op.k
        out_n = n // 2 if op.cuda and op.cuda.fused_silu_out else n
        return n * k * dt + rows * k * dt + rows * out_n * out_b
    if kind == "attention":
        kv = num_seqs * context * m.num_kv_heads * m.head_dim * dt * 2
        return kv + 2 * rows * m.num_heads * m.head_dim * dt
    if kind == "qk_norm_rope_cache":
        return rows * (m.q_size + 2 * m.kv_size) * dt * 2
    if kind in ("rmsnorm", "embedding", "gather_rows"):
        return 2 * rows * H * dt
    if kind == "add_rmsnorm":
        return 4 * rows * H * dt
    if kind == "silu_mul":
        return 3 * rows * op.inter * dt
    if kind == "sample":
        return rows * m.vocab_size * 4
    return 0


def profile_runner(runner, bucket: str = "decode_1", context: int = 128, reps: int = 20) -> dict:
    """{ops: [(index, op, kernel, ms, bytes)], graph_ms, eager_ms} for one bucket at the given context."""
    plan, dev = runner.plan, runner.dev
    bk = runner.buckets[bucket]
    batch = (decode_batch(plan, bk.num_seqs, context) if bk.kind == "decode"
             else prefill_batch(plan, bk.num_tokens, max(context, bk.num_tokens)))
    runner.stage(batch, bk)
    runner.enqueue(bucket)
    dev.sync()
    ev = [dev.event() for _ in range(len(bk.ops) + 1)]
    per_op = np.zeros((reps, len(bk.ops)))
    for r in range(reps):
        dev.record(ev[0])
        for i, launches in enumerate(runner.launches[bucket]):
            for ln in launches:
                ln(dev.stream)
            dev.record(ev[i + 1])
        dev.sync()
        per_op[r] = [dev.elapsed_ms(ev[i], ev[i + 1]) for i in range(len(bk.ops))]
    graph = runner.graphs.get(bucket)
    g0, g1 = dev.event(), dev.event()
    times = []
    for _ in range(reps):
        dev.record(g0)
        if graph is not None:
            dev.graph_launch(graph)
        else:
            runner.enqueue(bucket)
        dev.record(g1)
        times.append(dev.elapsed_ms(g0, g1))
    med = np.median(per_op, axis=0)
    ctx = context if bk.kind == "decode" else max(context, bk.num_tokens)
    ops = [(i, op.op, op.cuda.kernel if op.cuda else "?", float(med[i]), op_bytes(op, plan, ctx, batch.num_seqs))
           for i, op in enumerate(bk.ops)]
    return {"bucket": bucket, "context": context, "ops": ops, "graph_ms": float(np.median(times)),
            "eager_ms": float(med.sum())}


def format_table(prof: dict) -> str:
    agg: dict[str, list] = {}
    for _, kind, kernel, ms, nbytes in prof["ops"]:
        a = agg.setdefault(f"{kind}:{kernel}", [0, 0.0, 0])
        a[0] += 1
        a[1] += ms
        a[2] += nbytes
    total_bytes = sum(a[2] for a in agg.values())
    lines = [f"bucket {prof['bucket']} context {prof['context']}: graph step {prof['graph_ms']:.3f} ms, "
             f"eager sum of ops {prof['eager_ms']:.3f} ms, bytes {total_bytes / 1e9:.3f} GB, "
             f"roofline {total_bytes / HBM_BYTES_PER_S * 1e3:.3f} ms "
             f"({total_bytes / HBM_BYTES_PER_S * 1e3 / prof['graph_ms']:.0%} of it reached by the graph)",
             f"{'op:kernel':44s} {'n':>4s} {'ms':>8s} {'share':>6s} {'GB':>8s} {'GB/s':>7s} {'roofl':>6s}"]
    for name, (n, ms, nbytes) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        gbs = nbytes / (ms * 1e-3) / 1e9 if ms > 0 else 0.0
        lines.append(f"{name:44s} {n:4d} {ms:8.3f} {ms / prof['eager_ms']:6.1%} {nbytes / 1e9:8.4f} {gbs:7.0f} "
                     f"{gbs * 1e9 / HBM_BYTES_PER_S:6.1%}")
    return "\n".join(lines)


def chrome_trace(prof: dict) -> dict:
    events, t = [], 0.0
    for i, kind, kernel, ms, nbytes in prof["ops"]:
        events.append({"name": kernel, "cat": kind, "ph": "X", "ts": t * 1e3, "dur": ms * 1e3, "pid": 0, "tid": 0,
                       "args": {"op_index": i, "bytes": nbytes}})
        t += ms
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def profile_plan(plan_dir, bucket: str = "decode_1", context: int = 128, trace: Path | None = None,
                 reps: int = 20) -> str:
    from xserv_aot.plan.manifest import Plan
    from xserv_aot.runtime.cuda.runner import CudaRunner
    runner = CudaRunner(Plan.load(plan_dir))
    try:
        prof = profile_runner(runner, bucket, context, reps)
    finally:
        runner.close()
    if trace:
        Path(trace).write_text(json.dumps(chrome_trace(prof)))
    return format_table(prof)

"""What each op of a bucket must cost at least: bytes through device memory and FLOPs, over the target's ceilings.

The ceilings live here and only here (TARGETS). An op's floor is max(bytes / read bandwidth, FLOPs / peak); the
larger term is its bound. Ops that launch nothing (`silu_mul` fused into the gate GEMV: op.cuda.launch == ())
have no row, except those the decode megakernel runs.
Bytes count every input once and every output once; FLOPs count 2 per multiply-add of GEMMs and attention
(causal for prefill) plus a few per element for the elementwise ops (small next to either ceiling).
"""
from __future__ import annotations

from dataclasses import dataclass

from xserv_aot import fp8
from xserv_aot.dtypes import ITEMSIZE
from xserv_aot.plan.megakernel_plan import FUSED as MK_FUSED
from xserv_aot.plan.op_records import Op
from xserv_aot.plan.tensor_parallel import local_model


@dataclass(frozen=True)
class Ceilings:
    device: str
    read_bytes_per_s: float
    flops_per_s: float                  # bf16 tensor cores (and every op that is not an e4m3 GEMM)
    fp8_flops_per_s: float              # e4m3 x e4m3 tensor cores: the W8A8 linears
    source: str


TARGETS = {
    "sm_90a": Ceilings("H200", 4.6e12, 790e12, 2 * 790e12,
                       "read bandwidth measured by the lm_head GEMV on the lent H200; bf16 dense tensor-core FLOP/s "
                       "measured; e4m3 twice that, the sm90 datasheet ratio (not measured)"),
}
DEFAULT_TARGET = "sm_90a"


def ceilings_for(target: str) -> Ceilings:
    """The target's ceilings; CPU plans get the default GPU target's (the floor they would have there)."""
    return TARGETS.get(target, TARGETS[DEFAULT_TARGET])


def launches(op: Op) -> bool:
    """The op's kernel choice launches something (a kernel or a library call); fused ops and ops without a kernel
    choice (CPU plans) do not."""
    return op.cuda is not None and bool(op.cuda.launch)


def costs_something(op: Op) -> bool:
    """Counted in the floor: every op of a CPU plan (no kernel choice, nothing fused), the launching ops of a GPU
    plan, and the ops the decode megakernel runs (it reads their weights and writes their outputs itself)."""
    return op.cuda is None or launches(op) or op.cuda.kernel == MK_FUSED


def op_layer(op: Op) -> int | None:
    """The decoder layer of an op (its `layer`, or N of its weight "layers.N.*"); None for the ops outside the
    layers (embedding, final norm, head, sampling)."""
    layer = getattr(op, "layer", None)
    weight = str(getattr(op, "weight", None) or "")
    if layer is None and weight.startswith("layers."):
        layer = int(weight.split(".")[1])
    return layer


def op_name(bucket: str, i: int, op: Op) -> str:
    """e.g. "decode_1/12 L1 linear gate_up gemv_gate_m4" (bucket, index, layer, op, weight, kernel)."""
    weight, layer = str(getattr(op, "weight", None) or ""), op_layer(op)
    parts = [f"{bucket}/{i}", f"L{layer}" if layer is not None else "", op.op, weight.rsplit(".", 1)[-1],
             op.cuda.kernel if op.cuda else ""]
    return " ".join(p for p in parts if p)


def rank_config(plan):
    """The model as one rank holds it (heads, kv heads, intermediate size): a tensor-parallel plan's ops are one rank's
    (their collectives cost nothing here: the floor counts device memory and FLOPs only)."""
    return local_model(plan.model, plan.tensor_parallel)


def op_bytes(op: Op, plan, context: int, num_seqs: int) -> int:
    """Fewest bytes the op must move through device memory (inputs once, outputs once); the KV cache in the plan's
    kv_cache dtype, activations in their arena dtype, weights in their own (FP8 ones with their scales)."""
    m, dt, kv_dt = rank_config(plan), ITEMSIZE[plan.build.dtype], ITEMSIZE[plan.kv_cache["dtype"]]
    rows, H = op.rows, m.hidden_size
    kind = op.op
    if kind == "linear":
        out_b, in_b = ITEMSIZE[plan.arena[op.out].dtype], ITEMSIZE[plan.arena[op.inp].dtype]
        out_n = op.n // 2 if op.cuda and op.cuda.fused_silu_out else op.n
        w = plan.weights.get(op.weight)
        w_bytes = op.n * op.k * (ITEMSIZE[w.dtype] if w else dt)
        scales = plan.weights[op.weight_scale].nbytes if op.weight_scale else 0
        x_scales = rows * fp8.groups(op.k, fp8.act_group(op.quant, op.k)) * 4 if op.inp_scale else 0
        return w_bytes + scales + x_scales + rows * op.k * in_b + rows * out_n * out_b
    if kind == "quantize_fp8":                                 # bf16 in, e4m3 + float32 scales out
        return rows * op.k * (dt + 1) + rows * -(-op.k // op.group) * 4
    if kind == "attention":
        kv = num_seqs * context * m.num_kv_heads * m.head_dim * kv_dt * 2
        return kv + 2 * rows * m.num_heads * m.head_dim * dt
    if kind == "qk_norm_rope_cache":
        return rows * ((2 * m.q_size + 2 * m.kv_size) * dt + 2 * m.kv_size * kv_dt)   # qkv in; q, k, v out
    if kind in ("rmsnorm", "embedding", "gather_rows"):
        return 2 * rows * H * dt
    if kind == "add_rmsnorm":
        return 4 * rows * H * dt
    if kind == "silu_mul":
        return 3 * rows * op.inter * dt
    if kind == "sample":
        return rows * m.vocab_size * 4
    if kind == "apply_token_bitmask":                          # the row flags; masks only in steps with a grammar
        return rows * 4
    return 0


def op_flops(op: Op, plan, context: int, num_seqs: int) -> int:
    m = rank_config(plan)
    rows, H = op.rows, m.hidden_size
    kind = op.op
    if kind == "linear":
        return 2 * rows * op.n * op.k
    if kind == "attention":
        if rows <= num_seqs:                                   # decode: each row attends to `context` keys
            keys = rows * context
        else:                                                  # one prefill sequence, causal over its new rows
            keys = rows * (context - rows) + rows * (rows + 1) // 2
        return 4 * m.num_heads * m.head_dim * keys
    per_elem = {"rmsnorm": 4 * H, "add_rmsnorm": 5 * H, "silu_mul": 5 * getattr(op, "inter", 0),
                "qk_norm_rope_cache": 8 * (m.q_size + m.kv_size), "sample": 4 * m.vocab_size}
    return rows * per_elem.get(kind, 0)


def fp8_mma(op: Op) -> bool:
    """A W8A8 linear: e4m3 activations x e4m3 weights on the tensor cores (W8A16 ones multiply in bf16 / fp32)."""
    return op.op == "linear" and getattr(op, "inp_scale", None) is not None


def compute_s(op: Op, flops: float, c: Ceilings) -> float:
    return flops / (c.fp8_flops_per_s if fp8_mma(op) else c.flops_per_s)


def floor_s(nbytes: float, flops: float, c: Ceilings, flops_s: float | None = None) -> tuple[float, str]:
    """(seconds, "memory" | "compute"): the larger of the two floors; flops_s: the FLOPs' time when they are not all
    at the bf16 rate (costs_floor_s)."""
    t_mem, t_fl = nbytes / c.read_bytes_per_s, flops / c.flops_per_s if flops_s is None else flops_s
    return (t_mem, "memory") if t_mem >= t_fl else (t_fl, "compute")


def costs_floor_s(costs: list[tuple[int, Op, int, int]], c: Ceilings) -> tuple[float, str]:
    """floor_s of bucket_costs rows: their bytes over the read ceiling, each op's FLOPs over its own peak."""
    return floor_s(sum(x[2] for x in costs), 0, c, sum(compute_s(x[1], x[3], c) for x in costs))


def bucket_costs(plan, bucket, context: int) -> list[tuple[int, Op, int, int]]:
    """[(index, op, bytes, flops)] for the ops of `bucket` that cost something (costs_something): decode buckets
    with every seq at `context`, prefill buckets as one sequence of num_tokens new tokens ending at
    max(context, num_tokens)."""
    ctx = context if bucket.kind == "decode" else max(context, bucket.num_tokens)
    seqs = bucket.num_seqs if bucket.kind == "decode" else 1
    return [(i, op, op_bytes(op, plan, ctx, seqs), op_flops(op, plan, ctx, seqs))
            for i, op in enumerate(bucket.ops) if costs_something(op)]


def format_roofline(plan, context: int = 128) -> str:
    c = ceilings_for(plan.build.target)
    lines = [f"floor per bucket at context {context} on {c.device} ({c.read_bytes_per_s / 1e12:.2f} TB/s read, "
             f"{c.flops_per_s / 1e12:.0f} TFLOP/s, e4m3 {c.fp8_flops_per_s / 1e12:.0f}; plan target {plan.build.target}"
             f"{f'; one rank of {plan.tensor_parallel}, collectives not counted' if plan.tensor_parallel > 1 else ''})",
             f"{'bucket':<14} {'ops':>4} {'GB':>9} {'GFLOP':>10} {'mem ms':>8} {'flop ms':>8} {'floor ms':>9} "
             f"{'bound':>8} {'tok/s ceiling':>14}"]
    for bk in plan.buckets:
        costs = bucket_costs(plan, bk, context)
        nbytes, flops = sum(x[2] for x in costs), sum(x[3] for x in costs)
        t_fl = sum(compute_s(x[1], x[3], c) for x in costs)
        t, bound = floor_s(nbytes, flops, c, t_fl)
        toks = bk.num_seqs if bk.kind == "decode" else bk.num_tokens
        lines.append(f"{bk.name:<14} {len(costs):>4} {nbytes / 1e9:>9.4f} {flops / 1e9:>10.2f} "
                     f"{nbytes / c.read_bytes_per_s * 1e3:>8.3f} {t_fl * 1e3:>8.3f} "
                     f"{t * 1e3:>9.3f} {bound:>8} {toks / t if t > 0 else 0:>14.0f}")
    return "\n".join(lines)

"""`xserv-aot inspect`: memory map, buckets, op list and the bytes one decode step must read (roofline input)."""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from xserv_aot import kv_cache
from xserv_aot.dtypes import ITEMSIZE
from xserv_aot.errors import UsageError
from xserv_aot.plan.manifest import Plan
from xserv_aot.plan.megakernel_plan import MK_PREFIX
from xserv_aot.plan.roofline import ceilings_for, format_roofline



def decode_step_bytes(plan: Plan, batch: int = 1, context: int = 128) -> dict:
    m, w = plan.model, plan.weights
    weight_bytes = sum(t.nbytes for n, t in w.items() if n not in ("embed_tokens", "rope_cos", "rope_sin"))
    if m.tie_word_embeddings and "lm_head" not in w:       # a sharded plan has its own lm_head slice
        weight_bytes += w["embed_tokens"].nbytes
    elem = ITEMSIZE[plan.kv_cache["dtype"]]
    kv_heads = plan.kv_cache["shape"][4]                     # one rank's under tensor parallelism
    kv_bytes = batch * context * m.num_layers * 2 * kv_heads * m.head_dim * elem
    total = weight_bytes + kv_bytes
    return {"weights": weight_bytes, "kv": kv_bytes, "total": total,
            "roofline_tok_per_s": batch * ceilings_for(plan.build.target).read_bytes_per_s / total}


def describe(plan_dir: Path, ops_bucket: str | None = None, roofline: bool = False, context: int = 128) -> str:
    plan = Plan.load(plan_dir, verify="none")
    if roofline:
        return format_roofline(plan, context)
    m, b = plan.model, plan.build
    mib = lambda n: f"{n / 2**20:10.1f} MiB"
    tp = plan.tensor_parallel
    per_rank = f" per rank, {tp} ranks" if tp > 1 else ""
    lines = [f"plan {plan.dir}  schema {plan.manifest['schema_version']}  source {plan.manifest['source']['path']}",
             f"model {m.arch}: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_heads}/{m.num_kv_heads}"
             f" x {m.head_dim}, ffn {m.intermediate_size}, vocab {m.vocab_size}, tied {m.tie_word_embeddings}",
             f"build: dtype {b.dtype}, target {b.target}, max_seq_len {b.max_seq_len}, block {b.block_size},"
             f" {b.num_blocks} KV blocks, prefill chunk {b.prefill_chunk}",
             "", "memory map:",
             f"  weights   {mib(plan.manifest['weights']['size'])}  ({len(plan.weights)} tensors{per_rank},"
             f" {plan.manifest['weights']['fingerprint'][:23]}...)",
             f"  arena     {mib(plan.arena_size)}  ({len(plan.arena)} buffers)",
             f"  kv cache  {mib(plan.kv_cache['size'])}{' per rank' if tp > 1 else ''}  shape {plan.kv_cache['shape']} {plan.kv_cache['dtype']}",
             kv_line(plan),
             "", "arena buffers:"]
    for name, t in plan.arena.items():
        lines.append(f"  {t.offset:>12}  {name:<16} {str(t.shape):<20} {t.dtype}")
    lines += ["", "buckets:"]
    for bk in plan.buckets:
        kinds = Counter(op.op for op in bk.ops)
        mk = next((op.cuda.kernel for op in bk.ops if op.cuda and op.cuda.kernel.startswith(MK_PREFIX)), None)
        lines.append(f"  {bk.name:<14} {bk.kind:<8} tokens {bk.num_tokens:>5} seqs {bk.num_seqs:>4}  {len(bk.ops)} ops"
                     f"  ({', '.join(f'{k} x{v}' for k, v in kinds.items())})"
                     + (f"  [{mk}]" if mk else "")
                     + (f"  [steps with contexts <= {bk.max_context}]" if bk.max_context else ""))
    lines += fp8_lines(plan, mib)
    lines += ["", f"bytes read per decode step (batch 1{', one rank' if tp > 1 else ''}):"]
    bw = ceilings_for(b.target).read_bytes_per_s
    for ctx in sorted({min(128, b.max_seq_len), min(4096, b.max_seq_len)}):
        d = decode_step_bytes(plan, 1, ctx)
        lines.append(f"  context {ctx:>5}: weights {mib(d['weights'])} + KV {mib(d['kv'])} ="
                     f" {mib(d['total'])} -> roofline {d['roofline_tok_per_s']:.0f} tok/s at {bw / 1e12:.2f} TB/s")
    if ops_bucket:
        bk = next((x for x in plan.buckets if x.name == ops_bucket), None)
        if bk is None:
            raise UsageError(f"no bucket {ops_bucket!r} (have: {', '.join(x.name for x in plan.buckets)})")
        sigs = plan.kernels.get("signatures", {})
        lines += ["", f"ops of {bk.name}:"]
        for i, op in enumerate(bk.ops):
            lines.append(f"  {i:>4} {json.dumps({k: v for k, v in op.to_dict().items() if k != 'cuda'})}")
            if op.cuda:
                facts = {k: v for k, v in op.cuda.to_dict().items() if k not in ("kernel", "launch")}
                lines.append(f"       kernel {op.cuda.kernel}" + (f" {json.dumps(facts)}" if facts else ""))
                lines += [f"       -> {format_launch(rec, sigs.get(rec.fn))}" for rec in op.cuda.launch]
    return "\n".join(lines)


def kv_line(plan: Plan) -> str:
    """KV bytes a token (every layer, K and V) and an FP8 pool's scales."""
    kv = plan.kv_cache
    line = f"            {kv_cache.bytes_per_token(kv)} B a token ({plan.build.kv_cache_dtype})"
    if kv_cache.is_fp8(kv):
        sc = kv["scales"]
        line += (f", scales {sc['source']}: k {min(sc['k']):.3g}..{max(sc['k']):.3g}, "
                 f"v {min(sc['v']):.3g}..{max(sc['v']):.3g}")
    return line


def fp8_lines(plan: Plan, mib) -> list[str]:
    """The FP8 scheme of each quantized weight kind, and the linear weight bytes of one step as stored vs in the
    build dtype."""
    schemes = plan.fp8_schemes
    if not schemes:
        return []
    q = plan.quantization or {}
    kinds = Counter((name.rsplit(".", 1)[-1], scheme) for name, scheme in schemes.items())
    stored = sum(plan.weights[n].nbytes + plan.weights[n + ".scale"].nbytes for n in schemes)
    wide = sum(math.prod(plan.weights[n].shape) * ITEMSIZE[plan.build.dtype] for n in schemes)
    return ["", f"quantization: fp8, {len(schemes)} weights ({len(q.get('from_checkpoint') or [])} stored FP8 by the "
                f"checkpoint), lm_head {'fp8' if 'lm_head' in schemes else plan.build.dtype}"
                + (f", {q['ignored_input_scales']} static input scales ignored" if q.get("ignored_input_scales") else ""),
            *(f"  {kind:<8} {scheme:<13} x{count}" for (kind, scheme), count in sorted(kinds.items())),
            f"  FP8 weights + scales {mib(stored)} per step (as {plan.build.dtype}: {mib(wide)}, "
            f"{wide / stored:.2f}x)"]


def format_launch(rec, params: list[dict] | None) -> str:
    """fn<<<grid, block, smem>>>(param=value, ...) for a kernel; lib:fn(param=value, ...) for a host-library call."""
    names = [p["name"] for p in params or []] + [f"arg{i}" for i in range(len(params or []), len(rec.args))]
    def value(a):
        if a[0] == "tmap":
            return f"tmap({a[1]['buffer']}, box {'x'.join(map(str, a[1]['box']))}, {a[1]['swizzle']})"
        return f"kv[{a[1]}]" if a[0] == "kv" else a[1]
    args = ", ".join(f"{n}={value(a)}" for n, a in zip(names, rec.args))
    if rec.library:
        return f"{rec.library}:{rec.fn}({args})"
    return f"{rec.fn}<<<{rec.grid}, {rec.block}, {rec.smem}>>>({args})"

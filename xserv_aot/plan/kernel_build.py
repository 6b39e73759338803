"""CUDA kernels of a plan: NVRTC-compile kernels/*.cu to cubins (cached by hash of source + options + NVRTC
version), choose one kernel for every op of every bucket and write its launch records (function, geometry and
arguments as data, checked against the parsed kernel signatures), add workspace buffers.

Called by plan.builder when target != "cpu". The runtime (runtime/cuda/launch.py) replays the records as they are:
adding a kernel is a kernel source plus a routing rule here (the bf16 linears' rules: plan/linear_plan.py).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from xserv_aot.plan.kernel_constants import G_MAX, NORM_NC, P_KEYS
from xserv_aot import kv_cache
from xserv_aot.plan.attention_plan import fuses_rope, plan_attention
from xserv_aot.plan.elementwise_plan import QUANTIZING_PRODUCERS, norm_launch, qk_rope_launch, silu_mul_launch
from xserv_aot.plan.fp8_build import NORM_PARTIALS, gemv_blocks, producer_fuses_quantize
from xserv_aot.plan.launch_records import check_launches, i32, kernel, kv, launch, ptr
from xserv_aot.plan.linear_plan import (CUTLASS_MIN_ROWS, GEMM_ENTRY, GEMM_ENTRY_EX, GEMM_SOURCE,  # noqa: F401
                                        GEMV_MAX_ROWS, SKINNY_WIDE_MIN_BLOCKS, SWAP_MIN_ROWS, plan_linear,
                                        plan_skinny)
from xserv_aot.plan.manifest import place
from xserv_aot.plan.megakernel_plan import MK_MAX_SEQS, add_megakernels
from xserv_aot.plan.norm_fold import fold_role, folded_norms
from xserv_aot.plan.nvrtc_build import (KERNEL_DIR, KERNEL_SOURCES, SUPPORTED_TARGETS, KernelBuildError,  # noqa: F401
                                        compile_all, compile_source, expand_source, nvrtc_version)
from xserv_aot.plan import nccl_records
from xserv_aot.plan import row_kernels
from xserv_aot.plan.op_records import (COLLECTIVES, AddRmsNorm, ApplyTokenBitmask, Attention, Embedding, GatherRows,
                                       KernelChoice, Linear, Op, QkNormRopeCache, QuantizeFp8, ResolveInputIds,
                                       RmsNorm, Sample, SiluMul, op_from_dict, read_later)
from xserv_aot.plan.signatures import check_sizes, cubin_param_sizes, host_signature, kernel_signatures
from xserv_aot.plan.tensor_parallel import rank_model

ELEMWISE_THREADS = 256


def add_arena_buffer(manifest: dict, name: str, shape: list[int], dtype: str) -> None:
    """Append a workspace buffer at the end of the arena (existing offsets stay valid)."""
    arena = manifest["arena"]
    if name not in arena["buffers"]:
        info, arena["size"] = place(arena["size"], shape, dtype)
        arena["buffers"][name] = info.to_dict()


def plan_bucket(name: str, kind: str, ops: list[Op], manifest: dict, cutlass: dict | None,
                attn: dict) -> list[KernelChoice]:
    """The kernel choice (with its launch records) of every op of one bucket, in order."""
    m, kvc = rank_model(manifest), manifest["kv_cache"]
    hidden, hd, vocab = m["hidden_size"], m["head_dim"], m["vocab_size"]
    nh, nkv = m["num_heads"], m["num_kv_heads"]
    num_slots, block_size = kv_slots(kvc), kvc["shape"][3]
    arena = manifest["arena"]["buffers"]
    fuse_quantize = bool(manifest["build"].get("fp8_quantize_in_producer"))
    fp8_wgmma = "tma" if manifest["build"].get("fp8_w8a8_tma") else bool(manifest["build"].get("fp8_w8a8_wgmma"))
    gemv = manifest["build"].get("gemv", "cuda_cores")
    row_choice = manifest["build"].get("prefill_row_kernels", "auto")
    row_threads = [min(ELEMWISE_THREADS, hidden // 8)]
    fp8_kv = kv_cache.is_fp8(kvc)
    folded = folded_norms(ops, bool(manifest["build"].get("fold_norm")) and arena["x"]["dtype"] == "bfloat16", gemv)
    if folded and gemv != "tc":
        add_arena_buffer(manifest, NORM_PARTIALS, [GEMV_MAX_ROWS, gemv_blocks(hidden)], "float32")
    out: list[KernelChoice] = []
    for idx, op in enumerate(ops):
        rows, nxt = op.rows, ops[idx + 1] if idx + 1 < len(ops) else None
        after = ops[idx + 2] if idx + 2 < len(ops) else None
        if isinstance(op, ResolveInputIds):
            c = kernel(launch("resolve_input_ids", [-(-rows // ELEMWISE_THREADS)], [ELEMWISE_THREADS], 0,
                              [ptr(op.ids), ptr(op.prev_rows), ptr(op.sampled), i32(rows)]))
        elif isinstance(op, Embedding):
            c = kernel(launch("embedding", [rows], row_threads, 0,
                              [ptr(op.ids), ptr(op.table), ptr(op.out), i32(hidden), i32(vocab)]))
        elif idx in folded:
            c = KernelChoice("fused_into_neighbours")
        elif isinstance(op, (RmsNorm, AddRmsNorm)):
            quant = nxt if producer_fuses_quantize(op, nxt, after, fuse_quantize) else None
            summed = (isinstance(op, AddRmsNorm) and idx > 0 and out[-1].fused_residual == op.residual
                      and getattr(ops[idx - 1], "out", None) == op.delta)
            if row_kernels.uses_rows(row_choice, kind, rows, quant is not None) and row_kernels.norm_rows_fits(hidden):
                c = row_kernels.norm_rows_launch(op, hidden, residual_summed=summed, quant=quant,
                                                 store_out=stores_out(ops, idx, quant))
            else:
                c = norm_launch(op, hidden, residual_summed=summed, quant=quant)
        elif isinstance(op, GatherRows):
            c = kernel(launch("gather_rows", [rows], row_threads, 0,
                              [ptr(op.inp), ptr(op.indices), ptr(op.out), i32(hidden), i32(arena[op.inp]["shape"][0])]))
        elif isinstance(op, SiluMul):
            prev, prev_choice = (ops[idx - 1], out[-1]) if idx else (None, None)
            quant = nxt if producer_fuses_quantize(op, nxt, after, fuse_quantize) else None
            if prev_choice and prev_choice.fused_silu_out == op.out and getattr(prev, "out", None) == op.inp:
                c = KernelChoice("fused_into_previous")
            elif row_kernels.uses_rows(row_choice, kind, rows, quant is not None):
                c = row_kernels.silu_rows_launch(op, quant=quant, store_out=stores_out(ops, idx, quant))
            else:
                c = silu_mul_launch(op, quant=quant)
        elif isinstance(op, Linear) and idx and out[-1].kernel == "fused_into_next" and isinstance(ops[idx - 1],
                                                                                                 QuantizeFp8):
            from xserv_aot.plan.fp8_build import plan_w8a8_skinny
            c = plan_w8a8_skinny(op, arena[op.out]["dtype"], quantized_from=ops[idx - 1].inp)
        elif isinstance(op, Linear):
            fuse = nxt.out if isinstance(nxt, SiluMul) and nxt.inp == op.out else None
            res = (nxt.residual if isinstance(nxt, AddRmsNorm) and nxt.delta == op.out and nxt.rows == rows
                   and not read_later(ops, idx + 2, op.out) else None)
            c = plan_linear(op, arena[op.out]["dtype"], fuse, cutlass, kind == "decode", res, fp8_wgmma,
                            fold_role(ops, idx, folded), gemv)
        elif isinstance(op, QuantizeFp8):
            from xserv_aot.plan.fp8_build import plan_quantize, quantize_fuses_into
            if out[-1].kernel in QUANTIZING_PRODUCERS:
                c = KernelChoice("fused_into_previous")
            elif quantize_fuses_into(op, nxt):
                c = KernelChoice("fused_into_next")
            elif row_kernels.uses_rows(row_choice, kind, rows, True) and row_kernels.quantize_rows_fits(op):
                c = row_kernels.quantize_rows_launch(op)
            else:
                c = plan_quantize(op)
        elif isinstance(op, QkNormRopeCache) and isinstance(nxt, Attention) and fuses_rope(kind, op, nxt):
            c = KernelChoice("fused_into_next")
        elif isinstance(op, QkNormRopeCache) and row_kernels.uses_rows(row_choice, kind, rows):
            c = row_kernels.rope_rows_launch(op, hd, nh, nkv, num_slots, scales=layer_scales(kvc, op.layer))
        elif isinstance(op, QkNormRopeCache):
            c = qk_rope_launch(op, hd, nh, nkv, num_slots, scales=layer_scales(kvc, op.layer))
        elif isinstance(op, Attention):
            rope = ops[idx - 1] if idx and out[-1].kernel == "fused_into_next" else None
            c = plan_attention(op, kind, m, attn, block_size, arena[op.block_tables]["shape"][1], num_slots, rope,
                               layer_scales(kvc, op.layer))
        elif isinstance(op, COLLECTIVES):
            c = nccl_records.plan_collective(op, arena)
        elif isinstance(op, ApplyTokenBitmask):
            c = kernel(launch("apply_token_bitmask", [rows], [ELEMWISE_THREADS], 0,
                              [ptr(op.logits), ptr(op.bitmask), ptr(op.bitmask_rows), i32(op.n)]))
        elif isinstance(op, Sample):
            c = kernel(launch("sample_rows", [rows], [1024], 0,
                              [ptr(op.logits), ptr(op.temperature), ptr(op.top_k), ptr(op.top_p), ptr(op.seeds),
                               ptr(op.sample_offsets), ptr(op.out), ptr("sample_scaled"), i32(vocab)]))
        else:
            raise KernelBuildError(f"bucket {name}: op {op.op!r} has no CUDA kernel")
        out.append(c)
    return out


def layer_scales(kvc: dict, layer: int) -> tuple[float, float] | None:
    """(k, v) scales of a layer of an FP8 KV cache; None for a bf16 one (the kernels' plain variants)."""
    return kv_cache.layer_scales(kvc, layer) if kv_cache.is_fp8(kvc) else None


def megakernels(manifest: dict, records: dict, choices: dict) -> dict:
    """The decode megakernel where the build asks for it (plan/megakernel_plan.py), except over an FP8 KV cache:
    it reads bf16 KV only, so those buckets keep their per-op kernels (-> {bucket: why})."""
    if kv_cache.is_fp8(manifest["kv_cache"]) and manifest["build"].get("megakernel_sms"):
        return {bk["name"]: "FP8 KV cache (the megakernel reads a bf16 cache)" for bk in manifest["buckets"]
                if bk["kind"] == "decode" and bk["num_seqs"] <= MK_MAX_SEQS}
    return add_megakernels(manifest, records, choices, kv_slots(manifest["kv_cache"]), add_arena_buffer)


def under_pdl(choice: KernelChoice, waits: set[str]) -> KernelChoice:
    """A PDL bucket (pdl_bucket): every kernel record whose function waits for its predecessor (griddepcontrol.wait
    in its PTX, kernels/common.cuh pdl_entry; nvrtc_build.pdl_waiters) is launched under programmatic dependent
    launch. The megakernel never waits, so it never is; library entry points are in no cubin, so never either (they
    launch their own kernels)."""
    recs = tuple(replace(r, pdl=True) if r.fn in waits else r for r in choice.launch)
    return replace(choice, launch=recs)


def pdl_bucket(build: dict, bucket: dict) -> bool:
    """Whether a bucket launches its waiting kernels under PDL: build.pdl, every bucket; build.pdl_max_seqs N, decode
    buckets of at most N sequences (where PDL measured faster: docs/cuda-notes.md, session 24)."""
    return bool(build.get("pdl")) or (bucket["kind"] == "decode"
                                      and bucket["num_seqs"] <= int(build.get("pdl_max_seqs", 0)))


def check_pdl(launches: list, waits: set[str]) -> None:
    """A record launched under PDL may start while its predecessor still writes: its function must wait."""
    early = sorted({rec.fn for _, rec in launches if rec.pdl and rec.fn not in waits})
    if early:
        raise KernelBuildError(f"launched under PDL but never waits for its predecessor: {', '.join(early)}")


def stores_out(ops: list[Op], idx: int, quant: QuantizeFp8 | None) -> bool:
    """Whether producer ops[idx] stores its bf16 output: it quantizes nothing, or an op after the quantize_fp8 it
    folds (ops[idx + 1]) reads that output."""
    return quant is None or read_later(ops, idx + 2, ops[idx].out)


def kv_slots(kv: dict) -> int:
    """Slots of the paged KV cache: kv_cache.shape is [L, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
    return int(kv["shape"][2]) * int(kv["shape"][3])


def check_model(manifest: dict) -> None:
    m, b = rank_model(manifest), manifest["build"]
    if b["dtype"] != "bfloat16":
        raise KernelBuildError(f"CUDA kernels need build dtype bfloat16, got {b['dtype']!r} (use --dtype bfloat16)")
    if m["head_dim"] not in (64, 128):
        raise KernelBuildError(f"CUDA attention supports head_dim 64 or 128, got {m['head_dim']}")
    if m["num_heads"] // m["num_kv_heads"] > G_MAX:
        raise KernelBuildError(f"CUDA decode attention supports up to {G_MAX} query heads per kv head, "
                               f"got {m['num_heads'] // m['num_kv_heads']}")
    for f in ("hidden_size", "intermediate_size"):
        if m[f] % 8:
            raise KernelBuildError(f"CUDA kernels need {f} % 8 == 0, got {m[f]}")
    if m["hidden_size"] > 1024 * 8 * NORM_NC:
        raise KernelBuildError(f"CUDA row norms support hidden_size <= {1024 * 8 * NORM_NC}, got {m['hidden_size']}")


def try_cutlass(manifest: dict, out_dir: Path, target: str, progress) -> tuple[dict | None, str]:
    """(the CUTLASS library build, or None, and why not)."""
    if not manifest["build"].get("gemm_library", True):
        return None, "off in the build config"
    if not any(int(op.get("rows", 0)) >= (SWAP_MIN_ROWS if bk["kind"] == "decode" else CUTLASS_MIN_ROWS)
               for bk in manifest["buckets"] for op in bk["ops"] if op["op"] == "linear"):
        return None, f"no linear has {CUTLASS_MIN_ROWS}+ rows"
    try:
        from xserv_aot.plan.cutlass_build import GemmBuildError, build_gemm_library
    except ImportError as e:
        return None, f"not importable ({e})"
    try:
        lib = build_gemm_library(out_dir, target, progress=(lambda msg: progress("gemm", 0, 1)) if progress else None)
    except GemmBuildError as e:
        return None, str(e)
    lib["path"] = out_dir / lib["file"]
    lib["table"] = manifest["build"].get("gemm_configs") or {}
    lib["residual"] = bool(manifest["build"].get("gemm_residual"))
    return lib, ""


def build_kernels(manifest: dict, out_dir: Path, target: str, progress: Callable | None = None) -> dict:
    """Choose every op's kernel (its `cuda` entry, next to the op), add workspaces, write cubins; return the
    kernels section."""
    if target not in SUPPORTED_TARGETS:
        raise KernelBuildError(f"unsupported CUDA target {target!r} (supported: {', '.join(SUPPORTED_TARGETS)})")
    from xserv_aot.runtime.select import CUDA_EXTRA_HINT, cuda_python_available
    if not cuda_python_available():
        raise KernelBuildError(f"target {target} needs cuda-python to build kernels ({CUDA_EXTRA_HINT}); "
                               f"or compile with --target cpu")
    check_model(manifest)
    out_dir = Path(out_dir)
    m, b = rank_model(manifest), manifest["build"]
    cubins = compile_all(out_dir, target, progress)
    cutlass, why_not = try_cutlass(manifest, out_dir, target, progress)
    attn = {"split": P_KEYS, "splits": -(-b["max_seq_len"] // P_KEYS), "max_seq_len": b["max_seq_len"],
            "prefill": b.get("prefill_attention", "auto")}
    if attn["splits"] > 1024:
        raise KernelBuildError(f"max_seq_len {b['max_seq_len']} needs {attn['splits']} decode splits (max 1024)")
    records = {bk["name"]: [op_from_dict(op, f"bucket {bk['name']} op {i}") for i, op in enumerate(bk["ops"])]
               for bk in manifest["buckets"]}
    choices = {bk["name"]: plan_bucket(bk["name"], bk["kind"], records[bk["name"]], manifest, cutlass, attn)
               for bk in manifest["buckets"]}
    mk_skipped = megakernels(manifest, records, choices)
    waits = {fn for c in cubins.values() for fn in c["pdl_waits"]}
    for bk in manifest["buckets"]:
        if pdl_bucket(b, bk):
            choices[bk["name"]] = [under_pdl(c, waits) for c in choices[bk["name"]]]
    signatures = {fn: p for src in KERNEL_SOURCES for fn, p in kernel_signatures(src).items()}
    for c in cubins.values():
        for fn, sizes in cubin_param_sizes((out_dir / c["file"]).read_bytes()).items():
            check_sizes(fn, signatures.get(fn, []), sizes)
    if cutlass is not None:
        for entry in (GEMM_ENTRY, GEMM_ENTRY_EX):
            signatures[entry] = host_signature(GEMM_SOURCE, entry)
        from xserv_aot.plan.fp8_build import host_signatures
        signatures.update(host_signatures())
    nh, hd = m["num_heads"], m["head_dim"]
    # partials [num_seqs, nh, splits, ..] of every decode attention kernel a plan launches (attention_plan.py)
    part_rows = max([op.num_seqs * c.splits for name, ops in records.items() for op, c in zip(ops, choices[name])
                     if isinstance(op, Attention)] or [1])
    add_arena_buffer(manifest, "attn_part_o", [part_rows, nh, hd], "float32")
    add_arena_buffer(manifest, "attn_part_ml", [part_rows, nh, 2], "float32")
    add_arena_buffer(manifest, "attn_counters", [b["max_num_seqs"], m["num_kv_heads"]], "int32")  # zeroed at start
    add_arena_buffer(manifest, "sample_scaled", [b["max_num_seqs"], m["vocab_size"]], "float32")
    ws = max([c.splits * op.rows * op.n for name, ops in records.items() for op, c in zip(ops, choices[name])
              if c.kernel == "gemm_64x64_splitk"] or [0])
    if ws:
        add_arena_buffer(manifest, "gemm_splitk_ws", [ws], "float32")
    if cutlass is not None and cutlass.get("workspace"):
        add_arena_buffer(manifest, "gemm_ws", [-(-cutlass["workspace"] // 4)], "int32")
    collectives = nccl_records.add_collectives(manifest, m, signatures, add_arena_buffer)
    launches = [(name, rec) for name, cs in choices.items() for c in cs for rec in c.launch]
    check_launches(manifest, launches, signatures)
    check_pdl(launches, waits)
    used = sorted({rec.fn for _, rec in launches})
    for bk in manifest["buckets"]:
        bk["ops"] = [replace(op, cuda=c).to_dict() for op, c in zip(records[bk["name"]], choices[bk["name"]])]
    section = {"target": target, "nvrtc": nvrtc_version(), "cubins": cubins,
               "functions": {fn: name for name, c in cubins.items() for fn in c["functions"]},
               "signatures": {fn: signatures[fn] for fn in used},
               "attention": attn, "gemm_library": None, "gemm_library_skipped": why_not or None, "gemm_configs": {}}
    section.update({"collectives": collectives} if collectives else {})
    section.update({"megakernel_skipped": mk_skipped} if mk_skipped else {})
    if cutlass is not None:
        section["gemm_library"] = {k: cutlass[k] for k in ("file", "hash", "configs", "build_key") if k in cutlass}
        section["gemm_configs"] = cutlass.get("used", {})
    return section

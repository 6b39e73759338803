"""CUDA kernels of a plan: NVRTC-compile kernels/*.cu to cubins (cached by hash of source + options + NVRTC
version), choose one kernel for every op of every bucket and write its launch records (function, geometry and
arguments as data, checked against the parsed kernel signatures), add workspace buffers.

Called by plan.builder when target != "cpu". The runtime (runtime/cuda/launch.py) replays the records as they are:
adding a kernel is a kernel source plus a routing rule here.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from xserv_aot.plan.kernel_constants import G_MAX, NORM_NC, P_KEYS, gemm_smem, skinny_smem
from xserv_aot.plan.attention_plan import fuses_rope, plan_attention
from xserv_aot.plan.launch_records import check_launches, f32, i32, kernel, kv, launch, library_call, ptr
from xserv_aot.plan.manifest import place
from xserv_aot.plan.nvrtc_build import (KERNEL_DIR, KERNEL_SOURCES, SUPPORTED_TARGETS, KernelBuildError,  # noqa: F401
                                        compile_all, compile_source, expand_source, nvrtc_version)
from xserv_aot.plan import nccl_records
from xserv_aot.plan.op_records import (COLLECTIVES, AddRmsNorm, ApplyTokenBitmask, Attention, Embedding, GatherRows,
                                       KernelChoice, Linear, Op, QkNormRopeCache, QuantizeFp8, ResolveInputIds,
                                       RmsNorm, Sample, SiluMul, op_from_dict)
from xserv_aot.plan.signatures import check_sizes, cubin_param_sizes, host_signature, kernel_signatures
from xserv_aot.plan.tensor_parallel import rank_model

GEMV_MAX_ROWS = 2            # above this the x re-reads make the GEMV L1/ALU-bound: tensor cores instead
CUTLASS_MIN_ROWS = 128
SKINNY_MAX_ROWS = 64         # decode rows 3..64: kernels/gemm_skinny.cu (weights streamed once, tensor cores)
SKINNY_WIDE_MIN_BLOCKS = 264 # 64-row blocks (half the activation re-reads) only when they still fill 2 per SM
SKINNY_FUSE_GATE = False     # gate_up + silu_mul in one skinny kernel (tests/test_kernel_build.py expects it off)
SPLITK_TARGET_BLOCKS = 264   # 2 blocks per SM on 132 SMs
SPLITK_MAX = 8
ELEMWISE_THREADS = 256
SWAP_MIN_ROWS = 16           # decode rows 16..256: CUTLASS GEMMs by decode_gemm_route (cutlass_build.SWAP_CONFIGS)
GEMM_ENTRY = "xserv_gemm_bf16"   # the CUTLASS library's C entry points (kernels/cutlass/gemm_sm90.cu)
GEMM_ENTRY_EX = "xserv_gemm_bf16_ex"   # ... with splits and a workspace (the swap-AB decode configs)
GEMM_SOURCE = KERNEL_DIR / "cutlass" / "gemm_sm90.cu"
FP8_KERNELS = True           # FP8 linears and quantize_fp8 route to plan/fp8_build.py (plan.builder checks it)


def add_arena_buffer(manifest: dict, name: str, shape: list[int], dtype: str) -> None:
    """Append a workspace buffer at the end of the arena (existing offsets stay valid)."""
    arena = manifest["arena"]
    if name not in arena["buffers"]:
        info, arena["size"] = place(arena["size"], shape, dtype)
        arena["buffers"][name] = info.to_dict()


def linear_args(op: Linear, fused_silu_out: str | None = None) -> list:
    """(X, W, bias, out, M, N, K) of the GEMV/GEMM kernels; fused: (X, W, silu_out, M, I, K)."""
    if fused_silu_out:
        return [ptr(op.inp), ptr(op.weight), ptr(fused_silu_out), i32(op.rows), i32(op.n // 2), i32(op.k)]
    return [ptr(op.inp), ptr(op.weight), ptr(op.bias), ptr(op.out), i32(op.rows), i32(op.n), i32(op.k)]


def plan_skinny(op: Linear, suffix: str, fuse_into: str | None, bn: int | None = None) -> KernelChoice:
    """Rows 3..64: one block per 32 (or 64) weight rows, all of K split over its 8 warps (kernels/gemm_skinny.cu).
    bn: force the block width (tests); by default 64 only where that still gives SKINNY_WIDE_MIN_BLOCKS blocks."""
    mt = next(m for m in (8, 16, 32, 64) if m >= op.rows)
    bn = bn or (64 if -(-op.n // 64) >= SKINNY_WIDE_MIN_BLOCKS else 32)
    if fuse_into:
        fn, grid = f"skinny{bn}_gate_m{mt}", -(-(op.n // 2) // (bn // 2))
    else:
        fn, grid = f"skinny{bn}_m{mt}_{suffix}", -(-op.n // bn)
    return kernel(launch(fn, [grid], [256], skinny_smem(mt), linear_args(op, fuse_into)), fused_silu_out=fuse_into)


def swap_splits(n: int, k: int, width: int) -> int:
    """CUTLASS scheduler mode of a swap-AB decode GEMM (H200 sweep, docs/cuda-notes.md): split-K 4 for the long
    K of down_proj; data-parallel (1) when 128-row weight tiles alone fill the SMs and the tile is narrow;
    otherwise stream-K (0) over every SM."""
    if k >= 8192:
        return 4
    return 1 if -(-n // 128) >= 132 and width <= 64 else 0


def decode_gemm_route(rows: int, n: int, k: int, out_dtype: str) -> str:
    """skinny (NVRTC, small weights, few rows) | tile (CUTLASS data-parallel tiles) | swap (CUTLASS swap-AB)."""
    small = n <= 8192 and k <= 4096 and out_dtype == "bfloat16"          # qkv / o_proj shapes
    if rows < SWAP_MIN_ROWS or (small and rows <= 32):
        return "skinny"
    if rows > 128 and k <= 4096 and out_dtype == "bfloat16":
        return "tile"
    return "swap"


def plan_swap(op: Linear, out_dtype: str, cutlass: dict) -> KernelChoice:
    """Decode rows on the N side of a CUTLASS tile, the weights on its 128-wide M side; the call's stream-K /
    split-K scratch is the arena's gemm_ws (sized in build_kernels to the largest call)."""
    from xserv_aot.plan.cutlass_build import SWAP_CONFIGS, library_workspace_size
    rows, n, k = op.rows, op.n, op.k
    widths = SWAP_CONFIGS[out_dtype]
    width = next(w for w in sorted(widths) if w >= rows)
    cfg, splits = widths[width], swap_splits(n, k, width)
    ws = library_workspace_size(cutlass["path"], cfg, rows, n, k, splits)
    cutlass["workspace"] = max(cutlass.get("workspace", 0), ws)
    cutlass.setdefault("used", {})[f"{rows}x{n}x{k}"] = cutlass["configs"][cfg]
    call = library_call("gemm_library", GEMM_ENTRY_EX,
                        [i32(cfg), ptr(op.inp), ptr(op.weight), ptr(op.out), ptr(op.bias), i32(rows), i32(n), i32(k),
                         i32(splits), ptr("gemm_ws" if ws else None), ("u64", ws)])
    return KernelChoice("cutlass", (call,), gemm_config=cfg, splits=splits)


def plan_linear(op: Linear, out_dtype: str, fuse_into: str | None, cutlass: dict | None,
                decode: bool = False) -> KernelChoice:
    """fuse_into: the silu_mul output buffer when the next op is silu_mul of this op's output."""
    rows, n, k = op.rows, op.n, op.k
    if op.quant:
        from xserv_aot.plan.fp8_build import plan_fp8_linear
        return plan_fp8_linear(op, out_dtype, fuse_into, cutlass)
    if k % 8 or n % 2:
        raise KernelBuildError(f"linear {op.weight}: n={n}, k={k} (CUDA kernels need k % 8 == 0, n even)")
    suffix = "f32" if out_dtype == "float32" else "bf16"
    if rows <= GEMV_MAX_ROWS:
        mt = next(m for m in (1, 2, 4, 8) if m >= rows)
        if fuse_into:
            return kernel(launch(f"gemv_gate_m{mt}", [-(-(n // 2) // 8)], [256], 0, linear_args(op, fuse_into)),
                          fused_silu_out=fuse_into)
        return kernel(launch(f"gemv_m{mt}_{suffix}", [-(-n // 16)], [256], 0, linear_args(op)))
    route = decode_gemm_route(rows, n, k, out_dtype) if decode and cutlass is not None and n % 8 == 0 else None
    if route == "swap":
        return plan_swap(op, out_dtype, cutlass)
    if decode and rows <= SKINNY_MAX_ROWS and route in (None, "skinny"):
        return plan_skinny(op, suffix, fuse_into if SKINNY_FUSE_GATE else None)
    if cutlass is not None and (rows >= CUTLASS_MIN_ROWS or route == "tile") and n % 8 == 0:
        from xserv_aot.plan.cutlass_build import CFG_128x128, choose_gemm_config
        cfg = CFG_128x128 if route == "tile" else choose_gemm_config(rows, n, k, out_dtype)   # tile: H200 sweep
        cutlass.setdefault("used", {})[f"{rows}x{n}x{k}"] = cutlass["configs"][cfg]
        call = library_call("gemm_library", GEMM_ENTRY, [i32(cfg), ptr(op.inp), ptr(op.weight), ptr(op.out),
                                                         ptr(op.bias), i32(rows), i32(n), i32(k)])
        return KernelChoice("cutlass", (call,), gemm_config=cfg)
    tile = "128x128" if rows >= 128 and -(-rows // 128) * -(-n // 128) >= 132 else "64x64"
    bm, bn = (int(x) for x in tile.split("x"))
    blocks = -(-n // bn) * -(-rows // bm)
    splits = min(SPLITK_MAX, -(-SPLITK_TARGET_BLOCKS // blocks), max(1, k // 32 // 8))
    if tile == "64x64" and splits > 1:
        ws = "gemm_splitk_ws"
        return KernelChoice("gemm_64x64_splitk", (
            launch("gemm_64x64_splitk", [-(-n // bn), -(-rows // bm), splits], [128], gemm_smem(tile),
                   [ptr(op.inp), ptr(op.weight), ptr(None), ptr(ws), i32(rows), i32(n), i32(k)]),
            launch("splitk_reduce", [min(-(-rows * n // 2 // 256), 4096)], [256], 0,
                   [ptr(ws), ptr(op.bias), ptr(op.out), i32(rows), i32(n), i32(splits), i32(out_dtype == "float32")])),
            splits=splits)
    return kernel(launch(f"gemm_{tile}_{suffix}", [-(-n // bn), -(-rows // bm)], [256 if bm == 128 else 128],
                         gemm_smem(tile), linear_args(op)))


def norm_threads(hidden: int) -> int:
    return min(1024, -(-(hidden // 8) // 32) * 32)


def plan_bucket(name: str, kind: str, ops: list[Op], manifest: dict, cutlass: dict | None,
                attn: dict) -> list[KernelChoice]:
    """The kernel choice (with its launch records) of every op of one bucket, in order."""
    m, kvc = rank_model(manifest), manifest["kv_cache"]
    hidden, hd, vocab = m["hidden_size"], m["head_dim"], m["vocab_size"]
    nh, nkv = m["num_heads"], m["num_kv_heads"]
    num_slots, block_size = kv_slots(kvc), kvc["shape"][3]
    arena = manifest["arena"]["buffers"]
    row_threads = [min(ELEMWISE_THREADS, hidden // 8)]
    out: list[KernelChoice] = []
    for idx, op in enumerate(ops):
        rows, nxt = op.rows, ops[idx + 1] if idx + 1 < len(ops) else None
        if isinstance(op, ResolveInputIds):
            c = kernel(launch("resolve_input_ids", [-(-rows // ELEMWISE_THREADS)], [ELEMWISE_THREADS], 0,
                              [ptr(op.ids), ptr(op.prev_rows), ptr(op.sampled), i32(rows)]))
        elif isinstance(op, Embedding):
            c = kernel(launch("embedding", [rows], row_threads, 0,
                              [ptr(op.ids), ptr(op.table), ptr(op.out), i32(hidden), i32(vocab)]))
        elif isinstance(op, RmsNorm):
            c = kernel(launch("rmsnorm", [rows], [norm_threads(hidden)], 0,
                              [ptr(op.inp), ptr(op.weight), ptr(op.out), i32(hidden), f32(op.eps)]))
        elif isinstance(op, AddRmsNorm):
            c = kernel(launch("add_rmsnorm", [rows], [norm_threads(hidden)], 0,
                              [ptr(op.residual), ptr(op.delta), ptr(op.weight), ptr(op.out), i32(hidden),
                               f32(op.eps)]))
        elif isinstance(op, GatherRows):
            c = kernel(launch("gather_rows", [rows], row_threads, 0,
                              [ptr(op.inp), ptr(op.indices), ptr(op.out), i32(hidden), i32(arena[op.inp]["shape"][0])]))
        elif isinstance(op, SiluMul):
            prev, prev_choice = (ops[idx - 1], out[-1]) if idx else (None, None)
            if prev_choice and prev_choice.fused_silu_out == op.out and getattr(prev, "out", None) == op.inp:
                c = KernelChoice("fused_into_previous")
            else:
                c = kernel(launch("silu_mul", [min(-(-(rows * op.inter // 8) // 256), 4096)], [256], 0,
                                  [ptr(op.inp), ptr(op.out), i32(rows), i32(op.inter)]))
        elif isinstance(op, Linear):
            fuse = nxt.out if isinstance(nxt, SiluMul) and nxt.inp == op.out else None
            c = plan_linear(op, arena[op.out]["dtype"], fuse, cutlass, kind == "decode")
        elif isinstance(op, QuantizeFp8):
            from xserv_aot.plan.fp8_build import plan_quantize
            c = plan_quantize(op)
        elif isinstance(op, QkNormRopeCache) and isinstance(nxt, Attention) and fuses_rope(kind, op, nxt):
            c = KernelChoice("fused_into_next")
        elif isinstance(op, QkNormRopeCache):
            c = kernel(launch(f"qk_norm_rope_cache_hd{hd}", [rows, -(-(nh + 2 * nkv) // 4)], [128], 0,
                              [ptr(op.qkv), ptr(op.positions), ptr(op.slot_mapping), ptr(op.q_norm), ptr(op.k_norm),
                               ptr(op.cos), ptr(op.sin), ptr(op.q_out), kv(op.layer), i32(nh), i32(nkv), f32(op.eps),
                               i32(num_slots)]))
        elif isinstance(op, Attention):
            rope = ops[idx - 1] if idx and out[-1].kernel == "fused_into_next" else None
            c = plan_attention(op, kind, m, attn, block_size, arena[op.block_tables]["shape"][1], num_slots, rope)
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
    attn = {"split": P_KEYS, "splits": -(-b["max_seq_len"] // P_KEYS), "max_seq_len": b["max_seq_len"]}
    if attn["splits"] > 1024:
        raise KernelBuildError(f"max_seq_len {b['max_seq_len']} needs {attn['splits']} decode splits (max 1024)")
    records = {bk["name"]: [op_from_dict(op, f"bucket {bk['name']} op {i}") for i, op in enumerate(bk["ops"])]
               for bk in manifest["buckets"]}
    choices = {bk["name"]: plan_bucket(bk["name"], bk["kind"], records[bk["name"]], manifest, cutlass, attn)
               for bk in manifest["buckets"]}
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
    # partials: [rows, nh, splits, ..] (split-KV kernel), [num_seqs, nh, splits, ..] (batched kernels)
    part_rows = max([(op.num_seqs if any(r.fn.startswith(("attn_decode_b", "attn_decode_tc", "attn_decode_fused"))
                                         for r in c.launch)
                      else op.rows) * c.splits
                     for name, ops in records.items() for op, c in zip(ops, choices[name]) if isinstance(op, Attention)]
                    or [1])
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
    used = sorted({rec.fn for _, rec in launches})
    for bk in manifest["buckets"]:
        bk["ops"] = [replace(op, cuda=c).to_dict() for op, c in zip(records[bk["name"]], choices[bk["name"]])]
    section = {"target": target, "nvrtc": nvrtc_version(), "cubins": cubins,
               "functions": {fn: name for name, c in cubins.items() for fn in c["functions"]},
               "signatures": {fn: signatures[fn] for fn in used},
               "attention": attn, "gemm_library": None, "gemm_library_skipped": why_not or None, "gemm_configs": {}}
    section.update({"collectives": collectives} if collectives else {})
    if cutlass is not None:
        section["gemm_library"] = {k: cutlass[k] for k in ("file", "hash", "configs", "build_key") if k in cutlass}
        section["gemm_configs"] = cutlass.get("used", {})
    return section

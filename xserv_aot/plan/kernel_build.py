"""CUDA kernels of a plan: NVRTC-compile kernels/*.cu to cubins (cached by hash of source + options + NVRTC
version), choose one kernel (and its launch geometry) for every op of every bucket, add workspace buffers.

Called by plan.builder when target != "cpu". The runtime (runtime/cuda/launch.py) turns each op's
`launch` entries into kernel arguments; the geometry is decided here so the manifest shows what runs.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from xserv_aot.plan.nvrtc_build import (KERNEL_DIR, KERNEL_SOURCES, SUPPORTED_TARGETS, KernelBuildError,  # noqa: F401
                                        compile_all, compile_source, expand_source, nvrtc_version)

GEMV_MAX_ROWS = 2            # above this the x re-reads make the GEMV L1/ALU-bound: tensor cores instead
CUTLASS_MIN_ROWS = 128
SKINNY_MAX_ROWS = 64         # decode rows 3..64: kernels/gemm_skinny.cu (weights streamed once, tensor cores)
SKINNY_WIDE_MIN_BLOCKS = 264 # 64-row blocks (half the activation re-reads) only when they still fill 2 per SM
SKINNY_STAGES = 3            # SK_STAGES in kernels/gemm_skinny.cu (64-k steps of 4 KB a warp)
SKINNY_FUSE_GATE = False     # gate_up + silu_mul in one skinny kernel (tests/test_kernel_build.py expects it off)
SPLITK_TARGET_BLOCKS = 264   # 2 blocks per SM on 132 SMs
SPLITK_MAX = 8
DECODE_SPLIT = 128            # keys per split-KV partition: P_KEYS in kernels/attention_decode.cu
ELEMWISE_THREADS = 256


def add_arena_buffer(manifest: dict, name: str, shape: list[int], dtype: str, align: int = 256) -> None:
    """Append a workspace buffer at the end of the arena (existing offsets stay valid)."""
    itemsize = {"bfloat16": 2, "float32": 4, "int32": 4, "int64": 8}[dtype]
    arena = manifest["arena"]
    if name in arena["buffers"]:
        return
    off = -(-int(arena["size"]) // align) * align
    n = 1
    for s in shape:
        n *= int(s)
    arena["buffers"][name] = {"offset": off, "shape": [int(s) for s in shape], "dtype": dtype}
    arena["size"] = off + -(-n * itemsize // align) * align


def launch(fn: str, grid, block, smem: int = 0) -> dict:
    g = list(grid) + [1] * (3 - len(grid))
    b = list(block) + [1] * (3 - len(block))
    return {"fn": fn, "grid": [int(x) for x in g], "block": [int(x) for x in b], "smem": int(smem)}


def gemm_smem(tile: str) -> int:
    bm, bn = (int(x) for x in tile.split("x"))
    stages = 3 if bm == 128 else 4
    return stages * (bm + bn) * 40 * 2


def plan_skinny(op: dict, suffix: str, fuse_into: str | None, bn: int | None = None) -> None:
    """Rows 3..64: one block per 32 (or 64) weight rows, all of K split over its 8 warps (kernels/gemm_skinny.cu).
    bn: force the block width (tests); by default 64 only where that still gives SKINNY_WIDE_MIN_BLOCKS blocks."""
    rows, n = int(op["rows"]), int(op["n"])
    mt = next(m for m in (8, 16, 32, 64) if m >= rows)
    bn = bn or (64 if -(-n // 64) >= SKINNY_WIDE_MIN_BLOCKS else 32)
    smem = max(8 * SKINNY_STAGES * 4096, 8 * 2 * (mt // 8) * 4 * 32 * 4)   # weight rings / partial sums
    if fuse_into:
        op["fused_silu_out"] = fuse_into
        fn, grid = f"skinny{bn}_gate_m{mt}", -(-(n // 2) // (bn // 2))
    else:
        fn, grid = f"skinny{bn}_m{mt}_{suffix}", -(-n // bn)
    op["launch"] = [launch(fn, [grid], [256], smem)]
    op["kernel"] = fn


def plan_linear(op: dict, out_dtype: str, fuse_into: str | None, cutlass: dict | None, decode: bool = False) -> None:
    """fuse_into: the silu_mul output buffer when the next op is silu_mul of this op's output."""
    rows, n, k = int(op["rows"]), int(op["n"]), int(op["k"])
    if k % 8 or n % 2:
        raise KernelBuildError(f"linear {op['weight']}: n={n}, k={k} (CUDA kernels need k % 8 == 0, n even)")
    suffix = "f32" if out_dtype == "float32" else "bf16"
    if rows <= GEMV_MAX_ROWS:
        mt = next(m for m in (1, 2, 4, 8) if m >= rows)
        if fuse_into:
            inter = n // 2
            op["fused_silu_out"] = fuse_into
            op["launch"] = [launch(f"gemv_gate_m{mt}", [-(-inter // 8)], [256])]
        else:
            op["launch"] = [launch(f"gemv_m{mt}_{suffix}", [-(-n // 16)], [256])]
        op["kernel"] = op["launch"][0]["fn"]
        return
    if decode and rows <= SKINNY_MAX_ROWS:
        plan_skinny(op, suffix, fuse_into if SKINNY_FUSE_GATE else None)
        return
    if cutlass is not None and rows >= CUTLASS_MIN_ROWS and n % 8 == 0:
        from xserv_aot.plan.cutlass_build import choose_gemm_config
        cfg = choose_gemm_config(rows, n, k, out_dtype)
        op["kernel"] = "cutlass"
        op["gemm_config"] = cfg
        op["launch"] = []
        cutlass.setdefault("used", {})[f"{rows}x{n}x{k}"] = cutlass["configs"][cfg]
        return
    tile = "128x128" if rows >= 128 and -(-rows // 128) * -(-n // 128) >= 132 else "64x64"
    bm, bn = (int(x) for x in tile.split("x"))
    blocks = -(-n // bn) * -(-rows // bm)
    splits = min(SPLITK_MAX, -(-SPLITK_TARGET_BLOCKS // blocks), max(1, k // 32 // 8))
    if tile == "64x64" and splits > 1:
        op["launch"] = [launch("gemm_64x64_splitk", [-(-n // bn), -(-rows // bm), splits], [128], gemm_smem(tile)),
                        launch("splitk_reduce", [min(-(-rows * n // 2 // 256), 4096)], [256])]
        op["splits"] = splits
        op["kernel"] = "gemm_64x64_splitk"
        return
    fn = f"gemm_{tile}_{suffix}"
    op["launch"] = [launch(fn, [-(-n // bn), -(-rows // bm)], [256 if bm == 128 else 128], gemm_smem(tile))]
    op["kernel"] = fn


def norm_threads(hidden: int) -> int:
    return min(1024, -(-(hidden // 8) // 32) * 32)


def plan_bucket(bucket: dict, manifest: dict, cutlass: dict | None, attn: dict) -> None:
    m = manifest["model"]
    hidden, hd = m["hidden_size"], m["head_dim"]
    arena = manifest["arena"]["buffers"]
    ops = bucket["ops"]
    for idx, op in enumerate(ops):
        kind, rows = op["op"], int(op.get("rows", 0))
        if kind == "embedding":
            op["launch"] = [launch("embedding", [rows], [min(ELEMWISE_THREADS, hidden // 8)])]
        elif kind in ("rmsnorm", "add_rmsnorm"):
            op["launch"] = [launch(kind, [rows], [norm_threads(hidden)])]
        elif kind == "gather_rows":
            op["launch"] = [launch("gather_rows", [rows], [min(ELEMWISE_THREADS, hidden // 8)])]
        elif kind == "silu_mul":
            prev = ops[idx - 1] if idx else {}
            if prev.get("fused_silu_out") == op["out"] and prev.get("out") == op["inp"]:
                op["launch"] = []
                op["kernel"] = "fused_into_previous"
                continue
            chunks = rows * int(op["inter"]) // 8
            op["launch"] = [launch("silu_mul", [min(-(-chunks // 256), 4096)], [256])]
        elif kind == "linear":
            nxt = ops[idx + 1] if idx + 1 < len(ops) else {}
            fuse = nxt["out"] if nxt.get("op") == "silu_mul" and nxt.get("inp") == op["out"] else None
            plan_linear(op, arena[op["out"]]["dtype"], fuse, cutlass, bucket["kind"] == "decode")
            continue
        elif kind == "qk_norm_rope_cache":
            heads = m["num_heads"] + 2 * m["num_kv_heads"]
            op["launch"] = [launch(f"qk_norm_rope_cache_hd{hd}", [rows, -(-heads // 4)], [128])]
        elif kind == "attention":
            if bucket["kind"] == "decode":
                s_max = attn["splits"]
                op["launch"] = [launch(f"attn_decode_hd{hd}", [op["num_seqs"], m["num_kv_heads"], s_max], [128])]
                op["split"] = attn["split"]
                op["splits"] = s_max
            else:
                op["launch"] = [launch(f"attn_prefill_hd{hd}", [-(-rows // 64) + op["num_seqs"], m["num_heads"]],
                                       [128])]
        elif kind == "apply_token_bitmask":
            op["launch"] = [launch("apply_token_bitmask", [rows], [ELEMWISE_THREADS])]
        elif kind == "sample":
            op["launch"] = [launch("sample_rows", [rows], [1024])]
        else:
            raise KernelBuildError(f"bucket {bucket['name']}: op {kind!r} has no CUDA kernel")
        op["kernel"] = op["launch"][0]["fn"]


def check_model(manifest: dict) -> None:
    m, b = manifest["model"], manifest["build"]
    if b["dtype"] != "bfloat16":
        raise KernelBuildError(f"CUDA kernels need build dtype bfloat16, got {b['dtype']!r} (use --dtype bfloat16)")
    if m["head_dim"] not in (64, 128):
        raise KernelBuildError(f"CUDA attention supports head_dim 64 or 128, got {m['head_dim']}")
    if m["num_heads"] // m["num_kv_heads"] > 8:
        raise KernelBuildError(f"CUDA decode attention supports up to 8 query heads per kv head, "
                               f"got {m['num_heads'] // m['num_kv_heads']}")
    for f in ("hidden_size", "intermediate_size"):
        if m[f] % 8:
            raise KernelBuildError(f"CUDA kernels need {f} % 8 == 0, got {m[f]}")
    if m["hidden_size"] > 1024 * 8 * 4:
        raise KernelBuildError(f"CUDA row norms support hidden_size <= 32768, got {m['hidden_size']}")


def try_cutlass(manifest: dict, out_dir: Path, target: str, progress) -> dict | None:
    if os.environ.get("XSERV_NO_CUTLASS"):
        return None
    if not any(int(op.get("rows", 0)) >= CUTLASS_MIN_ROWS for bk in manifest["buckets"] for op in bk["ops"]
               if op["op"] == "linear"):
        return None
    try:
        from xserv_aot.plan.cutlass_build import GemmBuildError, build_gemm_library
    except ImportError:
        return None
    try:
        return build_gemm_library(out_dir, target, progress=(lambda msg: progress("gemm", 0, 1)) if progress else None)
    except GemmBuildError:
        return None


def build_kernels(manifest: dict, out_dir: Path, target: str, progress: Callable | None = None) -> dict:
    """Annotate every op with `kernel` + `launch`, add workspaces, write cubins; return the kernels section."""
    if target not in SUPPORTED_TARGETS:
        raise KernelBuildError(f"unsupported CUDA target {target!r} (supported: {', '.join(SUPPORTED_TARGETS)})")
    check_model(manifest)
    out_dir = Path(out_dir)
    m, b = manifest["model"], manifest["build"]
    cubins = compile_all(out_dir, target, progress)
    cutlass = try_cutlass(manifest, out_dir, target, progress)
    attn = {"split": DECODE_SPLIT, "splits": -(-b["max_seq_len"] // DECODE_SPLIT)}
    if attn["splits"] > 1024:
        raise KernelBuildError(f"max_seq_len {b['max_seq_len']} needs {attn['splits']} decode splits (max 1024)")
    for bucket in manifest["buckets"]:
        plan_bucket(bucket, manifest, cutlass, attn)
    t_dec = max([bk["num_tokens"] for bk in manifest["buckets"] if bk["kind"] == "decode"] or [1])
    nh, hd = m["num_heads"], m["head_dim"]
    add_arena_buffer(manifest, "attn_part_o", [t_dec, nh, attn["splits"], hd], "float32")
    add_arena_buffer(manifest, "attn_part_ml", [t_dec, nh, attn["splits"], 2], "float32")
    add_arena_buffer(manifest, "attn_counters", [b["max_num_seqs"], m["num_kv_heads"]], "int32")  # zeroed at start
    add_arena_buffer(manifest, "sample_scaled", [b["max_num_seqs"], m["vocab_size"]], "float32")
    ws = max([op["splits"] * int(op["rows"]) * int(op["n"]) for bk in manifest["buckets"] for op in bk["ops"]
              if op.get("kernel") == "gemm_64x64_splitk"] or [0])
    if ws:
        add_arena_buffer(manifest, "gemm_splitk_ws", [ws], "float32")
    section = {"target": target, "nvrtc": nvrtc_version(), "cubins": cubins,
               "functions": {fn: name for name, c in cubins.items() for fn in c["functions"]},
               "attention": attn, "gemm_library": None, "gemm_configs": {}}
    if cutlass is not None:
        section["gemm_library"] = {k: cutlass[k] for k in ("file", "hash", "configs", "build_key") if k in cutlass}
        section["gemm_configs"] = cutlass.get("used", {})
    return section

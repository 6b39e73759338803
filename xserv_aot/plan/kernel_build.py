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
SWAP_MIN_ROWS = 16           # decode rows 16..256: CUTLASS GEMMs by decode_gemm_route (cutlass_build.SWAP_CONFIGS)
BATCHED_ATTN_MIN_SEQS = 3    # decode attention for >= 3 seqs: kernels/attention_decode_batched.cu
BATCHED_ATTN_KERNEL = "tc"   # tc: kernels/attention_decode_tc.cu (tensor cores); cc: attention_decode_batched.cu
BATCHED_ATTN_TILE = 64       # keys per tile of either kernel (cc instantiates 64 and 32, tc 64)
BATCHED_ATTN_STAGES = 2      # tiles in the cp.async ring (cc: 2; tc: 2, 3, 4)
BATCHED_ATTN_BLOCKS = 4 * 132  # splits per seq chosen so a full bucket launches about this many blocks
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


def plan_swap(op: dict, out_dtype: str, cutlass: dict) -> None:
    from xserv_aot.plan.cutlass_build import SWAP_CONFIGS, library_workspace_size
    rows, n, k = int(op["rows"]), int(op["n"]), int(op["k"])
    widths = SWAP_CONFIGS[out_dtype]
    width = next(w for w in sorted(widths) if w >= rows)
    cfg, splits = widths[width], swap_splits(n, k, width)
    op["kernel"] = "cutlass"
    op["gemm_config"] = cfg
    op["gemm_splits"] = splits
    op["launch"] = []
    ws = library_workspace_size(cutlass["path"], cfg, rows, n, k, splits)
    cutlass["workspace"] = max(cutlass.get("workspace", 0), ws)
    cutlass.setdefault("used", {})[f"{rows}x{n}x{k}"] = cutlass["configs"][cfg]


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
    route = decode_gemm_route(rows, n, k, out_dtype) if decode and cutlass is not None and n % 8 == 0 else None
    if route == "swap":
        plan_swap(op, out_dtype, cutlass)
        return
    if decode and rows <= SKINNY_MAX_ROWS and route in (None, "skinny"):
        plan_skinny(op, suffix, fuse_into if SKINNY_FUSE_GATE else None)
        return
    if cutlass is not None and (rows >= CUTLASS_MIN_ROWS or route == "tile") and n % 8 == 0:
        from xserv_aot.plan.cutlass_build import CFG_128x128, choose_gemm_config
        cfg = CFG_128x128 if route == "tile" else choose_gemm_config(rows, n, k, out_dtype)   # tile: H200 sweep
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


def batched_attn_launch(op: dict, m: dict, max_seq_len: int) -> dict:
    """attention_decode_batched.cu over every seq row of the op: splits so the bucket fills the SMs."""
    seqs, nkv, hd = int(op["num_seqs"]), m["num_kv_heads"], m["head_dim"]
    g = m["num_heads"] // nkv
    splits = max(1, min(-(-max_seq_len // BATCHED_ATTN_TILE), -(-BATCHED_ATTN_BLOCKS // (seqs * nkv))))
    if BATCHED_ATTN_KERNEL == "tc":                                 # K and V tiles, rows padded to hd + 8
        smem = BATCHED_ATTN_STAGES * 2 * BATCHED_ATTN_TILE * (hd + 8) * 2
        name = f"attn_decode_tc_s{BATCHED_ATTN_STAGES}_hd{hd}"
    else:
        smem = BATCHED_ATTN_STAGES * 2 * BATCHED_ATTN_TILE * hd * 2
        name = f"attn_decode_b_t{BATCHED_ATTN_TILE}s{BATCHED_ATTN_STAGES}_hd{hd}_g{4 if g <= 4 else 8}"
    return launch(name, [seqs, nkv, splits], [128], smem)


def plan_attention(op: dict, kind: str, m: dict, attn: dict) -> None:
    """Decode buckets: split-KV kernel (few seqs) or the batched flash-decoding kernel. Prefill buckets: the
    flash prefill kernel, plus the batched decode kernel for the one-row (decode) seqs of a mixed step."""
    rows, seqs, hd = int(op["rows"]), int(op["num_seqs"]), m["head_dim"]
    if kind == "decode" and seqs < BATCHED_ATTN_MIN_SEQS:
        op["launch"] = [launch(f"attn_decode_hd{hd}", [seqs, m["num_kv_heads"], attn["splits"]], [128])]
        op["split"] = attn["split"]
        op["splits"] = attn["splits"]
        return
    dec = batched_attn_launch(op, m, attn["max_seq_len"])
    op["splits"] = dec["grid"][2]
    if kind == "decode":
        op["launch"] = [dec]
        return
    op["launch"] = [launch(f"attn_prefill_hd{hd}", [-(-rows // 64) + seqs, m["num_heads"]], [128]), dec]
    op["prefill_min_rows"] = 2


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
            plan_attention(op, bucket["kind"], m, attn)
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
    if not any(int(op.get("rows", 0)) >= (SWAP_MIN_ROWS if bk["kind"] == "decode" else CUTLASS_MIN_ROWS)
               for bk in manifest["buckets"] for op in bk["ops"] if op["op"] == "linear"):
        return None
    try:
        from xserv_aot.plan.cutlass_build import GemmBuildError, build_gemm_library
    except ImportError:
        return None
    try:
        lib = build_gemm_library(out_dir, target, progress=(lambda msg: progress("gemm", 0, 1)) if progress else None)
    except GemmBuildError:
        return None
    lib["path"] = Path(out_dir) / lib["file"]
    return lib


def build_kernels(manifest: dict, out_dir: Path, target: str, progress: Callable | None = None) -> dict:
    """Annotate every op with `kernel` + `launch`, add workspaces, write cubins; return the kernels section."""
    if target not in SUPPORTED_TARGETS:
        raise KernelBuildError(f"unsupported CUDA target {target!r} (supported: {', '.join(SUPPORTED_TARGETS)})")
    check_model(manifest)
    out_dir = Path(out_dir)
    m, b = manifest["model"], manifest["build"]
    cubins = compile_all(out_dir, target, progress)
    cutlass = try_cutlass(manifest, out_dir, target, progress)
    attn = {"split": DECODE_SPLIT, "splits": -(-b["max_seq_len"] // DECODE_SPLIT), "max_seq_len": b["max_seq_len"]}
    if attn["splits"] > 1024:
        raise KernelBuildError(f"max_seq_len {b['max_seq_len']} needs {attn['splits']} decode splits (max 1024)")
    for bucket in manifest["buckets"]:
        plan_bucket(bucket, manifest, cutlass, attn)
    nh, hd = m["num_heads"], m["head_dim"]
    # partials: [rows, nh, splits, ..] (split-KV kernel), [num_seqs, nh, splits, ..] (batched kernel)
    part_rows = max([int(op["num_seqs" if any(ln["fn"].startswith(("attn_decode_b", "attn_decode_tc")) for ln in op["launch"]) else "rows"])
                     * int(op["splits"]) for bk in manifest["buckets"] for op in bk["ops"] if op["op"] == "attention"]
                    or [1])
    add_arena_buffer(manifest, "attn_part_o", [part_rows, nh, hd], "float32")
    add_arena_buffer(manifest, "attn_part_ml", [part_rows, nh, 2], "float32")
    add_arena_buffer(manifest, "attn_counters", [b["max_num_seqs"], m["num_kv_heads"]], "int32")  # zeroed at start
    add_arena_buffer(manifest, "sample_scaled", [b["max_num_seqs"], m["vocab_size"]], "float32")
    ws = max([op["splits"] * int(op["rows"]) * int(op["n"]) for bk in manifest["buckets"] for op in bk["ops"]
              if op.get("kernel") == "gemm_64x64_splitk"] or [0])
    if ws:
        add_arena_buffer(manifest, "gemm_splitk_ws", [ws], "float32")
    if cutlass is not None and cutlass.get("workspace"):
        add_arena_buffer(manifest, "gemm_ws", [-(-cutlass["workspace"] // 4)], "int32")
    section = {"target": target, "nvrtc": nvrtc_version(), "cubins": cubins,
               "functions": {fn: name for name, c in cubins.items() for fn in c["functions"]},
               "attention": attn, "gemm_library": None, "gemm_configs": {}}
    if cutlass is not None:
        section["gemm_library"] = {k: cutlass[k] for k in ("file", "hash", "configs", "build_key") if k in cutlass}
        section["gemm_configs"] = cutlass.get("used", {})
    return section

"""Kernel routing of the bf16 linears (FP8 ones go on to plan/fp8_build.py): the GEMV for rows 1..2 (build setting
gemv "tc": rows 1..8 on plan/gemv_tc_plan.py), for decode
rows the skinny tensor-core GEMM (kernels/gemm_skinny.cu) or a CUTLASS swap-AB / tile GEMM (decode_gemm_route),
CUTLASS GEMMs for 128+ rows, else the NVRTC tiled / split-K GEMMs. Called by plan.kernel_build for every Linear op;
the H200 sweeps behind the constants are in docs/cuda-notes.md.
"""
from __future__ import annotations

from xserv_aot.plan.gemv_tc_plan import gemv_tc_fits, plan_gemv_tc
from xserv_aot.plan.kernel_constants import gemm_smem, skinny_smem
from xserv_aot.plan.launch_records import i32, kernel, launch, library_call, ptr
from xserv_aot.plan.nvrtc_build import KERNEL_DIR, KernelBuildError
from xserv_aot.plan.op_records import KernelChoice, Linear

GEMV_MAX_ROWS = 2            # above this the x re-reads make the GEMV L1/ALU-bound: tensor cores instead
CUTLASS_MIN_ROWS = 128
SKINNY_MAX_ROWS = 64         # decode rows 3..64: kernels/gemm_skinny.cu (weights streamed once, tensor cores)
SKINNY_WIDE_MIN_BLOCKS = 264 # 64-row blocks (half the activation re-reads) only when they still fill 2 per SM
SKINNY_FUSE_GATE = False     # gate_up + silu_mul in one skinny kernel (tests/test_kernel_build.py expects it off)
SPLITK_TARGET_BLOCKS = 264   # 2 blocks per SM on 132 SMs
SPLITK_MAX = 8
SWAP_MIN_ROWS = 16           # decode rows 16..256: CUTLASS GEMMs by decode_gemm_route (cutlass_build.SWAP_CONFIGS)
GEMM_ENTRY = "xserv_gemm_bf16"   # the CUTLASS library's C entry points (kernels/cutlass/gemm_sm90.cu)
GEMM_ENTRY_EX = "xserv_gemm_bf16_ex"   # ... with splits and a workspace (the swap-AB decode configs)
GEMM_SOURCE = KERNEL_DIR / "cutlass" / "gemm_sm90.cu"


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


def plan_tile(op: Linear, out_dtype: str, cutlass: dict, decode_tile: bool, residual: str | None) -> KernelChoice:
    """CUTLASS tile GEMM: 128x128 for decode rows (H200 sweep), else cutlass_build.pick_gemm_config (the build
    config's gemm_configs table, else the tile model). residual: the next op adds this output into that buffer;
    with gemm_residual on and a residual twin of the config, the GEMM adds it in place instead (fused_residual)."""
    from xserv_aot.plan.cutlass_build import (CFG_128x128, RESIDUAL_TWIN, SPLIT_TILE_CONFIGS, library_workspace_size,
                                              pick_gemm_config)
    rows, n, k = op.rows, op.n, op.k
    cfg = CFG_128x128 if decode_tile else pick_gemm_config(rows, n, k, out_dtype, cutlass.get("table"))
    fused = residual if residual and cutlass.get("residual") and cfg in RESIDUAL_TWIN else None
    cfg = RESIDUAL_TWIN[cfg] if fused else cfg
    cutlass.setdefault("used", {})[f"{rows}x{n}x{k}"] = cutlass["configs"][cfg]
    head = [i32(cfg), ptr(op.inp), ptr(op.weight), ptr(fused or op.out), ptr(op.bias), i32(rows), i32(n), i32(k)]
    if cfg not in SPLIT_TILE_CONFIGS:
        return KernelChoice("cutlass", (library_call("gemm_library", GEMM_ENTRY, head),), gemm_config=cfg,
                            fused_residual=fused)
    ws = library_workspace_size(cutlass["path"], cfg, rows, n, k, 0)
    cutlass["workspace"] = max(cutlass.get("workspace", 0), ws)
    call = library_call("gemm_library", GEMM_ENTRY_EX, head + [i32(0), ptr("gemm_ws" if ws else None), ("u64", ws)])
    return KernelChoice("cutlass", (call,), gemm_config=cfg, splits=0)


def plan_linear(op: Linear, out_dtype: str, fuse_into: str | None, cutlass: dict | None,
                decode: bool = False, residual: str | None = None, fp8_wgmma: bool | str = False,
                fold=None, gemv: str = "cuda_cores") -> KernelChoice:
    """fuse_into: the silu_mul output buffer when the next op is silu_mul of this op's output; residual: the
    residual buffer when the next op is add_rmsnorm of this op's output (plan_tile may fold the add in);
    fp8_wgmma: build setting fp8_w8a8_wgmma (True) or fp8_w8a8_tma ("tma"); fold: norm_fold.fold_role's; gemv: build
    setting gemv (plan/gemv_tc_plan.py)."""
    rows, n, k = op.rows, op.n, op.k
    if op.quant:
        from xserv_aot.plan.fp8_build import plan_fp8_linear
        return plan_fp8_linear(op, out_dtype, fuse_into, cutlass, fp8_wgmma, fold, gemv)
    if k % 8 or n % 2:
        raise KernelBuildError(f"linear {op.weight}: n={n}, k={k} (CUDA kernels need k % 8 == 0, n even)")
    if gemv == "tc" and gemv_tc_fits(op, fuse_into is not None):
        return plan_gemv_tc(op, out_dtype, fuse_into, fold)
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
        return plan_tile(op, out_dtype, cutlass, route == "tile", residual)
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

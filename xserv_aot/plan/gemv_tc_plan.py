"""The GEMV of 1-8 rows on the tensor cores, weights streamed by the copy engine (build setting gemv "tc",
kernels/gemv_tc.cu): bf16 weights or FP8 (W8A16, both scales). Blocks of 16 weight rows (a fused gate: 8 gate + 8 up
rows) over all of K, GT_CONSUMERS consumer warps and one producer; the ring depth is chosen here."""
from __future__ import annotations

from xserv_aot import fp8
from xserv_aot.plan.kernel_constants import (GT_BLOCKS_SM, GT_CHUNK, GT_CONSUMERS, GT_MAX_ROWS, GT_MAX_STAGES,
                                             GT_ROW_PAD, SM90_SMEM_BLOCK, SM90_SMEM_SM, SM90_SMS)
from xserv_aot.plan.launch_records import f32, i32, kernel, launch, ptr
from xserv_aot.plan.nvrtc_build import KernelBuildError
from xserv_aot.plan.op_records import KernelChoice, Linear

GEMV_CHOICES = ("cuda_cores", "tc")       # build setting gemv: kernels/gemv.cu + gemv_fp8.cu (rows 1-2; more rows:
                                          # the skinny kernels) or kernels/gemv_tc.cu (rows 1..GT_MAX_ROWS)
GEMV_TC_X_BYTES = 65536                   # x [rows, k] bf16 at most (more leaves the ring 1-2 stages an SM:
                                          # Qwen3-8B down at 8 rows had 1)
SCALE_TAG = {fp8.CHANNEL: "_ch", fp8.BLOCK128: "_blk"}


def gemv_tc_smem(rows: int, k: int, stages: int, blk: bool) -> int:
    """Dynamic shared memory of a block: 2 x stages mbarriers, the block scales (block128: 2 x ceil(k / 128)
    floats), x [rows, k] 2-byte, the stages (16 rows x (GT_CHUNK + GT_ROW_PAD) bytes each), the consumer warps'
    partials [GT_CONSUMERS, 16, rows] float."""
    x_off = (16 * stages + (8 * -(-k // 128) if blk else 0) + 15) // 16 * 16
    return (x_off + (rows * k * 2 + 15) // 16 * 16 + stages * 16 * (GT_CHUNK + GT_ROW_PAD)
            + GT_CONSUMERS * 16 * rows * 4)


def gemv_tc_resident(smem: int) -> int:
    """Blocks of this shared memory resident on an SM (the kernel's launch bounds allow GT_BLOCKS_SM)."""
    return min(GT_BLOCKS_SM, SM90_SMEM_SM // (smem + 1024))


def gemv_tc_stages(rows: int, k: int, weight_bytes: int, blocks: int, blk: bool) -> int:
    """Stages a block: the most weight bytes in flight an SM (blocks resident on it x stages, at most the block's
    chunks), ties to the deeper ring."""
    chunks = -(-k * weight_bytes // GT_CHUNK)
    best = (0, 0)
    for per_sm in range(1, GT_BLOCKS_SM + 1):
        fits = [s for s in range(1, min(chunks, GT_MAX_STAGES) + 1)
                if per_sm * (gemv_tc_smem(rows, k, s, blk) + 1024) <= SM90_SMEM_SM
                and gemv_tc_smem(rows, k, s, blk) <= SM90_SMEM_BLOCK]
        if fits:
            best = max(best, (min(per_sm, -(-blocks // SM90_SMS)) * fits[-1], fits[-1]))
    if not best[1]:
        raise KernelBuildError(f"GEMV: {rows} rows x k={k} do not fit one block's shared memory")
    return best[1]


def gemv_tc_fits(op: Linear, gate: bool) -> bool:
    """Its shapes: rows <= 8, k % 64 == 0 (whole 64-k fragments), a gate's 8 rows in one 128-row scale block, x
    (staged whole in shared memory) at most GEMV_TC_X_BYTES."""
    return (op.rows <= GT_MAX_ROWS and op.k % 64 == 0 and (not gate or (op.n // 2) % 8 == 0)
            and op.rows * op.k * 2 <= GEMV_TC_X_BYTES)


def plan_gemv_tc(op: Linear, out_dtype: str, fuse_into: str | None, fold: tuple | None = None) -> KernelChoice:
    """(X, W, [scale,] bias, out, M, N, K, S) or, fused with the silu_mul after it, (X, W, [scale,] silu_out, M, I,
    K, S); tiles ceil(N / 16) (gate: ceil(I / 8)), a grid of at most the blocks resident at once (each strides over
    the tiles) of (GT_CONSUMERS + 1) warps. Always launched under programmatic dependent launch, whatever build.pdl:
    the producer fills the ring before griddepcontrol.wait, so the weights stream while the kernel before it runs
    (that kernel triggers at its start, common.cuh pdl_entry). fold: norm_fold.fold_role's ("res", norm): `_res`
    adds its output into norm.residual in place; ("norm", norm): `_norm_*` reads norm.residual and normalizes it
    while staging it (kernels/gemv_tc.cu RES / NORM)."""
    name = f"gemv_fp8_tc{SCALE_TAG[op.quant]}" if op.quant else "gemv_tc"
    blk = op.quant == fp8.BLOCK128
    tiles = -(-(op.n // 2) // 8) if fuse_into else -(-op.n // 16)
    stages = gemv_tc_stages(op.rows, op.k, 1 if op.quant else 2, tiles, blk)
    role, norm = fold or (None, None)
    x = [ptr(norm.residual), ptr(norm.weight), f32(norm.eps)] if role == "norm" else [ptr(op.inp)]
    head = x + [ptr(op.weight)] + ([ptr(op.weight_scale)] if op.quant else [])
    smem = gemv_tc_smem(op.rows, op.k, stages, blk)
    geo = ([min(tiles, SM90_SMS * gemv_tc_resident(smem))], [32 * (GT_CONSUMERS + 1)], smem)
    tag = "_norm" if role == "norm" else ""
    if fuse_into:
        return kernel(launch(f"{name}{tag}_gate", *geo, head + [ptr(fuse_into), i32(op.rows), i32(op.n // 2),
                                                                 i32(op.k), i32(stages)], pdl=True),
                      fused_silu_out=fuse_into)
    tail = [ptr(op.bias), ptr(norm.residual if role == "res" else op.out), i32(op.rows), i32(op.n), i32(op.k),
            i32(stages)]
    if role == "res":
        return kernel(launch(f"{name}_res", *geo, head + tail, pdl=True), fused_residual=norm.residual)
    suffix = "f32" if out_dtype == "float32" else "bf16"
    return kernel(launch(f"{name}{tag}_{suffix}", *geo, head + tail, pdl=True))

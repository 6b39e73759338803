"""Launch records of the one-kernel row ops outside the GEMMs and attention: rmsnorm / add_rmsnorm (with the
quantize_fp8 they may write, `_q`), silu_mul, and the unfused QK-norm + RoPE + KV write (kernels/elementwise.cu,
kernels/rope_cache.cu). The rows kernels of prefill buckets are plan/row_kernels.py's. Called by plan.kernel_build."""
from __future__ import annotations

from xserv_aot.plan import row_kernels
from xserv_aot.plan.attention_plan import kv_scale_args
from xserv_aot.plan.kernel_constants import NORM_NC
from xserv_aot.plan.launch_records import f32, i32, kernel, kv, launch, ptr
from xserv_aot.plan.op_records import AddRmsNorm, KernelChoice, QkNormRopeCache, QuantizeFp8, RmsNorm, SiluMul

# Unfused QK-norm + RoPE + KV write: the kernel (qk_norm_rope_cache: scalar lanes; qk_norm_rope_cache_vec: a lane's
# HD / 32 elements in one vector access) and warps (heads) a block; scripts/bench_kernels.py prefill-elementwise
ROPE_KERNEL, ROPE_WARPS = "qk_norm_rope_cache", 4
NORM_FEW_FROM_ROWS = 0     # row norms of this many rows or more: fewest threads a row (norm_threads); 0 = never
SILU_MAX_BLOCKS = 4096     # silu_mul grid cap (grid-stride beyond); None = one 8-element chunk a thread
QUANTIZING_PRODUCERS = ("rmsnorm_q", "add_rmsnorm_q", "silu_mul_q") + row_kernels.QUANTIZING  # also write the
                                                                     # next quantize_fp8's output


def norm_threads(hidden: int, rows: int = 1, few_from: int | None = None) -> int:
    """Threads of a row-norm block: one 16-byte chunk a thread; from `few_from` rows on (default NORM_FEW_FROM_ROWS,
    0 = never) the fewest whole warps that hold the row in NORM_NC chunks each (more blocks resident)."""
    few_from = NORM_FEW_FROM_ROWS if few_from is None else few_from
    if few_from and rows >= few_from:
        return -(-(hidden // 8) // (NORM_NC * 32)) * 32
    return min(1024, -(-(hidden // 8) // 32) * 32)


def norm_launch(op: RmsNorm | AddRmsNorm, hidden: int, residual_summed: bool = False,
                few_from: int | None = None, quant: QuantizeFp8 | None = None) -> KernelChoice:
    """One block per row. residual_summed: the previous linear already added its output into op.residual
    (fused_residual), so add_rmsnorm is an rmsnorm of that buffer. quant: the next op, a quantize_fp8 the norm
    also writes (the `_q` kernels, one 16-byte chunk a thread)."""
    geometry = ([op.rows], [norm_threads(hidden) if quant else norm_threads(hidden, op.rows, few_from)], 0)
    fn, tail, group = ("_q", row_kernels.quant_ptrs(quant), [i32(quant.group)]) if quant else ("", [], [])
    if isinstance(op, RmsNorm) or residual_summed:
        inp = op.inp if isinstance(op, RmsNorm) else op.residual
        return kernel(launch(f"rmsnorm{fn}", *geometry, [ptr(inp), ptr(op.weight), ptr(op.out)] + tail
                             + [i32(hidden), f32(op.eps)] + group))
    return kernel(launch(f"add_rmsnorm{fn}", *geometry, [ptr(op.residual), ptr(op.delta), ptr(op.weight),
                                                         ptr(op.out)] + tail + [i32(hidden), f32(op.eps)] + group))


def silu_mul_launch(op: SiluMul, max_blocks: int | None = -1, quant: QuantizeFp8 | None = None) -> KernelChoice:
    """256 threads a block, one 8-element chunk a thread and iteration; max_blocks -1: SILU_MAX_BLOCKS. quant: the
    next op, a quantize_fp8 silu_mul_q also writes."""
    cap = SILU_MAX_BLOCKS if max_blocks == -1 else max_blocks
    chunks = -(-(op.rows * op.inter // 8) // 256)
    return kernel(launch("silu_mul_q" if quant else "silu_mul", [min(chunks, cap) if cap else chunks], [256], 0,
                         [ptr(op.inp), ptr(op.out)] + row_kernels.quant_ptrs(quant) + [i32(op.rows), i32(op.inter)]))


def qk_rope_launch(op: QkNormRopeCache, hd: int, nh: int, nkv: int, num_slots: int, fn: str | None = None,
                   warps: int | None = None, scales: tuple[float, float] | None = None) -> KernelChoice:
    """Grid (rows, groups of `warps` heads), one warp a head; nh / nkv: this rank's heads. fn / warps default to
    ROPE_KERNEL / ROPE_WARPS; scales: an FP8 cache's layer (k, v) scales (qk_norm_rope_cache_f8kv, the one
    FP8-KV variant)."""
    fn, warps = ("qk_norm_rope_cache_f8kv" if scales else fn or ROPE_KERNEL), warps or ROPE_WARPS
    return kernel(launch(f"{fn}_hd{hd}", [op.rows, -(-(nh + 2 * nkv) // warps)], [32 * warps], 0,
                         [ptr(op.qkv), ptr(op.positions), ptr(op.slot_mapping), ptr(op.q_norm), ptr(op.k_norm),
                          ptr(op.cos), ptr(op.sin), ptr(op.q_out), kv(op.layer), i32(nh), i32(nkv), f32(op.eps),
                          i32(num_slots)] + kv_scale_args(scales)))

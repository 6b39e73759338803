"""Prefill row kernels (kernels/rows_prefill.cu): add_rmsnorm / rmsnorm / silu_mul / qk_norm_rope_cache of the
buckets with at least ROWS_FROM rows, the same bits as elementwise.cu's / rope_cache.cu's kernels with more bytes in
flight a thread. In FP8 plans the norms and silu_mul also write the next op's quantize_fp8 output (the `_q` kernels,
the same bytes as elementwise.cu's `_q` kernels; `_qonly` where nothing reads their bf16 output) and a quantize_fp8
of its own (o_proj's input) runs as quantize_fp8_rows, in buckets of at least QUANT_ROWS_FROM rows. The build's
`prefill_row_kernels` picks "v1" (those kernels in every bucket), "rows" (these from ROWS_FROM / QUANT_ROWS_FROM
rows on) or "auto" (AUTO: what the H200 measured faster). Geometry below; every choice lands in the launch records.
Timed by `scripts/bench_kernels.py prefill-elementwise`; docs/cuda-notes.md "row kernels"."""
from __future__ import annotations

from xserv_aot.plan.attention_plan import kv_scale_args
from xserv_aot.plan.launch_records import f32, i32, kernel, kv, launch, ptr
from xserv_aot.plan.op_records import AddRmsNorm, KernelChoice, QkNormRopeCache, QuantizeFp8, RmsNorm, SiluMul

ROW_KERNEL_CHOICES = ("auto", "v1", "rows")
# Defaults from the H200 (docs/cuda-notes.md "The prefill row kernels at the copy rate", round 1): the rows plan's
# prefill_4096 step 103.2-103.5 ms against 105.5 ms (v1, twice); evict-first measured no faster anywhere.
AUTO = "rows"
ROWS_FROM = 512             # rows of a prefill bucket from which the rows kernels run (faster from 512, measured)
QUANT_ROWS_FROM = 512       # rows of any bucket from which the quantizing ones run (the `_q` kernels they replace
                            # hold one 512-thread row an SM; decode buckets of 16 - 256 rows measured no faster)
NORM_K, NORM_EF = 2, False  # 16-byte chunks a lane (H 4096: 8 warps a row); L2 evict-first loads of x and d
SILU_U, SILU_THREADS, SILU_EF = 3, 512, False   # chunks of g (and of u) in flight a thread; block; evict-first
ROPE_WARPS, ROPE_EF = 8, False                  # warps a row (one q / k head a warp at a time); evict-first
NORM_KS, SILU_US = (2, 4, 8), (2, 3, 6)         # the compiled variants
NORM_Q_KS, SILU_Q_US = (2, 4), (3,)             # ... of the quantizing norms and silu_mul (`_q`, `_qonly`)
QUANT_K, QUANT_KS = 2, (2, 4)                   # quantize_fp8_rows: 16-byte chunks a lane; compiled variants
QUANTIZING = tuple(f"{fn}{sfx}" for k in NORM_Q_KS for sfx in ("_q", "_qonly")
                   for fn in (f"add_rmsnorm_rows_k{k}", f"rmsnorm_rows_k{k}")) \
    + tuple(f"silu_mul_rows_u{u}{sfx}" for u in SILU_Q_US for sfx in ("_q", "_qonly"))   # write quantize_fp8's output


def uses_rows(choice: str, kind: str, rows: int, quantizing: bool = False) -> bool:
    """Whether an op of `rows` rows in a bucket of this kind gets a rows_prefill.cu kernel under the build's
    prefill_row_kernels: prefill buckets from ROWS_FROM rows (decode buckets keep their kernels whatever their
    size); quantizing (the kernel writes quantize_fp8's output): any bucket from QUANT_ROWS_FROM rows."""
    if (AUTO if choice == "auto" else choice) != "rows":
        return False
    return rows >= QUANT_ROWS_FROM if quantizing else kind == "prefill" and rows >= ROWS_FROM


def norm_warps(hidden: int, k: int) -> int:
    """Warps of a row-norm block: the W = ceil(hidden / 256) warps of the one-chunk-a-thread kernel, k a warp."""
    warps = -(-hidden // 256)
    return -(-warps // k)


def norm_rows_fits(hidden: int) -> bool:
    """The rows norms replay block_sum over at most 32 warp sums: hidden <= 8192."""
    return hidden % 8 == 0 and -(-hidden // 256) <= 32


def norm_rows_launch(op: RmsNorm | AddRmsNorm, hidden: int, residual_summed: bool = False, k: int | None = None,
                     ef: bool | None = None, quant: QuantizeFp8 | None = None, store_out: bool = True) -> KernelChoice:
    """One block a row of norm_warps(hidden, k) warps; as elementwise_plan.norm_launch. quant: the next op, a
    quantize_fp8 the norm also writes (k in NORM_Q_KS, no evict-first); store_out False: op.out is not written
    (nothing reads it), with quant only."""
    k, ef = k or NORM_K, NORM_EF if ef is None else ef
    sfx = f"_k{k}" + ("_ef" if ef else "") + quant_suffix(quant, store_out)
    geometry = ([op.rows], [32 * norm_warps(hidden, k)], 0)
    tail, group = quant_ptrs(quant), [i32(quant.group)] if quant else []
    if isinstance(op, RmsNorm) or residual_summed:
        inp = op.inp if isinstance(op, RmsNorm) else op.residual
        return kernel(launch(f"rmsnorm_rows{sfx}", *geometry, [ptr(inp), ptr(op.weight), ptr(op.out)] + tail
                             + [i32(hidden), f32(op.eps)] + group))
    return kernel(launch(f"add_rmsnorm_rows{sfx}", *geometry, [ptr(op.residual), ptr(op.delta), ptr(op.weight),
                                                                ptr(op.out)] + tail + [i32(hidden), f32(op.eps)]
                         + group))


def quant_ptrs(quant: QuantizeFp8 | None) -> list:
    """The e4m3 rows and scales a quantizing producer also writes (its arguments after `out`)."""
    return [ptr(quant.out), ptr(quant.scale)] if quant else []


def quant_suffix(quant: QuantizeFp8 | None, store_out: bool) -> str:
    if quant is None:
        if not store_out:
            raise ValueError("a row kernel skips its bf16 output only when it quantizes it")
        return ""
    return "_q" if store_out else "_qonly"


def silu_rows_launch(op: SiluMul, u: int | None = None, threads: int | None = None,
                     ef: bool | None = None, quant: QuantizeFp8 | None = None, store_out: bool = True) -> KernelChoice:
    """One block a row, u chunks of g and u in flight a thread. quant / store_out: as norm_rows_launch (u in
    SILU_Q_US; groups of 128, as silu_mul_q)."""
    u, threads, ef = u or SILU_U, threads or SILU_THREADS, SILU_EF if ef is None else ef
    return kernel(launch(f"silu_mul_rows_u{u}" + ("_ef" if ef else "") + quant_suffix(quant, store_out), [op.rows],
                         [threads], 0, [ptr(op.inp), ptr(op.out)] + quant_ptrs(quant) + [i32(op.inter)]))


def quantize_rows_fits(op: QuantizeFp8, kc: int | None = None) -> bool:
    """quantize_fp8_rows: k % 8 == 0, groups of 128 or the whole row, at most 32 warps a row."""
    return op.k % 8 == 0 and op.group in (128, op.k) and norm_warps(op.k, kc or QUANT_K) <= 32


def quantize_rows_launch(op: QuantizeFp8, kc: int | None = None) -> KernelChoice:
    """One block a row of norm_warps(k, kc) warps, kc 16-byte chunks a lane."""
    kc = kc or QUANT_K
    return kernel(launch(f"quantize_fp8_rows_k{kc}", [op.rows], [32 * norm_warps(op.k, kc)], 0,
                         [ptr(op.inp), ptr(op.out), ptr(op.scale), i32(op.k), i32(op.group)]))


def rope_rows_launch(op: QkNormRopeCache, hd: int, nh: int, nkv: int, num_slots: int, warps: int | None = None,
                     ef: bool | None = None, scales: tuple[float, float] | None = None) -> KernelChoice:
    """One block a row, its (nh + 2 nkv) heads staged in dynamic shared memory; nh / nkv: this rank's heads.
    scales: an FP8 cache's layer (k, v) scales (qk_norm_rope_cache_rows_f8kv, built without evict-first)."""
    warps, ef = warps or ROPE_WARPS, ROPE_EF if ef is None else ef
    sfx = "_f8kv" if scales else "_ef" if ef else ""
    return kernel(launch(f"qk_norm_rope_cache_rows{sfx}_hd{hd}", [op.rows], [32 * warps],
                         rope_rows_smem(hd, nh, nkv),
                         [ptr(op.qkv), ptr(op.positions), ptr(op.slot_mapping), ptr(op.q_norm), ptr(op.k_norm),
                          ptr(op.cos), ptr(op.sin), ptr(op.q_out), kv(op.layer), i32(nh), i32(nkv), f32(op.eps),
                          i32(num_slots)] + kv_scale_args(scales)))


def rope_rows_smem(hd: int, nh: int, nkv: int) -> int:
    """The row's heads (bf16) and its cos / sin rows (hd / 2 floats each)."""
    return (nh + 2 * nkv) * hd * 2 + hd * 4

"""CUDA kernels of the FP8 linears (docs/plan-format.md "FP8"): W8A16 GEMV (rows 1..2, kernels/gemv_fp8.cu; with the
build setting gemv "tc" rows 1..8 on plan/gemv_tc_plan.py) and
skinny tensor-core GEMM (rows 3..64, kernels/gemm_skinny_fp8.cu), quantize_fp8, and W8A8 (which rows are W8A8 is
BuildConfig.fp8_w8a16_max_rows, plan/ops.linear_ops): the W8A8 skinny kernel (rows <= 64,
kernels/gemm_skinny_w8a8.cu) or CUTLASS FP8 GEMMs with scale epilogues (more rows,
kernels/cutlass/gemm_sm90_fp8*.{h,cuh,cu}). Called by plan.kernel_build."""
from __future__ import annotations

from xserv_aot import fp8
from xserv_aot.dtypes import FP8
from xserv_aot.plan.gemv_tc_plan import gemv_tc_fits, plan_gemv_tc
from xserv_aot.plan.kernel_constants import (skinny_smem, skinny_w8a8_rows, skinny_w8a8_smem, WG8_WGS,
                                             w8a8_tma_smem, w8a8_wgmma_rows, w8a8_wgmma_smem)
from xserv_aot.plan.launch_records import f32, i32, kernel, launch, library_call, ptr
from xserv_aot.plan.linear_plan import GEMV_MAX_ROWS, SKINNY_WIDE_MIN_BLOCKS
from xserv_aot.plan.nvrtc_build import KERNEL_DIR, KernelBuildError
from xserv_aot.plan.op_records import AddRmsNorm, KernelChoice, Linear, Op, QuantizeFp8, RmsNorm, SiluMul
from xserv_aot.plan.signatures import host_signature
from xserv_aot.plan.tensor_maps import matrix_map

FP8_ENTRY = "xserv_gemm_fp8"              # the CUTLASS library's W8A8 entry point
FP8_ENTRY_EX = "xserv_gemm_fp8_ex"        # ... with a workspace (the stream-K configs' scratch: the arena's gemm_ws)
FP8_SOURCE = KERNEL_DIR / "cutlass" / "gemm_sm90_fp8.cu"
FP8_SKINNY_FUSE_GATE = False              # as linear_plan.SKINNY_FUSE_GATE: gate_up and silu_mul stay two kernels
GEMV_BLOCK_ROWS = 16                      # weight rows a W8A16 GEMV block (8 warps x 2; kernels/gemv_fp8.cu)
NORM_PARTIALS = "norm_partials"           # arena buffer [GEMV_MAX_ROWS, gemv_blocks(hidden)] float32 of
                                          # the folded add_rmsnorm on the CUDA-core GEMVs (plan/norm_fold.py)
QUANTIZE_WARPS = 8                        # (row, group) pairs per quantize_fp8 block
SCHEME_TAG = {fp8.CHANNEL: "ch", fp8.BLOCK128: "blk"}
W8A8_SKINNY_MAX_ROWS = 32                 # W8A8 linears of at most this many rows: kernels/gemm_skinny_w8a8.cu; more
                                          # rows: CUTLASS (faster from 48 rows on the H200), else the skinny kernel
W8A8_SKINNY_FALLBACK_ROWS = 64            # ... up to this many rows when the plan has no CUTLASS library
W8A8_SKINNY_BLOCKS = 96                   # H200 sweep: K split as far as tiles x C stays <= 96 blocks (qkv 24 x 4,
                                          # o / down 16 x 5, gate_up 96 x 1); more blocks in clusters run slower
W8A8_SKINNY_TILES = (16, 32, 64, 128)     # batch-row tiles it is built for (128: bench only, CUTLASS routed there;
                                          # more rows run as 128-row slices on grid z)
W8A8_SKINNY_CLUSTERS = (1, 2, 4, 5, 8)    # blocks a cluster (splitting K) that the kernel file instantiates
W8A8_QUANTIZE_IN_KERNEL = False           # block128 W8A8 skinny linears quantize their bf16 input themselves (blkq:
                                          # 0.65 - 0.91x of quantize_fp8 + GEMM on the H200, the IEEE divisions)
W8A8_SKINNY_HALF = False                  # 33-64 rows: 128-row blocks (r1, no spills) instead of 256-row ones
W8A8_WGMMA_MAX_ROWS = 256                 # build setting fp8_w8a8_wgmma: W8A8 linears of W8A8_SKINNY_MAX_ROWS + 1 ..
                                          # this many rows on kernels/gemm_w8a8_wgmma.cu instead of CUTLASS
W8A8_WGMMA_TILES = (64, 128)              # activation rows a wgmma N (more rows: slices of 128, grid x)
W8A8_WGMMA_CLUSTERS = (1, 2, 4, 8)        # blocks a cluster (splitting K) that the kernel file instantiates
W8A8_WGMMA_SMS = 132                      # one block an SM (its ring takes ~195 KB of shared memory)
W8A8_WGMMA_MBAR = False                   # per-slot mbarriers instead of a block barrier a step (`mb` kernels)
W8A8_WGMMA_WIDE = False                   # 129-256 rows as one 256-row tile (n256: two n128 halves on one weight
                                          # tile, its bytes read once) instead of two 128-row slices
W8A8_TMA_MAX_ROWS = 64                    # build setting fp8_w8a8_tma: W8A8 linears of W8A8_SKINNY_MAX_ROWS + 1 ..
                                          # this many rows on kernels/gemm_w8a8_tma.cu (H200, session 6: faster than
                                          # CUTLASS W8A8 on every Qwen3-8B shape at 64 rows; at 128 slower on qkv /
                                          # gate_up, at 256 on all); more rows: CUTLASS where the plan has it
W8A8_TMA_CLUSTERS = (1, 2, 3, 4)          # blocks a cluster of kernels/gemm_w8a8_tma.cu (the TMA-fed variant)
W8A8_TMA_SHAPES = {(2, 1): "", (2, 2): "t2"}   # its blocks: (consumer warpgroups, m64 tiles each) -> kernel tag;
                                          # the 256-row t2 at <= 64 activation rows only (tma_shape)
W8A8_TMA_CLUSTERS_R256 = (1, 2, 3, 4, 6)  # ... cluster sizes built for the 256-row block
W8A8_TMA_EARLY = True                     # ... launched under PDL, its weight boxes issued before griddepcontrol.wait
W8A8_TMA_BLOCKS = 96                      # ... its clustered grids stay within this many blocks where the tiles allow
                                          # (the W8A8 skinny sweep: more blocks in clusters do not all run at once)


def host_signatures() -> dict[str, list[dict]]:
    return {e: host_signature(FP8_SOURCE, e) for e in (FP8_ENTRY, FP8_ENTRY_EX)}


def fp8_args(op: Linear, fused_silu_out: str | None = None) -> list:
    """(X, W, scale, bias, out, M, N, K) of the W8A16 kernels; fused gate: (X, W, scale, silu_out, M, I, K)."""
    head = [ptr(op.inp), ptr(op.weight), ptr(op.weight_scale)]
    if fused_silu_out:
        return head + [ptr(fused_silu_out), i32(op.rows), i32(op.n // 2), i32(op.k)]
    return head + [ptr(op.bias), ptr(op.out), i32(op.rows), i32(op.n), i32(op.k)]


def is_fp8_gemv(op: Op) -> bool:
    return isinstance(op, Linear) and bool(op.quant) and not op.inp_scale and op.rows <= GEMV_MAX_ROWS


def gemv_blocks(n: int) -> int:
    """Blocks of a W8A16 GEMV over n weight rows; a folded norm has one partial a res block (the norm kernel's P)."""
    return -(-n // GEMV_BLOCK_ROWS)


def plan_fp8_linear(op: Linear, out_dtype: str, fuse_into: str | None, cutlass: dict | None,
                    wgmma: bool | str = False, fold: tuple[str, AddRmsNorm] | None = None,
                    gemv: str = "cuda_cores") -> KernelChoice:
    """fuse_into: the silu_mul output buffer when the next op is silu_mul of this op's output (GEMV only); wgmma:
    build setting fp8_w8a8_wgmma (True) or fp8_w8a8_tma ("tma"), plan_w8a8; fold: norm_fold.fold_role's; gemv: build
    setting gemv (gemv_tc_plan.GEMV_CHOICES)."""
    rows, n, k, tag = op.rows, op.n, op.k, SCHEME_TAG[op.quant]
    suffix = "f32" if out_dtype == "float32" else "bf16"
    if k % 16 or n % 2:
        raise KernelBuildError(f"FP8 linear {op.weight}: n={n}, k={k} (FP8 kernels need k % 16 == 0, n even)")
    if op.inp_scale:
        return plan_w8a8(op, out_dtype, cutlass, wgmma)
    if gemv == "tc" and gemv_tc_fits(op, fuse_into is not None):
        return plan_gemv_tc(op, out_dtype, fuse_into, fold)
    if rows <= GEMV_MAX_ROWS and fold:
        return plan_gemv_fold(op, fold, fuse_into)
    if rows <= GEMV_MAX_ROWS:
        mt = rows
        if fuse_into:
            return kernel(launch(f"gemv_fp8_{tag}_gate_m{mt}", [-(-(n // 2) // 8)], [256], 0, fp8_args(op, fuse_into)),
                          fused_silu_out=fuse_into)
        return kernel(launch(f"gemv_fp8_{tag}_m{mt}_{suffix}", [gemv_blocks(n)], [256], 0, fp8_args(op)))
    mt = next(m for m in (8, 16, 32, 64) if m >= rows)
    bn = 64 if -(-n // 64) >= SKINNY_WIDE_MIN_BLOCKS else 32
    if fuse_into and FP8_SKINNY_FUSE_GATE:
        return kernel(launch(f"skinny_fp8_{tag}{bn}_gate_m{mt}", [-(-(n // 2) // (bn // 2))], [256], skinny_smem(mt),
                             fp8_args(op, fuse_into)), fused_silu_out=fuse_into)
    return kernel(launch(f"skinny_fp8_{tag}{bn}_m{mt}_{suffix}", [-(-n // bn)], [256], skinny_smem(mt), fp8_args(op)))


def plan_gemv_fold(op: Linear, fold: tuple[str, AddRmsNorm], fuse_into: str | None) -> KernelChoice:
    """The CUDA-core FP8 GEMVs around a folded add_rmsnorm (norm_fold.folds_norm)."""
    role, norm = fold
    tag, mt, grid = SCHEME_TAG[op.quant], op.rows, gemv_blocks(op.n)
    if role == "res":
        return kernel(launch(f"gemv_fp8_{tag}_res_m{mt}", [grid], [256], 0,
                             [ptr(op.inp), ptr(op.weight), ptr(op.weight_scale), ptr(op.bias), ptr(norm.residual),
                              ptr(NORM_PARTIALS), i32(op.rows), i32(op.n), i32(op.k)]), fused_residual=norm.residual)
    head = [ptr(norm.residual), ptr(norm.weight), ptr(NORM_PARTIALS), i32(gemv_blocks(op.k)), f32(norm.eps),
            ptr(op.weight), ptr(op.weight_scale)]
    smem = mt * op.k * 2                                      # the normed rows, bf16 [rows, K]
    if fuse_into:
        return kernel(launch(f"gemv_fp8_{tag}_norm_gate_m{mt}", [-(-(op.n // 2) // 8)], [256], smem,
                             head + [ptr(fuse_into), i32(op.rows), i32(op.n // 2), i32(op.k)]), fused_silu_out=fuse_into)
    return kernel(launch(f"gemv_fp8_{tag}_norm_m{mt}_bf16", [grid], [256], smem,
                         head + [ptr(op.bias), ptr(op.out), i32(op.rows), i32(op.n), i32(op.k)]))


def plan_w8a8(op: Linear, out_dtype: str, cutlass: dict | None, wgmma: bool | str = False) -> KernelChoice:
    """quantize_fp8's packed e4m3 rows and scales x the e4m3 weight: the skinny kernel (few rows), the wgmma
    kernels where the build says so (wgmma "tma": the TMA-fed one for 33..W8A8_TMA_MAX_ROWS rows, up to 256 rows
    in plans without the CUTLASS library, K >= 128, else the cp.async one; True: the cp.async one for 33-256 rows),
    else CUTLASS, scales in its mainloop (block128) or epilogue (channel)."""
    from xserv_aot.plan.cutlass_build import FP8_CONFIGS, FP8_SPLIT_CONFIGS, fp8_config, library_fp8_workspace_size
    tma = wgmma == "tma" and op.k >= 128
    if op.rows <= (W8A8_SKINNY_MAX_ROWS if cutlass is not None or wgmma else W8A8_SKINNY_FALLBACK_ROWS):
        return plan_w8a8_skinny(op, out_dtype)
    if tma and (op.rows <= W8A8_TMA_MAX_ROWS or cutlass is None and op.rows <= W8A8_WGMMA_MAX_ROWS):
        return plan_w8a8_tma(op, out_dtype)
    if wgmma and not tma and op.rows <= W8A8_WGMMA_MAX_ROWS:
        return plan_w8a8_wgmma(op, out_dtype)
    if cutlass is None:
        raise KernelBuildError(f"FP8 linear {op.weight} with {op.rows} rows is W8A8 and needs the CUTLASS GEMM "
                               f"library, which this build has not (enable gemm_library, or compile a plan whose "
                               f"buckets have at most 64 rows)")
    if op.n % 8:
        raise KernelBuildError(f"FP8 linear {op.weight}: n={op.n} (the W8A8 GEMM needs n % 8 == 0)")
    cfg, splits = fp8_config(op.quant, out_dtype, op.rows, op.n, op.k)
    cutlass.setdefault("used", {})[f"fp8:{op.rows}x{op.n}x{op.k}"] = FP8_CONFIGS[cfg]
    head = [i32(cfg), ptr(op.inp), ptr(op.inp_scale), ptr(op.weight), ptr(op.weight_scale), ptr(op.out),
            ptr(op.bias), i32(op.rows), i32(op.n), i32(op.k)]
    if cfg not in FP8_SPLIT_CONFIGS:
        return KernelChoice("cutlass_fp8", (library_call("gemm_library", FP8_ENTRY, head),), gemm_config=cfg)
    ws = library_fp8_workspace_size(cutlass["path"], cfg, op.rows, op.n, op.k, splits)
    cutlass["workspace"] = max(cutlass.get("workspace", 0), ws)
    call = library_call("gemm_library", FP8_ENTRY_EX, head + [i32(splits), ptr("gemm_ws" if ws else None), ("u64", ws)])
    return KernelChoice("cutlass_fp8", (call,), gemm_config=cfg, splits=splits)


def w8a8_cluster(n: int, k: int, block_rows: int = skinny_w8a8_rows(64)) -> int:
    """Blocks splitting K per tile of block_rows weight rows: the largest built cluster size that keeps the grid
    within W8A8_SKINNY_BLOCKS blocks, with at least one 128-k step a block."""
    tiles, steps = -(-n // block_rows), -(-k // 128)
    return max([c for c in W8A8_SKINNY_CLUSTERS if c <= steps and tiles * c <= W8A8_SKINNY_BLOCKS] or [1])


def quantize_fuses_into(qop: QuantizeFp8, nxt) -> bool:
    """Whether the W8A8 linear after quantize_fp8 quantizes its input itself (then quantize_fp8 launches nothing):
    block128 skinny rows, whose 128-k steps are the activation groups."""
    return (W8A8_QUANTIZE_IN_KERNEL and isinstance(nxt, Linear) and nxt.inp == qop.out and nxt.inp_scale == qop.scale
            and nxt.quant == fp8.BLOCK128 and nxt.rows <= W8A8_SKINNY_MAX_ROWS and qop.group == fp8.BLOCK
            and qop.rows == nxt.rows and qop.k == nxt.k)


def producer_fuses_quantize(prod, qop, after, enabled: bool) -> bool:
    """Whether rmsnorm / add_rmsnorm / silu_mul `prod` also writes the next op's quantize_fp8 output (build setting
    fp8_quantize_in_producer): groups of 128 (norms: or the whole row), unless the linear after quantizes itself."""
    if not (enabled and isinstance(qop, QuantizeFp8) and qop.inp == prod.out and qop.rows == prod.rows) \
            or quantize_fuses_into(qop, after):
        return False
    if isinstance(prod, SiluMul):
        return qop.group == fp8.BLOCK and qop.k == prod.inter and prod.inter % fp8.BLOCK == 0
    return isinstance(prod, (RmsNorm, AddRmsNorm)) and qop.group in (fp8.BLOCK, qop.k)


def plan_w8a8_skinny(op: Linear, out_dtype: str, cluster: int | None = None, quantized_from: str | None = None,
                     half: bool = W8A8_SKINNY_HALF) -> KernelChoice:
    """quantize_fp8's rows and scales x the e4m3 weight on mma.sync e4m3 (kernels/gemm_skinny_w8a8.cu); cluster:
    force the K split (tests, bench), by default w8a8_cluster; quantized_from: the bf16 buffer the fused
    quantize_fp8 reads (quantize_fuses_into): the kernel quantizes it itself (`blkq`); half: the 128-row blocks
    (`r1`, one m16 weight tile a warp) at 33-64 rows."""
    mt = next((m for m in W8A8_SKINNY_TILES if m >= op.rows), W8A8_SKINNY_TILES[-1])  # more rows: grid z slices
    half = half and mt == 64
    rows = skinny_w8a8_rows(mt, half)
    c = cluster or w8a8_cluster(op.n, op.k, rows)
    if c not in W8A8_SKINNY_CLUSTERS:
        raise KernelBuildError(f"W8A8 skinny cluster {c} is not built (built: {W8A8_SKINNY_CLUSTERS})")
    suffix, tile = "f32" if out_dtype == "float32" else "bf16", f"m{mt}{'r1' if half else ''}c{c}"
    tail = [ptr(op.bias), ptr(op.out), i32(op.rows), i32(op.n), i32(op.k)]
    if quantized_from:
        fn, args = f"skinny_w8a8_blkq_{tile}_{suffix}", [ptr(quantized_from), ptr(op.weight), ptr(op.weight_scale)]
    else:
        fn = f"skinny_w8a8_{SCHEME_TAG[op.quant]}_{tile}_{suffix}"
        args = [ptr(op.inp), ptr(op.inp_scale), ptr(op.weight), ptr(op.weight_scale)]
    return kernel(launch(fn, [-(-op.n // rows), c, -(-op.rows // mt)], [256],
                         skinny_w8a8_smem(mt, bool(quantized_from), half), args + tail))


def wgmma_cluster(tiles: int, steps: int) -> int:
    """Blocks splitting K per (weight tile, activation slice), `tiles` of them: the largest built cluster size with
    tiles x C <= W8A8_WGMMA_SMS (one wave), or with more tiles than SMs the one that wastes the least of the last
    wave; never more blocks a cluster than 128-k steps."""
    built = [c for c in W8A8_WGMMA_CLUSTERS if c <= steps] or [1]
    if tiles <= W8A8_WGMMA_SMS:
        return max(c for c in built if tiles * c <= W8A8_WGMMA_SMS or c == 1)
    waste = {c: -(-tiles * c // W8A8_WGMMA_SMS) * W8A8_WGMMA_SMS / (tiles * c) for c in built}
    return min(built, key=lambda c: (round(waste[c], 3), c))


def plan_w8a8_wgmma(op: Linear, out_dtype: str, cluster: int | None = None, mbar: bool = W8A8_WGMMA_MBAR,
                    wide: bool = W8A8_WGMMA_WIDE) -> KernelChoice:
    """quantize_fp8's rows and scales x the e4m3 weight on wgmma e4m3, weights as the A operand (m64 tiles), the
    activation rows as N (kernels/gemm_w8a8_wgmma.cu); cluster: force the K split (tests, bench), by default
    wgmma_cluster; mbar: the mbarrier ring variant (not built for n256); wide: 129-256 rows on the n256 tile."""
    if op.k % 16:
        raise KernelBuildError(f"FP8 linear {op.weight}: k={op.k} (the W8A8 wgmma kernel needs k % 16 == 0)")
    nt = 256 if wide and op.rows > W8A8_WGMMA_TILES[-1] else next(
        (t for t in W8A8_WGMMA_TILES if t >= op.rows), W8A8_WGMMA_TILES[-1])
    mbar = mbar and nt != 256
    tiles, slices = -(-op.n // w8a8_wgmma_rows()), -(-op.rows // nt)
    c = cluster or wgmma_cluster(tiles * slices, -(-op.k // 128))
    if c not in W8A8_WGMMA_CLUSTERS:
        raise KernelBuildError(f"W8A8 wgmma cluster {c} is not built (built: {W8A8_WGMMA_CLUSTERS})")
    suffix = "f32" if out_dtype == "float32" else "bf16"
    fn = f"w8a8_wgmma_{SCHEME_TAG[op.quant]}_n{nt}c{c}{'mb' if mbar else ''}_{suffix}"
    args = [ptr(op.inp), ptr(op.inp_scale), ptr(op.weight), ptr(op.weight_scale), ptr(op.bias), ptr(op.out),
            i32(op.rows), i32(op.n), i32(op.k)]
    return kernel(launch(fn, [tiles * slices, c], [128 * WG8_WGS], w8a8_wgmma_smem(nt), args))


def tma_cluster(tiles: int, steps: int, blocks: int = W8A8_TMA_BLOCKS, built: tuple = W8A8_TMA_CLUSTERS) -> int:
    """Blocks splitting K per (weight tile, activation slice) of the TMA kernel: the largest built C with tiles x C
    <= blocks; with more tiles, the C of the fewest waves per 1 / C of the K steps (waves of W8A8_WGMMA_SMS blocks
    unclustered, of `blocks` clustered), the smaller C on ties; never more blocks a cluster than 128-k steps."""
    built = [c for c in built if c <= steps] or [1]
    if tiles * built[0] <= blocks:
        return max(c for c in built if tiles * c <= blocks)
    return min(built, key=lambda c: (-(-tiles * c // (W8A8_WGMMA_SMS if c == 1 else blocks)) / c, c))


def tma_shape(n: int, rows: int) -> tuple[int, int]:
    """The TMA kernel's block for an [n, k] weight at `rows` activation rows: 128-row blocks (2 x 1) unless their
    tiles fill more than one wave of SMs at <= 64 rows, then 256-row t2 blocks (gate_up at 64 rows: 192 tiles -> 96;
    H200 session 17: 35.1 against 40.1 us, qkv / o / down slower on t2)."""
    return (2, 2) if rows <= W8A8_WGMMA_TILES[0] and -(-n // 128) > W8A8_WGMMA_SMS else (2, 1)


def plan_w8a8_tma(op: Linear, out_dtype: str, cluster: int | None = None, shape: tuple[int, int] | None = None,
                  early: bool = W8A8_TMA_EARLY) -> KernelChoice:
    """The W8A8 wgmma GEMM with TMA-fed tiles (kernels/gemm_w8a8_tma.cu): tensor maps over the weight [N, K] and
    xq [M, K] (e4m3, 128B swizzle, boxes of 128 bytes x the block's weight rows / activation rows, or all N / M
    where fewer), then the cp.async kernel's arguments less xq and W; grid as plan_w8a8_wgmma's, 128 wgs + 32
    threads (a producer warp); cluster: force the K split (tests, bench), by default tma_cluster; shape: the block's
    (consumer warpgroups, m64 tiles each), a W8A8_TMA_SHAPES key (by default tma_shape; above 64 rows (2, 1));
    early: the record's pdl (the launch may overlap the previous kernel, whose output it waits for)."""
    if op.k % 16 or op.k < 128:
        raise KernelBuildError(f"FP8 linear {op.weight}: k={op.k} (the W8A8 TMA kernel needs k % 16 == 0, k >= 128)")
    nt = next((t for t in W8A8_WGMMA_TILES if t >= op.rows), W8A8_WGMMA_TILES[-1])
    wgs, tpw = (shape or tma_shape(op.n, op.rows)) if nt == W8A8_WGMMA_TILES[0] else (2, 1)
    rows = 64 * wgs * tpw
    built = W8A8_TMA_CLUSTERS if rows == 128 else W8A8_TMA_CLUSTERS_R256
    tiles, slices = -(-op.n // rows), -(-op.rows // nt)
    c = cluster or tma_cluster(tiles * slices, -(-op.k // 128), built=built)
    if c not in built:
        raise KernelBuildError(f"W8A8 TMA cluster {c} is not built for {rows}-row blocks (built: {built})")
    suffix = "f32" if out_dtype == "float32" else "bf16"
    tw = matrix_map(op.weight, FP8, op.n, op.k, min(rows, op.n), 128)
    tx = matrix_map(op.inp, FP8, op.rows, op.k, min(nt, op.rows), 128, l2_promotion="128B")
    args = [tw, tx, ptr(op.inp_scale), ptr(op.weight_scale), ptr(op.bias), ptr(op.out), i32(op.rows), i32(op.n),
            i32(op.k)]
    fn = f"w8a8_tma_{SCHEME_TAG[op.quant]}_n{nt}c{c}{W8A8_TMA_SHAPES[(wgs, tpw)]}_{suffix}"
    return kernel(launch(fn, [tiles * slices, c], [128 * wgs + 32], w8a8_tma_smem(nt, rows), args, pdl=early))


def plan_quantize(op: QuantizeFp8) -> KernelChoice:
    if op.k % 16 or op.group % 16:
        raise KernelBuildError(f"quantize_fp8 of {op.inp}: k={op.k}, group={op.group} (the kernel needs both % 16 == 0)")
    groups = fp8.groups(op.k, op.group)
    return kernel(launch("quantize_fp8", [op.rows, -(-groups // QUANTIZE_WARPS)], [32 * QUANTIZE_WARPS], 0,
                         [ptr(op.inp), ptr(op.out), ptr(op.scale), i32(op.rows), i32(op.k), i32(op.group)]))

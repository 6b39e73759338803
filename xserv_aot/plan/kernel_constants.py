"""Constants shared by the planner and the kernels: their one home. They reach kernels/*.cu as NVRTC -D options
(part of the cubin cache key, plan.nvrtc_build), so no kernel source defines them itself."""
from __future__ import annotations

P_KEYS = 128            # keys per split-KV partition of decode attention (= its threads per block)
G_MAX = 8               # most query heads per KV head that decode attention holds in a block
NORM_NC = 4             # 16-byte chunks a row-norm thread keeps in registers: hidden <= 1024 * 8 * NORM_NC
GEMM_BK = 32            # k per cp.async stage of kernels/gemm_mma.cu
GEMM_LDS = GEMM_BK + 8  # padded shared-memory row (bf16 elements): ldmatrix rows hit distinct banks
GEMM_STAGES_128 = 3     # pipeline depth of the 128x128 tiles
GEMM_STAGES_64 = 4      # ... and of the 64x64 tiles
SK_WARPS = 8            # warps of a kernels/gemm_skinny.cu block
SK_RT = 2               # 16-row weight tiles per skinny warp
SK_STAGES = 3           # ring of 64-k steps per skinny warp (SK_RT * 16 rows * 128 B each)
SM90_SMEM_SM = 233472   # shared memory of an sm_90 SM (228 KB), 1 KB of it reserved for each resident block
SM90_SMEM_BLOCK = 232448  # ... the most one block may take (227 KB)
SM90_SMS = 132          # SMs of an H100 SXM / H200
MK_SMEM_MAX = SM90_SMEM_BLOCK  # dynamic shared memory of the decode megakernel (kernels/decode_megakernel.cu)
MK_STAGE_BYTES = 33792  # ... bytes a weight-ring slot (whole rows of one matrix; 32 KB + room for the padded
                        #     rows of the FP8 tensor-core variant); the ring takes what is left
MK_H_SEQ_BYTES = 24576  # ... GEMV input a sequence ([K] bf16; also holds the attention scratch)
MK_PART_FLOATS = 2048   # ... per-row, per-warp partial sums of a block's rows
MK_CONSUMERS = 8        # ... consumer warps (a slot's rows split them evenly); one more warp streams the weights
MK_TILE = 128           # ... keys an attention tile (two consumer threads a key)
MK_ROW_PAD = 16         # ... bytes after each slot row of its FP8 tensor-core variant (conflict-free u32 reads)
MK_SCALE_FLOATS = 512   # ... FP8 scales a block reads in a layer (two layers staged in shared memory)
MK_TRACE = 26           # ... trace stamps a block and layer (14 phase edges, 4 ring-wait sums, 4 barrier
                        #     arrivals, the producer's L2 prefetch count, 3 attention edges; mk_trace buffer)
GT_CHUNK = 1024         # bytes a row and stage of the tensor-core GEMV (kernels/gemv_tc.cu), 128 a consumer warp
GT_ROW_PAD = 32         # ... bytes after each of its 16 stage rows (conflict-free 16-B fragment loads)
GT_CONSUMERS = 8        # ... consumer warps (one more streams the weights)
GT_MAX_STAGES = 8       # ... stages a block at most
GT_BLOCKS_SM = 3        # ... blocks an SM at most (__launch_bounds__: <= 75 registers a thread)
GT_MAX_ROWS = 8         # ... input rows at most (the mma's n8 side)
SW8_STAGES = 4          # ring of 128-k steps per W8A8 skinny block (256 weight lines + the X tile each)
WG8_WGS = 2             # consumer warpgroups (m64 weight tiles) of a kernels/gemm_w8a8_wgmma.cu block
WG8_STAGES_N64 = 8      # ... its ring of 128-k steps (64 WG8_WGS weight lines + the NT-row X tile each) at NT 64
WG8_STAGES_N128 = 6     # ... and at NT 128 (both ~200 KB of shared memory)
WG8_STAGES_N256 = 4     # ... and at NT 256 (two n128 halves on one weight tile, ~197 KB)
WG8_STAGES_R256 = 5     # ... of a 256-row kernels/gemm_w8a8_tma.cu block at NT 64 (~202 KB)
PREFILL_F8KV_STAGING = 2   # e4m3 K/V tiles staged by the FP8-KV wgmma prefill producer (this many - 1 ahead; 3: no
                           # faster, ws2h2k64s4 12% slower: docs/cuda-notes.md "Session 16")

KERNEL_DEFINES = {"P_KEYS": P_KEYS, "G_MAX": G_MAX, "NORM_NC": NORM_NC, "GEMM_BK": GEMM_BK, "GEMM_LDS": GEMM_LDS,
                  "GEMM_STAGES_128": GEMM_STAGES_128, "GEMM_STAGES_64": GEMM_STAGES_64, "SK_WARPS": SK_WARPS,
                  "SK_RT": SK_RT, "SK_STAGES": SK_STAGES, "MK_STAGE_BYTES": MK_STAGE_BYTES, "MK_ROW_PAD": MK_ROW_PAD,
                  "MK_SCALE_FLOATS": MK_SCALE_FLOATS,
                  "MK_H_SEQ_BYTES": MK_H_SEQ_BYTES, "MK_PART_FLOATS": MK_PART_FLOATS,
                  "MK_CONSUMERS": MK_CONSUMERS, "MK_TILE": MK_TILE, "MK_TRACE": MK_TRACE,
                  "GT_CHUNK": GT_CHUNK, "GT_ROW_PAD": GT_ROW_PAD, "GT_CONSUMERS": GT_CONSUMERS,
                  "GT_BLOCKS_SM": GT_BLOCKS_SM, "GT_MAX_ROWS": GT_MAX_ROWS, "SW8_STAGES": SW8_STAGES,
                  "WG8_WGS": WG8_WGS, "WG8_STAGES_N64": WG8_STAGES_N64,
                  "WG8_STAGES_N128": WG8_STAGES_N128, "WG8_STAGES_N256": WG8_STAGES_N256,
                  "WG8_STAGES_R256": WG8_STAGES_R256,
                  "PREFILL_F8KV_STAGING": PREFILL_F8KV_STAGING}


def gemm_smem(tile: str) -> int:
    """Dynamic shared memory (bytes) of a gemm_mma.cu tile "BMxBN": stages * (BM + BN) rows of GEMM_LDS bf16."""
    bm, bn = (int(x) for x in tile.split("x"))
    stages = GEMM_STAGES_128 if bm == 128 else GEMM_STAGES_64
    return stages * (bm + bn) * GEMM_LDS * 2


def skinny_smem(mt: int) -> int:
    """Dynamic shared memory (bytes) of a skinny kernel for mt batch rows: the weight rings, reused afterwards for
    the partial sums (SK_WARPS * SK_RT * mt/8 tiles of 4 x 32 floats)."""
    return max(SK_WARPS * SK_STAGES * SK_RT * 16 * 128, SK_WARPS * SK_RT * (mt // 8) * 4 * 32 * 4)


def skinny_w8a8_rows(mt: int, half: bool = False) -> int:
    """Weight rows a kernels/gemm_skinny_w8a8.cu block: SK_WARPS warps x 2 m16 tiles, 1 tile at 128 batch rows or
    in the half-width (`r1`) variants."""
    return SK_WARPS * 16 * (1 if mt > 64 or half else 2)


def skinny_w8a8_smem(mt: int, qx: bool = False, half: bool = False) -> int:
    """Dynamic shared memory (bytes) of a kernels/gemm_skinny_w8a8.cu block for mt batch rows: SW8_STAGES steps of
    skinny_w8a8_rows weight lines of 128 B and the X tile: mt e4m3 lines + mt float scales, or (qx) mt bf16 lines
    of 256 B, then one e4m3 tile + scales; the partial sums [mt, rows + 4] floats reuse it."""
    rows = skinny_w8a8_rows(mt, half)
    stage = rows * 128 + (mt * 256 if qx else mt * 128 + mt * 4)
    return max(SW8_STAGES * stage + (mt * 128 + mt * 4 if qx else 0), mt * (rows + 4) * 4)


def w8a8_wgmma_rows() -> int:
    """Weight rows a kernels/gemm_w8a8_wgmma.cu block: one m64 tile a consumer warpgroup."""
    return 64 * WG8_WGS


def w8a8_wgmma_smem(nt: int) -> int:
    """Dynamic shared memory (bytes) of a kernels/gemm_w8a8_wgmma.cu block for nt activation rows: 1024 of alignment
    slack, its ring of steps (the weight lines and nt e4m3 lines, 128 B each), then the ring's X scales (nt floats
    a step); the partial sums [nt, rows + 4] floats reuse the ring."""
    stages = {64: WG8_STAGES_N64, 128: WG8_STAGES_N128, 256: WG8_STAGES_N256}[nt]
    return _w8a8_ring_smem(stages, w8a8_wgmma_rows(), nt)


def w8a8_tma_smem(nt: int, rows: int) -> int:
    """Dynamic shared memory (bytes) of a kernels/gemm_w8a8_tma.cu block of `rows` weight rows (128: 2 x 1
    warpgroups x tiles, 256: 2 x 2 at nt 64) for nt activation rows: as w8a8_wgmma_smem, then the ring's weight
    scales (one a 128-row block a step)."""
    stages = {(64, 128): WG8_STAGES_N64, (128, 128): WG8_STAGES_N128, (64, 256): WG8_STAGES_R256}[(nt, rows)]
    return _w8a8_ring_smem(stages, rows, nt) + stages * (rows // 128) * 4


def _w8a8_ring_smem(stages: int, rows: int, nt: int) -> int:
    """1024 bytes of alignment slack, a ring of `stages` steps (rows weight lines and nt e4m3 lines, 128 B each),
    then its X scales (nt floats a step); the partial sums [nt, rows + 4] floats must fit the ring."""
    ring = stages * (rows + nt) * 128
    assert nt * (rows + 4) * 4 <= ring
    return 1024 + ring + stages * nt * 4


def nvrtc_defines() -> list[tuple[str, str]]:
    return [(name, str(value)) for name, value in sorted(KERNEL_DEFINES.items())]

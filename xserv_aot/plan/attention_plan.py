"""Which attention kernels an op runs, with their launch records: for decode buckets of a few sequences the
fused kernel (QK-norm + RoPE + KV write of the step's token, then split-KV attention, splits chosen per sequence
at run time from seq_lens, combined in-kernel), the batched flash-decoding kernels (tensor cores or CUDA cores) for
larger decode buckets, and for prefill buckets the flash prefill kernel plus the batched decode kernel on the
one-row (decode) sequences of a mixed step. Constants here are the H200 sweep's choices (docs/cuda-notes.md)."""
from __future__ import annotations

import re

from xserv_aot.plan.kernel_constants import PREFILL_F8KV_STAGING
from xserv_aot.plan.launch_records import f32, i32, kernel, kv, launch, ptr
from xserv_aot.plan.nvrtc_build import KernelBuildError
from xserv_aot.plan.op_records import Attention, KernelChoice, LaunchRecord, QkNormRopeCache

BATCHED_ATTN_MIN_SEQS = 3    # decode attention for >= 3 seqs: the batched kernels below
BATCHED_ATTN_KERNEL = "tc"   # tc: kernels/attention_decode_tc.cu (tensor cores); cc: attention_decode_batched.cu
BATCHED_ATTN_TILE = 64       # keys per tile of either kernel (cc instantiates 64 and 32, tc 64)
BATCHED_ATTN_STAGES = 2      # tiles in the cp.async ring (cc: 2; tc: 2, 3, 4)
BATCHED_ATTN_BLOCKS = 4 * 132  # splits per seq chosen so a full bucket launches about this many blocks
# Prefill attention: v1 (attention_prefill.cu: 64 rows a block, synchronous 64-key tiles) or wWmMkKsS
# (attention_prefill_pipe.cu: W warps of 16 M rows, K-key tiles in an S-deep cp.async ring), built for hd 128;
# PREFILL_ATTN_BOTH_HD also for hd 64.
PREFILL_ATTN_VARIANTS = ("v1", "w8m1k64s2", "w8m1k64s3", "w4m1k64s2", "w4m2k32s2", "w4m2k32s3", "w8m2k32s2",
                         "w4m2k16s3", "w4m2k16s4")
# w{g|s}GhHkKsS[o][p][l][q][e] (attention_prefill_wgmma.cu, hd 128 only): G warpgroups of 64 rows on wgmma, H q heads of
# a KV head a block (4: two a warpgroup, in turn), S-deep ring of K-key tiles copied by every thread (wg) or by a
# producer warpgroup (ws), o: a tile's softmax runs under the previous tile's PV product, p: the warpgroups take
# turns issuing their products (ping-pong), l: lazy softmax (a row's max moves only by > 2^8; rare rescales), q: Q
# in registers (QK^T reads only K from shared memory), e: lean producer copy and descriptors (fewer instructions a
# tile; H200: ws3h1k64s4oe 382 / 476 / 504 TFLOP/s at 2k / 4k / 8k against 359 / 440 / 471 without e).
PREFILL_ATTN_WGMMA = ("wg2h2k64s2", "wg3h1k64s2", "wg2h2k64s4o", "wg3h1k64s4o", "wg2h2k128s2", "ws2h2k64s3",
                      "ws2h2k64s4", "ws2h2k64s4o", "ws2h1k64s4o", "ws2h1k64s3o", "ws2h2k128s3o", "ws3h1k64s3",
                      "ws3h1k64s4", "ws2h4k64s3", "ws2h4k64s4", "ws3h1k64s3o", "ws3h1k64s4o", "ws2h2k64s4op",
                      "ws3h1k64s4op", "ws3h1k64s3ol", "ws2h2k64s4opl", "ws2h2k64s4oplq", "ws2h2k64s4q",
                      "ws3h1k64s4oe", "ws2h2k64s4oplqe")
PREFILL_ATTN_VARIANTS += PREFILL_ATTN_WGMMA
PREFILL_ATTN_BOTH_HD = ("v1", "w8m1k64s2", "w4m2k32s2")
# Defaults per head size, best first, by bucket rows: the first tier whose minimum rows the bucket reaches, in it the
# first variant whose q heads a block divide the model's q heads per KV head (the H200 sweeps, docs/cuda-notes.md).
# Below 2048 rows (session 14, without the empty blocks): ws2h2k64s4 ties ws3h1k64s4oe on one prompt of 128 - 1024
# rows in a 256-slot bucket and leads on chunk mixes (8 x 64, 2 x 256: 0.0125 / 0.0134 ms against 0.0184 / 0.0161);
# ws2h4k64s4 was 1.4 - 1.7x slower on single prompts.
PREFILL_ATTN_TIERS = ((2048, {128: ("ws3h1k64s4oe",)}),
                      (0, {128: ("ws2h2k64s4", "w4m2k16s4")}))
PREFILL_ATTN_OTHER_HD = "w8m1k64s2"         # head sizes without a sweep (hd 64: tested, not timed)
# Prefill kernels' grid rows beyond one prompt's query tiles (prefill_grid_rows); a seq adds at most one partial
# tile, and the blocks loop over the (seq, tile) pairs past the grid (kernels/prefill_tiles.cuh next_pair). A row
# per seq slot (256) made 8192 wgmma blocks a layer that found no work: +56 us a 4096-row layer (session 14); the
# pipe kernels 0.035 -> 0.019 ms at 8 x 64 rows (session 15). v1 keeps a row per seq slot: looping made it 22 - 25%
# slower on one prompt (session 15).
PREFILL_EXTRA_TILES = 16
# An FP8 KV cache (kernels/kv_fp8.cuh): the variants built as attn_prefill_f8kv_*: pipe kernels with an e4m3 ring
# (attention_prefill_pipe.cu), wgmma kernels whose producer warpgroup converts staged e4m3 tiles into the bf16 ring
# (attention_prefill_wgmma.cu). hd 128 default: the bf16 tier's variant where it is built here, else the first;
# hd 64: PREFILL_ATTN_F8KV_HD64 only.
PREFILL_ATTN_F8KV = ("w4m2k16s4", "w8m1k64s2", "w8m1k64s3", "ws3h1k64s4oe", "ws2h2k64s4")
PREFILL_ATTN_F8KV_HD64 = "w8m1k64s2"
FEW_ATTN_F8KV_STAGES = (3, 4)   # fused few-seq kernel over an FP8 cache: the ring depths built (hd 64: 3)
TC_F8KV_STAGES = (2, 3, 4)      # batched tensor-core kernel over an FP8 cache: the ring depths built (hd 64: 2, 4)
BATCHED_ATTN_F8KV_STAGES = 4    # ... the one plans take (H200 sweep, docs/cuda-notes.md)
TC_F8KVN_MAX_G = 8              # its heads-on-n twin (attn_decode_tc_f8kvn_b{blocks}_s{stages}_hd*): the query
#                                 heads of a kv head on the MMAs' n8 side, so at most 8
TC_F8KVN_VARIANTS = ((4, 2), (4, 3), (4, 4), (5, 2), (6, 2))   # ... the (blocks an SM, ring depth) pairs built
BATCHED_ATTN_F8KVN_VARIANT = (4, 2)   # ... the one plans take where G allows (H200 sweep); None: the kernel above
_PIPE = re.compile(r"w(\d+)m(\d+)k(\d+)s(\d+)")
_WGMMA = re.compile(r"w([gs])(\d)h(\d)k(\d+)s(\d)o?p?l?q?e?")
FEW_ATTN_STAGES = 3          # fused few-seq kernel: tiles of 64 keys in its cp.async ring (2, 3, 4, 6 built)
FEW_ATTN_MIN_TILES = 1       # ... a split holds >= this many tiles
# ... and a sequence of <= stages - 1 tiles (all copied at once) is one split: no combine
FEW_ATTN_BLOCKS = 2 * 132    # ... grid z: the longest context's splits fill the SMs about twice
TC_TILE = 64                 # keys per tile of attention_decode_tc.cu (both kernels)


def tc_ring_smem(stages: int, hd: int, fp8: bool = False) -> int:
    """The K/V ring of attention_decode_tc.cu (TcSmem): rows padded to hd + 8 bf16, or (fp8) unpadded rows of hd
    e4m3 bytes (read and converted in registers)."""
    if fp8:
        return stages * 2 * TC_TILE * hd
    return stages * 2 * TC_TILE * (hd + 8) * 2


def few_seq_smem(stages: int, hd: int, block_ids: int, fp8: bool = False) -> int:
    """Dynamic shared memory of attn_decode_fused[_f8kv]_s{stages}_hd{hd}: the K/V ring, q of 16 MMA rows and the
    new token's k and v (bf16 space), then block_ids ints (the block ids of a split's keys)."""
    return tc_ring_smem(stages, hd, fp8) + (16 * (hd + 8) + 2 * hd) * 2 + 4 * block_ids


def kv_suffix(scales: tuple[float, float] | None) -> str:
    """The kernel name part of an FP8-KV variant; scales: the layer's (k, v) scales, None for a bf16 cache."""
    return "_f8kv" if scales else ""


def kv_scale_args(scales: tuple[float, float] | None) -> list:
    return [f32(scales[0]), f32(scales[1])] if scales else []


def few_seq_block_ids(max_seq_len: int, splits: int, min_tiles: int, solo_tiles: int, block_size: int) -> int:
    """Most KV blocks one split of the fused kernel spans, over every context <= max_seq_len (its split rule:
    attention_decode_tc.cu fused_min_tiles, attention_split.cuh split_range)."""
    most = 0
    for tiles in range(1, -(-max_seq_len // TC_TILE) + 1):
        want = 1 if tiles <= solo_tiles else min(splits, -(-tiles // min_tiles))
        most = max(most, -(-tiles // want))
    return -(-most * TC_TILE // block_size) + 1


def few_seq_splits(num_seqs: int, nkv: int, max_seq_len: int) -> int:
    """Grid z of the fused kernel: the most splits a sequence may use (FEW_ATTN_BLOCKS blocks at max_seq_len)."""
    return max(1, min(-(-max_seq_len // TC_TILE), -(-FEW_ATTN_BLOCKS // (num_seqs * nkv))))


def fuses_rope(kind: str, rope: QkNormRopeCache, attn: Attention) -> bool:
    """Decode buckets of < BATCHED_ATTN_MIN_SEQS seqs: the attention kernel does the QK-norm / RoPE / KV write of the
    rope op just before it (which then launches nothing)."""
    return (kind == "decode" and attn.num_seqs < BATCHED_ATTN_MIN_SEQS and rope.q_out == attn.q
            and rope.layer == attn.layer and rope.kv_cache == attn.kv_cache)


def few_seq_attn_launch(op: Attention, rope: QkNormRopeCache, m: dict, max_seq_len: int, common: list,
                        tail: list, scales: tuple[float, float] | None = None) -> LaunchRecord:
    """The fused kernel over the bucket's seqs; grid z = the most splits a seq may use (short ones exit at once)."""
    nkv, hd = m["num_kv_heads"], m["head_dim"]
    splits = few_seq_splits(op.num_seqs, nkv, max_seq_len)
    solo = FEW_ATTN_STAGES - 1
    if scales and FEW_ATTN_STAGES not in FEW_ATTN_F8KV_STAGES:
        raise KernelBuildError(f"FP8 KV cache: the fused decode attention is built for {FEW_ATTN_F8KV_STAGES} stages")
    smem = few_seq_smem(FEW_ATTN_STAGES, hd, few_seq_block_ids(max_seq_len, splits, FEW_ATTN_MIN_TILES, solo,
                                                                tail[0][1]), bool(scales))
    rope_args = [ptr(rope.qkv), ptr(rope.positions), ptr(rope.slot_mapping), ptr(rope.q_norm), ptr(rope.k_norm),
                 ptr(rope.cos), ptr(rope.sin), ptr(rope.q_out)]
    return launch(f"attn_decode_fused{kv_suffix(scales)}_s{FEW_ATTN_STAGES}_hd{hd}", [op.num_seqs, nkv, splits], [128],
                  smem, rope_args + common[1:] + [ptr("attn_part_o"), ptr("attn_part_ml"), ptr("attn_counters"),
                                                  ptr(op.out), i32(op.rows), i32(m["num_heads"]), i32(nkv),
                                                  *tail[:3], f32(rope.eps), tail[3], i32(FEW_ATTN_MIN_TILES),
                                                  i32(solo)] + kv_scale_args(scales))


def batched_attn_launch(op: Attention, m: dict, max_seq_len: int, common: list, tail: list,
                        scales: tuple[float, float] | None = None) -> LaunchRecord:
    """The batched decode kernel over every seq row of the op: splits so the bucket fills the SMs."""
    seqs, nkv, hd = op.num_seqs, m["num_kv_heads"], m["head_dim"]
    g = m["num_heads"] // nkv
    splits = max(1, min(-(-max_seq_len // BATCHED_ATTN_TILE), -(-BATCHED_ATTN_BLOCKS // (seqs * nkv))))
    if scales and BATCHED_ATTN_KERNEL != "tc":
        raise KernelBuildError("FP8 KV cache: batched decode attention is built only as the tc kernel")
    if BATCHED_ATTN_KERNEL == "tc" and scales and BATCHED_ATTN_F8KVN_VARIANT and g <= TC_F8KVN_MAX_G:
        blocks, stages = BATCHED_ATTN_F8KVN_VARIANT
        smem = tc_ring_smem(stages, hd, True)
        name = f"attn_decode_tc_f8kvn_b{blocks}_s{stages}_hd{hd}"
    elif BATCHED_ATTN_KERNEL == "tc":
        stages = BATCHED_ATTN_F8KV_STAGES if scales else BATCHED_ATTN_STAGES
        smem = tc_ring_smem(stages, hd, bool(scales))
        name = f"attn_decode_tc{kv_suffix(scales)}_s{stages}_hd{hd}"
    else:
        smem = BATCHED_ATTN_STAGES * 2 * BATCHED_ATTN_TILE * hd * 2
        name = f"attn_decode_b_t{BATCHED_ATTN_TILE}s{BATCHED_ATTN_STAGES}_hd{hd}_g{4 if g <= 4 else 8}"
    return launch(name, [seqs, nkv, splits], [128], smem,
                  common + [ptr("attn_part_o"), ptr("attn_part_ml"), ptr("attn_counters"), ptr(op.out),
                            i32(op.rows), i32(m["num_heads"]), i32(nkv), *tail] + kv_scale_args(scales))


def prefill_attn_source(variant: str) -> str:
    """The kernels/ file that defines a prefill attention variant's kernels."""
    if variant == "v1":
        return "attention_prefill.cu"
    return "attention_prefill_wgmma.cu" if variant in PREFILL_ATTN_WGMMA else "attention_prefill_pipe.cu"


def prefill_tiles(variant: str) -> tuple[int, int, int]:
    """(query rows, q heads) a block of a prefill attention variant covers, and the keys of its K/V tiles."""
    if variant == "v1":
        return 64, 1, 64
    if variant in PREFILL_ATTN_WGMMA:
        groups, heads, keys, _ = (int(x) for x in _WGMMA.fullmatch(variant).groups()[1:])
        return 64 * groups // min(heads, groups), heads, keys
    warps, mt, keys, _ = (int(x) for x in _PIPE.fullmatch(variant).groups())
    return 16 * warps * mt, 1, keys


def default_prefill_variant(m: dict, rows: int, fp8_kv: bool = False) -> str:
    """The default prefill attention variant for this model and a bucket of `rows` query rows."""
    hd, group = m["head_dim"], m["num_heads"] // m["num_kv_heads"]
    table = next(t for least, t in PREFILL_ATTN_TIERS if rows >= least)
    choice = next((v for v in table.get(hd, ()) if group % prefill_tiles(v)[1] == 0), PREFILL_ATTN_OTHER_HD)
    if fp8_kv and (hd != 128 or choice not in PREFILL_ATTN_F8KV):
        return PREFILL_ATTN_F8KV[0] if hd == 128 else PREFILL_ATTN_F8KV_HD64
    return choice


def prefill_grid_rows(op: Attention, rows_per_tile: int) -> int:
    """Grid rows of a prefill attention launch: the bucket's query tiles + PREFILL_EXTRA_TILES partial ones."""
    return -(-op.rows // rows_per_tile) + min(op.num_seqs, PREFILL_EXTRA_TILES)


def prefill_attn_launch(op: Attention, m: dict, common: list, tail: list, variant: str | None = None,
                        min_rows: int = 2, scales: tuple[float, float] | None = None) -> LaunchRecord:
    """The flash prefill kernel (variant: the model's default) over every seq of >= min_rows query rows; it
    zeroes the rows no seq covers. scales: an FP8 cache's layer scales (the attn_prefill_f8kv_* kernels)."""
    nh, hd = m["num_heads"], m["head_dim"]
    variant = variant or default_prefill_variant(m, op.rows, bool(scales))
    args = common + [ptr(op.out), i32(op.rows), i32(op.num_seqs), i32(nh), i32(m["num_kv_heads"]), *tail,
                     i32(min_rows)]
    if scales and (variant not in PREFILL_ATTN_F8KV or (hd != 128 and variant != PREFILL_ATTN_F8KV_HD64)):
        raise KernelBuildError(f"prefill attention {variant} has no FP8 KV cache variant (built: "
                               f"{', '.join(PREFILL_ATTN_F8KV)}; hd 64: {PREFILL_ATTN_F8KV_HD64}); use "
                               f"--prefill-attention auto")
    fn = f"attn_prefill_{'f8kv_' if scales else ''}{variant}_hd{hd}"           # (v1: its own name, no FP8 build)
    if variant in PREFILL_ATTN_WGMMA:
        mode, *shape = _WGMMA.fullmatch(variant).groups()
        groups, heads, keys, stages = (int(x) for x in shape)
        if hd != 128 or (nh // m["num_kv_heads"]) % heads:
            raise KernelBuildError(f"prefill attention {variant}: needs head_dim 128 and q heads per KV head "
                                   f"divisible by {heads} (head_dim {hd}, {nh} q heads, {m['num_kv_heads']} KV heads)")
        q_tiles = groups * heads // min(heads, groups)                # 64 rows of one head each
        smem = (q_tiles * 64 + stages * 2 * keys) * hd * 2 + 1024   # Q tiles, K/V ring, 1024-B alignment
        if scales:
            smem += PREFILL_F8KV_STAGING * 2 * keys * hd             # the staged e4m3 K/V tiles
        grid = [nh // heads, prefill_grid_rows(op, prefill_tiles(variant)[0])]
        return launch(fn, grid, [128 * groups + (128 if mode == "s" else 0)], smem, args + kv_scale_args(scales))
    if variant == "v1":
        return launch(f"attn_prefill_hd{hd}", [-(-op.rows // 64) + op.num_seqs, nh], [128], 0, args)   # a seq slot each
    warps, mt, keys, stages = (int(x) for x in _PIPE.fullmatch(variant).groups())
    if scales:
        smem = stages * 2 * keys * hd + 2 * keys * (hd + 8) * 2          # e4m3 ring + the converted bf16 pair
    else:
        smem = stages * 2 * keys * (hd + 8) * 2                          # K and V tiles, rows padded to hd + 8
    return launch(fn, [nh, prefill_grid_rows(op, prefill_tiles(variant)[0])], [32 * warps], smem,
                  args + kv_scale_args(scales))


def plan_attention(op: Attention, kind: str, m: dict, attn: dict, block_size: int, max_blocks: int,
                   num_slots: int, rope: QkNormRopeCache | None = None,
                   scales: tuple[float, float] | None = None) -> KernelChoice:
    """Decode buckets: the fused few-seq kernel (rope: the op it absorbs, see fuses_rope) or the batched
    flash-decoding kernel. Prefill buckets: the flash prefill kernel, plus the batched decode kernel for the
    one-row (decode) seqs of a mixed step (attn["prefill"]: the build's prefill_attention variant). scales: the
    layer's (k, v) scales of an FP8 KV cache: every kernel its _f8kv variant."""
    hd, nh, nkv = m["head_dim"], m["num_heads"], m["num_kv_heads"]
    common = [ptr(op.q), kv(op.layer), ptr(op.query_start_loc), ptr(op.seq_lens), ptr(op.block_tables)]
    tail = [i32(block_size), i32(max_blocks), i32(num_slots), f32(op.scale)]
    if rope is not None:
        rec = few_seq_attn_launch(op, rope, m, attn["max_seq_len"], common, tail, scales)
        return kernel(rec, splits=rec.grid[2])
    dec = batched_attn_launch(op, m, attn["max_seq_len"], common, tail, scales)
    if kind == "decode":
        return KernelChoice(dec.fn, (dec,), splits=dec.grid[2])
    variant = attn.get("prefill", "auto")
    pre = prefill_attn_launch(op, m, common, tail, None if variant == "auto" else variant, scales=scales)
    return KernelChoice(pre.fn, (pre, dec), splits=dec.grid[2])

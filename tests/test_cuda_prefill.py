"""Every flash prefill attention variant (attention_plan.PREFILL_ATTN_VARIANTS, the plan's geometry) against the
NumPy attention op on fresh random inputs: prompt chunks at an offset (prefix-cache hits, chunked prefill),
partially filled blocks, several seqs of mixed lengths over more than one query tile, empty seq slots, rows of
padding (zeroed), one-row seqs left alone under the mixed-step min_rows 2, more (seq, tile) pairs than the grid has
rows (the blocks loop); outputs poisoned with NaN; a second launch and a CUDA-graph replay (PDL on)
bit-identical to the first launch."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import bf, lib, rng  # noqa: F401  (fixtures)
from tests.test_cuda_kernels import check, paged_setup
from xserv_aot.plan import attention_plan
from xserv_aot.plan.op_records import Attention
from xserv_aot.runtime import numpy_ops as ref

pytestmark = pytest.mark.gpu
BLOCK_SIZE, MAX_BLOCKS = 16, 64
# (new query rows, context length) per seq: n < ctx is a chunk at offset ctx - n; ctx % 16 != 0 a partial block
CASES = {
    "mixed": [(50, 50), (70, 200), (0, 0), (1, 33), (130, 130), (2, 2)],
    "tiles": [(300, 1000), (129, 129), (17, 17), (200, 455), (0, 0), (0, 0)],
    "offsets": [(1, 1), (127, 1024), (64, 65), (256, 256), (3, 900)],
}
# 40 short seqs (2 - 40 rows at offsets 0 - 50, seed 14): 40 partial tiles against a grid of
# ceil(rows / tile) + PREFILL_EXTRA_TILES rows, so blocks take several pairs and their rings wrap across seqs
_many = np.random.default_rng(14)
CASES["many"] = [(int(n), int(n + o)) for n, o in zip(_many.integers(2, 41, 40), _many.integers(0, 51, 40))]


def prefill_inputs(lib, rng, seqs, nh, nkv, hd, pad=7, q_scale=1.0):
    qsl, lens, tables, kv = paged_setup(rng, seqs, nkv, hd, BLOCK_SIZE, max_blocks=MAX_BLOCKS)
    T = int(qsl[-1]) + pad
    q = bf(q_scale * rng.standard_normal((T, nh, hd)))
    dev = [lib.to_device(q, "bfloat16"), lib.to_device(kv, "bfloat16"), lib.to_device(qsl), lib.to_device(lens),
           lib.to_device(tables)]
    return (q, kv, qsl, lens, tables), dev, T


def prefill_launch(variant, seqs, T, nh, nkv, hd, dev, out, min_rows):
    """(record, argument list) of the plan's prefill launch for this variant on these device arrays."""
    op = Attention(q="q", kv_cache="kv_cache", layer=0, query_start_loc="qsl", seq_lens="lens", block_tables="bt",
                   out="attn", rows=T, num_seqs=len(seqs), num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                   scale=hd ** -0.5)
    m = {"num_heads": nh, "num_kv_heads": nkv, "head_dim": hd}
    rec = attention_plan.prefill_attn_launch(op, m, [], [], variant, min_rows)
    args = [("ptr", a) for a in dev] + [("ptr", out), ("i32", T), ("i32", len(seqs)), ("i32", nh), ("i32", nkv),
                                        ("i32", BLOCK_SIZE), ("i32", MAX_BLOCKS), ("i32", dev[1].shape[1]),
                                        ("f32", hd ** -0.5), ("i32", min_rows)]
    return rec, args


SHAPES = [(v, 128, 32, 8) for v in attention_plan.PREFILL_ATTN_VARIANTS] + \
         [(v, 64, 9, 3) for v in attention_plan.PREFILL_ATTN_BOTH_HD]           # (variant, hd, nh, nkv)


@pytest.mark.parametrize("variant,hd,nh,nkv", SHAPES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("min_rows", [1, 2])
def test_prefill_attention(lib, rng, variant, hd, nh, nkv, case, min_rows):
    seqs = CASES[case]
    (q, kv, qsl, lens, tables), dev, T = prefill_inputs(lib, rng, seqs, nh, nkv, hd)
    out = lib.empty((T, nh * hd), "bfloat16")
    rec, args = prefill_launch(variant, seqs, T, nh, nkv, hd, dev, out, min_rows)
    lib.launch(rec.fn, rec.grid, rec.block, args, smem=rec.smem)
    got = out.numpy()
    want = ref.attention(q, kv, qsl, lens, tables, BLOCK_SIZE, hd ** -0.5)
    skipped = [r for i, (n, _) in enumerate(seqs) if 0 < n < min_rows for r in range(qsl[i], qsl[i + 1])]
    if skipped:
        assert np.isnan(got[skipped]).all(), f"{rec.fn}: seqs of < min_rows rows belong to the decode kernel"
    rows = np.setdiff1d(np.arange(int(qsl[-1])), skipped)
    check(got[rows], want[rows])
    assert not got[qsl[-1]:].any(), f"{rec.fn}: padding rows not zeroed"


def run_and_check(lib, rng, variant, seqs, nh, nkv, hd, min_rows, q_scale=1.0):
    (q, kv, qsl, lens, tables), dev, T = prefill_inputs(lib, rng, seqs, nh, nkv, hd, q_scale=q_scale)
    out = lib.empty((T, nh * hd), "bfloat16")
    rec, args = prefill_launch(variant, seqs, T, nh, nkv, hd, dev, out, min_rows)
    lib.launch(rec.fn, rec.grid, rec.block, args, smem=rec.smem)
    got = out.numpy()
    want = ref.attention(q, kv, qsl, lens, tables, BLOCK_SIZE, hd ** -0.5)
    check(got[:qsl[-1]], want[:qsl[-1]])
    assert not got[qsl[-1]:].any(), f"{rec.fn}: padding rows not zeroed"


# wgmma kernels: many query tiles and key tiles a seq (the ring wraps), chunks at offsets that are not multiples of
# a tile, peaked softmax (q x 4: row maxima move late), and q heads per KV head 3 and 1 for the one-head variants.
LONG = [(700, 900), (129, 129), (64, 1000), (1, 5), (250, 251)]
WGMMA_SHAPES = [(v, 32, 8) for v in attention_plan.PREFILL_ATTN_WGMMA] + \
               [(v, nh, nkv) for v in attention_plan.PREFILL_ATTN_WGMMA if "h1" in v for nh, nkv in ((12, 4), (4, 4))]


@pytest.mark.parametrize("variant,nh,nkv", WGMMA_SHAPES)
def test_wgmma_prefill_long_seqs_and_head_groups(lib, rng, variant, nh, nkv):
    run_and_check(lib, rng, variant, LONG, nh, nkv, 128, 1, q_scale=4.0)


@pytest.mark.parametrize("variant", attention_plan.PREFILL_ATTN_VARIANTS)
@pytest.mark.parametrize("case", ["tiles", "many"])
def test_prefill_attention_replay(lib, rng, variant, case):
    """Relaunch and graph replay (PDL attribute on, as the runner captures) rewrite every element identically."""
    from xserv_aot.runtime.cuda.driver import Launch
    seqs, nh, nkv, hd = CASES[case], 32, 8, 128
    _, dev, T = prefill_inputs(lib, rng, seqs, nh, nkv, hd)
    out = lib.empty((T, nh * hd), "bfloat16")
    rec, args = prefill_launch(variant, seqs, T, nh, nkv, hd, dev, out, 2)
    lib.launch(rec.fn, rec.grid, rec.block, args, smem=rec.smem)
    first = out.numpy()
    assert np.isfinite(first).all()
    poison = np.full(out.shape, 0x7FC0, np.uint16)
    lib.dev.htod(out.ptr, poison)
    lib.launch(rec.fn, rec.grid, rec.block, args, smem=rec.smem)
    np.testing.assert_array_equal(out.numpy(), first, err_msg=f"{rec.fn}: relaunch")
    pl = Launch(rec.fn, lib.func(rec.fn, rec.smem), rec.grid, rec.block, rec.smem,
                [(t, v.ptr if hasattr(v, "ptr") else v) for t, v in args], pdl=True)
    graph = lib.dev.capture(pl)
    lib.dev.htod(out.ptr, poison)
    lib.dev.graph_launch(graph)
    lib.dev.sync()
    np.testing.assert_array_equal(out.numpy(), first, err_msg=f"{rec.fn}: graph replay")

"""Batched-decode kernels against the NumPy attention op: the flash-decoding kernel (attention_decode_batched.cu)
for every tile/stage variant and split count, and a mixed step (prefill kernel with min_rows 2 + the batched
kernel on the decode rows of the same op). Fresh random inputs, outputs poisoned with NaN, padding rows zero,
split counters reset, a second launch bit-identical."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import bf, lib, rng  # noqa: F401  (fixtures)
from tests.test_cuda_kernels import check, paged_setup
from xserv_aot.plan import attention_plan
from xserv_aot.plan.op_records import Attention
from xserv_aot.runtime import numpy_ops as ref

pytestmark = pytest.mark.gpu
CC_VARIANTS = [(64, 2), (32, 2)]                               # (tile, stages) of attention_decode_batched.cu
TC_STAGES = {64: (2, 3), 128: (2, 3, 4)}                        # attention_decode_tc.cu instantiations


def variants(hd: int, g: int):
    """(kernel, dynamic smem) of every batched decode attention kernel built for this head size."""
    out = [(f"attn_decode_b_t{t}s{st}_hd{hd}_g{4 if g <= 4 else 8}", st * 2 * t * hd * 2) for t, st in CC_VARIANTS]
    return out + [(f"attn_decode_tc_s{st}_hd{hd}", st * 2 * 64 * (hd + 8) * 2) for st in TC_STAGES[hd]]


def batched_args(q, kv, qsl, lens, tables, out, po, pml, counters, T, nh, nkv, hd, block_size, max_blocks,
                 num_slots):
    """Arguments of the batched decode kernels (attn_decode_b_*, attn_decode_tc_*), every array on the device."""
    return [("ptr", q), ("ptr", kv), ("ptr", qsl), ("ptr", lens), ("ptr", tables), ("ptr", po), ("ptr", pml),
            ("ptr", counters), ("ptr", out), ("i32", T), ("i32", nh), ("i32", nkv), ("i32", block_size),
            ("i32", max_blocks), ("i32", num_slots), ("f32", hd ** -0.5)]


@pytest.mark.parametrize("hd,nh,nkv", [(128, 32, 8), (64, 9, 3), (128, 64, 8)])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_attention_decode_batched(lib, rng, hd, nh, nkv, splits):
    seqs = [(1, 1), (1, 300), (1, 700), (0, 0), (1, 17), (1, 64), (1, 1000)]
    block_size, max_blocks = 16, 64
    g = nh // nkv
    qsl, lens, tables, kv = paged_setup(rng, seqs, nkv, hd)
    T = int(qsl[-1]) + 2                                           # padding rows past the tokens
    q = bf(rng.standard_normal((T, nh, hd)))
    want = ref.attention(q, kv, qsl, lens, tables, block_size, hd ** -0.5)
    dev = (lib.to_device(q, "bfloat16"), lib.to_device(kv, "bfloat16"), lib.to_device(qsl), lib.to_device(lens),
           lib.to_device(tables))
    for fn, smem in variants(hd, g):
        out = lib.empty((T, nh * hd), "bfloat16")
        po, pml = lib.empty((len(seqs), nh, splits, hd), "float32"), lib.empty((len(seqs), nh, splits, 2), "float32")
        counters = lib.to_device(np.zeros((len(seqs), nkv), np.int32))
        args = batched_args(*dev, out, po, pml, counters, T, nh, nkv, hd, block_size, max_blocks, kv.shape[1])
        lib.launch(fn, [len(seqs), nkv, splits], [128], args, smem=smem)
        first = out.numpy()
        check(first, want)
        assert not first[qsl[-1]:].any(), f"{fn}: padding rows not zeroed"
        assert not counters.numpy().any(), f"{fn}: split counters must be reset for the next launch"
        lib.dev.htod(out.ptr, np.full(out.shape, 0x7FC0, np.uint16))
        lib.launch(fn, [len(seqs), nkv, splits], [128], args, smem=smem)
        np.testing.assert_array_equal(out.numpy(), first, err_msg=fn)


@pytest.mark.parametrize("hd,nh,nkv", [(128, 32, 8), (64, 9, 3)])
def test_mixed_step_attention(lib, rng, hd, nh, nkv):
    """Decode rows (one query) and prompt chunks in one op: the prefill kernel skips seqs of < 2 rows, the
    batched decode kernel takes exactly those; together they equal the reference on every row."""
    seqs = [(1, 300), (50, 50), (1, 17), (70, 200), (0, 0), (1, 1), (33, 97)]
    block_size, max_blocks = 16, 64
    qsl, lens, tables, kv = paged_setup(rng, seqs, nkv, hd)
    T = int(qsl[-1]) + 5
    q = bf(rng.standard_normal((T, nh, hd)))
    out = lib.empty((T, nh * hd), "bfloat16")
    op = Attention(q="q", kv_cache="kv_cache", layer=0, query_start_loc="qsl", seq_lens="lens", block_tables="bt",
                   out="attn", rows=T, num_seqs=len(seqs), num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                   scale=hd ** -0.5)
    m = {"num_heads": nh, "num_kv_heads": nkv, "head_dim": hd}
    dec = attention_plan.batched_attn_launch(op, m, block_size * max_blocks, [], [])   # the plan's kernel, grid and smem
    splits = dec.grid[2]
    po, pml = lib.empty((len(seqs), nh, splits, hd), "float32"), lib.empty((len(seqs), nh, splits, 2), "float32")
    counters = lib.to_device(np.zeros((len(seqs), nkv), np.int32))
    dq, dkv, dqsl, dlens, dtab = (lib.to_device(q, "bfloat16"), lib.to_device(kv, "bfloat16"), lib.to_device(qsl),
                                  lib.to_device(lens), lib.to_device(tables))
    lib.launch(f"attn_prefill_hd{hd}", [-(-T // 64) + len(seqs), nh], [128],
               [("ptr", dq), ("ptr", dkv), ("ptr", dqsl), ("ptr", dlens), ("ptr", dtab), ("ptr", out), ("i32", T),
                ("i32", len(seqs)), ("i32", nh), ("i32", nkv), ("i32", block_size), ("i32", max_blocks),
                ("i32", kv.shape[1]), ("f32", hd ** -0.5), ("i32", 2)])
    got = out.numpy()
    decode_rows = [int(qsl[i]) for i, (n, _) in enumerate(seqs) if n == 1]
    assert np.isnan(got[decode_rows]).all(), "the prefill kernel must leave one-row seqs to the decode kernel"
    lib.launch(dec.fn, dec.grid, dec.block, batched_args(dq, dkv, dqsl, dlens, dtab, out, po, pml, counters, T, nh,
                                                         nkv, hd, block_size, max_blocks, kv.shape[1]), smem=dec.smem)
    want = ref.attention(q, kv, qsl, lens, tables, block_size, hd ** -0.5)
    got = out.numpy()
    check(got, want)
    assert not got[qsl[-1]:].any()

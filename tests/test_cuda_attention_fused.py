"""The fused few-seq decode attention (QK-norm + RoPE + KV write + split-KV attention in one kernel,
attention_decode_tc.cu attn_decode_fused_*) against the two NumPy ops it replaces (qk_norm_rope_cache, then
attention), on fresh random inputs, with the launch geometry the plan writes (plan.attention_plan).

Outputs (attention out, q_out) are poisoned with NaN before every launch; the KV cache must change in exactly the
new tokens' slots. Padding rows (decode_2 with one live sequence: slot -1, seq_len 0) write nothing but zeros in
out. A CUDA-graph replay of the launch is bit-identical to the eager launch.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import bf, lib, rng  # noqa: F401  (fixtures)
from tests.test_cuda_kernels import check, rope_tables
from xserv_aot.dtypes import encode
from xserv_aot.plan import attention_plan as ap
from xserv_aot.plan.op_records import Attention, QkNormRopeCache
from xserv_aot.plan.signatures import kernel_signatures
from xserv_aot.runtime import numpy_ops as ref

pytestmark = pytest.mark.gpu
BS, MAX_SEQ_LEN, EPS = 16, 8192, 1e-6
SMEM_MAX = ap.few_seq_smem(6, 128, 1024)   # >= every variant below (6 stages, room for 1024 block ids)


def few_seq_launch(num_seqs, nh, nkv, hd, norm, stages=None, min_tiles=None, solo=None, block_ids=None):
    """The plan's launch record for a decode bucket of num_seqs (stages / min_tiles / solo: a variant of it;
    block_ids: room for fewer block ids than a split spans, so the kernel reads the block table directly)."""
    rope = QkNormRopeCache(qkv="qkv", positions="positions", slot_mapping="slot_mapping",
                           q_norm="q_norm" if norm else None, k_norm="k_norm" if norm else None, cos="cos", sin="sin",
                           q_out="q", kv_cache="kv_cache", layer=0, rows=num_seqs, eps=EPS, num_heads=nh,
                           num_kv_heads=nkv, head_dim=hd)
    attn = Attention(q="q", kv_cache="kv_cache", layer=0, query_start_loc="qsl", seq_lens="seq_lens",
                     block_tables="block_tables", out="out", rows=num_seqs, num_seqs=num_seqs, num_heads=nh,
                     num_kv_heads=nkv, head_dim=hd, scale=hd ** -0.5)
    assert ap.fuses_rope("decode", rope, attn)
    m = {"num_heads": nh, "num_kv_heads": nkv, "head_dim": hd}
    common = [("ptr", "q"), ("kv", 0), ("ptr", "qsl"), ("ptr", "seq_lens"), ("ptr", "block_tables")]
    tail = [("i32", BS), ("i32", MAX_SEQ_LEN // BS), ("i32", -1), ("f32", attn.scale)]   # num_slots set per case
    rec = ap.few_seq_attn_launch(attn, rope, m, MAX_SEQ_LEN, common, tail)
    if stages is not None:
        ids = block_ids or ap.few_seq_block_ids(MAX_SEQ_LEN, rec.grid[2], min_tiles, solo, BS)
        rec = type(rec)(rec.fn.replace(f"_s{ap.FEW_ATTN_STAGES}_", f"_s{stages}_"),
                        rec.args[:-2] + (("i32", min_tiles), ("i32", solo)), rec.grid, rec.block,
                        ap.few_seq_smem(stages, hd, ids))
    return rec


def make_case(rng, lens, nh, nkv, hd, norm):  # noqa: F811
    """lens: context length after the step per sequence slot (0: a padding slot, after the live ones)."""
    B = len(lens)
    live = [L for L in lens if L > 0]
    nbs = [-(-L // BS) for L in live]
    num_blocks = sum(nbs) + 3
    kv = bf(rng.standard_normal((2, num_blocks * BS, nkv, hd)))
    perm = rng.permutation(num_blocks)
    tables = np.zeros((B, MAX_SEQ_LEN // BS), np.int32)
    used = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    qsl = np.array([0] + [min(i + 1, len(live)) for i in range(B)], np.int32)
    pos = np.zeros(B, np.int32)
    slots = np.full(B, -1, np.int32)
    for i, L in enumerate(live):
        pos[i] = L - 1
        slots[i] = tables[i, (L - 1) // BS] * BS + (L - 1) % BS
    c = dict(qkv=bf(rng.standard_normal((B, (nh + 2 * nkv) * hd))), positions=pos, slot_mapping=slots,
             qsl=qsl, seq_lens=np.array(lens, np.int32), block_tables=tables, kv=kv)
    c["q_norm"], c["k_norm"] = (bf(1 + 0.2 * rng.standard_normal(hd)), bf(1 + 0.2 * rng.standard_normal(hd))) \
        if norm else (None, None)
    c["cos"], c["sin"] = rope_tables(MAX_SEQ_LEN, hd)
    return c


def reference(c, nh, nkv, hd):
    """(q [B, nh, hd], out [B, nh * hd], kv after the step) from the NumPy ops, each output rounded to bf16 as the
    bf16 buffers of a plan hold it."""
    kv = c["kv"].copy()
    q = ref.qk_norm_rope_cache(c["qkv"], c["positions"], c["slot_mapping"], c["q_norm"], c["k_norm"], c["cos"],
                               c["sin"], kv, nh, nkv, hd, EPS)
    q, kv = bf(q), bf(kv)
    out = ref.attention(q, kv, c["qsl"], c["seq_lens"], c["block_tables"], BS, hd ** -0.5)
    return q, out, kv


def device_args(lib, rec, c, nh, hd):  # noqa: F811
    B, nkv = len(c["seq_lens"]), c["kv"].shape[2]
    bufs = {k: lib.to_device(c[k], "bfloat16") for k in ("qkv", "q_norm", "k_norm") if c[k] is not None}
    bufs.update({k: lib.to_device(c[k]) for k in ("positions", "slot_mapping", "qsl", "seq_lens", "block_tables",
                                                   "cos", "sin")})
    bufs["kv"] = lib.to_device(c["kv"], "bfloat16")
    bufs["q"], bufs["out"] = lib.empty((B, nh, hd), "bfloat16"), lib.empty((B, nh * hd), "bfloat16")
    S = rec.grid[2]
    bufs["attn_part_o"] = lib.empty((B * nh * S * hd,), "float32")
    bufs["attn_part_ml"] = lib.empty((B * nh * S * 2,), "float32")
    bufs["attn_counters"] = lib.to_device(np.zeros((B, nkv), np.int32))
    args = []
    for kind, v in rec.args:
        if kind == "kv":
            args.append(("ptr", bufs["kv"]))
        elif kind == "ptr":
            args.append(("ptr", bufs[v] if v is not None else 0))
        else:
            args.append((kind, v))
    names = [p["name"] for p in kernel_signatures("attention_decode_tc.cu")[rec.fn]]
    args[names.index("num_slots")] = ("i32", c["kv"].shape[1])
    return bufs, args


def poison(lib, *arrs):
    for a in arrs:
        lib.dev.htod(a.ptr, np.full(a.shape, 0x7FC0, np.uint16))


def run_and_check(lib, c, rec, nh, nkv, hd):  # noqa: F811
    q_ref, out_ref, kv_ref = reference(c, nh, nkv, hd)
    bufs, args = device_args(lib, rec, c, nh, hd)
    lib.func(rec.fn, SMEM_MAX)                            # first use sets the function's limit: the largest variant
    lib.launch(rec.fn, rec.grid, rec.block, args, smem=rec.smem)
    out, q, kv = bufs["out"].numpy(), bufs["q"].numpy(), bufs["kv"].numpy()
    live = int(c["qsl"][-1])
    check(out[:live], out_ref[:live])
    assert not out[live:].any(), "padding rows must be zero"
    check(q[:live], q_ref[:live])
    written = c["slot_mapping"][:live]
    check(kv[:, written], kv_ref[:, written])
    untouched = np.setdiff1d(np.arange(kv.shape[1]), written)
    np.testing.assert_array_equal(kv[:, untouched], c["kv"][:, untouched])
    assert not bufs["attn_counters"].numpy().any(), "split counters must be reset for the next launch"
    return bufs, args, out, kv


CONTEXTS = [1, 15, 16, 17, 128, 511, 512, 513, 4096, MAX_SEQ_LEN]


@pytest.mark.parametrize("ctx", CONTEXTS)
@pytest.mark.parametrize("lens_of", ["one", "two", "one_of_two"])
def test_fused_decode_attention_qwen3_8b_heads(lib, rng, ctx, lens_of):  # noqa: F811
    nh, nkv, hd = 32, 8, 128
    lens = {"one": [ctx], "two": [ctx, int(rng.integers(1, ctx + 1))], "one_of_two": [ctx, 0]}[lens_of]
    c = make_case(rng, lens, nh, nkv, hd, norm=True)
    run_and_check(lib, c, few_seq_launch(len(lens), nh, nkv, hd, True), nh, nkv, hd)


@pytest.mark.parametrize("stages,min_tiles,solo", [(2, 1, 1), (2, 4, 0), (3, 1, 2), (4, 2, 0), (4, 8, 3), (6, 1, 5),
                                                    (6, 8, 0), (3, 2, 40)])
@pytest.mark.parametrize("ctx", [17, 200, 700, 4096])
def test_fused_decode_attention_variants(lib, rng, stages, min_tiles, solo, ctx):  # noqa: F811
    """The stage / split variants the kernel benchmark compares compute the same thing (solo: one split up to
    that many tiles, past the ring's depth too)."""
    nh, nkv, hd = 32, 8, 128
    c = make_case(rng, [ctx, max(1, ctx // 3)], nh, nkv, hd, norm=True)
    run_and_check(lib, c, few_seq_launch(2, nh, nkv, hd, True, stages, min_tiles, solo), nh, nkv, hd)


@pytest.mark.parametrize("ctx", [200, 4096])
def test_fused_decode_attention_block_ids_past_shared_memory(lib, rng, ctx):  # noqa: F811
    """A split spanning more KV blocks than its shared-memory room takes them from the block table itself."""
    nh, nkv, hd = 32, 8, 128
    c = make_case(rng, [ctx, ctx - 7], nh, nkv, hd, norm=True)
    run_and_check(lib, c, few_seq_launch(2, nh, nkv, hd, True, 3, 8, 0, block_ids=2), nh, nkv, hd)


@pytest.mark.parametrize("ctx", [1, 64, 65, 300])
def test_fused_decode_attention_small_heads_no_norm(lib, rng, ctx):  # noqa: F811
    """head_dim 64, G = 3 (rows of the MMA past G stay zero), no QK norm (q_norm / k_norm null)."""
    nh, nkv, hd = 9, 3, 64
    c = make_case(rng, [ctx, 0], nh, nkv, hd, norm=False)
    run_and_check(lib, c, few_seq_launch(2, nh, nkv, hd, False), nh, nkv, hd)


@pytest.mark.parametrize("ctx", [128, 4096])
def test_fused_decode_attention_graph_replay_equals_eager(lib, rng, ctx):  # noqa: F811
    from xserv_aot.runtime.cuda.driver import Launch
    nh, nkv, hd = 32, 8, 128
    c = make_case(rng, [ctx, ctx // 2 + 1], nh, nkv, hd, norm=True)
    rec = few_seq_launch(2, nh, nkv, hd, True)
    bufs, args, out_eager, kv_eager = run_and_check(lib, c, rec, nh, nkv, hd)
    dargs = [(t, v.ptr if hasattr(v, "ptr") else v) for t, v in args]
    ln = Launch(rec.fn, lib.func(rec.fn, rec.smem), rec.grid, rec.block, rec.smem, dargs)
    gexec = lib.dev.capture(ln)
    for _ in range(2):                                     # twice: the counters reset themselves
        poison(lib, bufs["out"], bufs["q"])
        lib.dev.htod(bufs["kv"].ptr, encode(c["kv"], "bfloat16"))     # the cache as before the step
        lib.dev.graph_launch(gexec)
        lib.dev.sync()
        np.testing.assert_array_equal(bufs["out"].numpy(), out_eager)
        np.testing.assert_array_equal(bufs["kv"].numpy(), kv_eager)

"""Every CUDA kernel against its NumPy reference (runtime/numpy_ops.py) on fresh random inputs.

Outputs are poisoned with NaN before each launch: a pass means every element was written, no NaN, and
relative error ||out - ref|| / ||ref|| <= 1e-2 (bf16 operands, fp32 math).
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import bf, lib, rng  # noqa: F401  (fixtures)
from xserv_aot.runtime import numpy_ops as ref

pytestmark = pytest.mark.gpu
TOL = 1e-2


def check(out, want, tol=TOL):
    out = np.asarray(out, np.float64)
    want = np.asarray(want, np.float64)
    assert out.shape == want.shape
    assert np.isfinite(out).all(), f"{np.isnan(out).sum()} NaN / unwritten elements"
    err = np.linalg.norm(out - want) / max(np.linalg.norm(want), 1e-30)
    assert err <= tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("H", [576, 4096])
def test_embedding_gather(lib, rng, H):
    V, T = 1000, 13
    table = bf(rng.standard_normal((V, H)))
    ids = rng.integers(0, V, T).astype(np.int32)
    out = lib.empty((T, H), "bfloat16")
    lib.launch("embedding", [T], [min(256, H // 8)], [("ptr", lib.to_device(ids)), ("ptr", lib.to_device(table, "bfloat16")),
                                                     ("ptr", out), ("i32", H), ("i32", V)])
    np.testing.assert_array_equal(out.numpy(), ref.embedding(ids, table))
    idx = rng.integers(0, T, 5).astype(np.int32)
    g = lib.empty((5, H), "bfloat16")
    lib.launch("gather_rows", [5], [min(256, H // 8)], [("ptr", out), ("ptr", lib.to_device(idx)), ("ptr", g),
                                                      ("i32", H), ("i32", T)])
    np.testing.assert_array_equal(g.numpy(), ref.gather_rows(ref.embedding(ids, table), idx))


@pytest.mark.parametrize("few", [False, True])
@pytest.mark.parametrize("H", [576, 4096])
def test_rmsnorm_and_add_rmsnorm(lib, rng, H, few):
    """One chunk a thread, and the fewest threads a row (elementwise_plan.NORM_FEW_FROM_ROWS)."""
    T, eps = 7, 1e-6
    x, d = bf(rng.standard_normal((T, H)) * 3), bf(rng.standard_normal((T, H)))
    w = bf(1 + 0.2 * rng.standard_normal(H))
    dx, dd, dw = lib.to_device(x, "bfloat16"), lib.to_device(d, "bfloat16"), lib.to_device(w, "bfloat16")
    out = lib.empty((T, H), "bfloat16")
    from xserv_aot.plan.elementwise_plan import norm_threads
    threads = norm_threads(H, T, few_from=1 if few else 0)
    lib.launch("rmsnorm", [T], [threads], [("ptr", dx), ("ptr", dw), ("ptr", out), ("i32", H), ("f32", eps)])
    check(out.numpy(), ref.rmsnorm(x, w, eps))
    out2 = lib.empty((T, H), "bfloat16")
    lib.launch("add_rmsnorm", [T], [threads], [("ptr", dx), ("ptr", dd), ("ptr", dw), ("ptr", out2), ("i32", H), ("f32", eps)])
    res, _ = ref.add_rmsnorm(x, d, w, eps)
    res = bf(res)
    np.testing.assert_array_equal(dx.numpy(), res)
    check(out2.numpy(), ref.rmsnorm(res, w, eps))


@pytest.mark.parametrize("blocks", [None, 2])
def test_silu_mul(lib, rng, blocks):
    """One chunk a thread, and a grid-stride loop over a capped grid (elementwise_plan.SILU_MAX_BLOCKS)."""
    rows, inter = 5, 1536
    x = bf(rng.standard_normal((rows, 2 * inter)) * 2)
    out = lib.empty((rows, inter), "bfloat16")
    lib.launch("silu_mul", [blocks or (rows * inter // 8 + 255) // 256], [256],
               [("ptr", lib.to_device(x, "bfloat16")), ("ptr", out), ("i32", rows), ("i32", inter)])
    check(out.numpy(), ref.silu_mul(x))


@pytest.mark.parametrize("M,K,out_dtype,bias", [(1, 4096, "bfloat16", False), (2, 576, "float32", True),
                                                (3, 1536, "bfloat16", True), (8, 4096, "float32", False),
                                                (5, 12288, "bfloat16", False)])
def test_gemv(lib, rng, M, K, out_dtype, bias):
    N = 1000
    mt = next(m for m in (1, 2, 4, 8) if m >= M)
    x, w = bf(rng.standard_normal((M, K))), bf(rng.standard_normal((N, K)) * K ** -0.5)
    b = bf(rng.standard_normal(N)) if bias else None
    out = lib.empty((M, N), out_dtype)
    fn = f"gemv_m{mt}_{'f32' if out_dtype == 'float32' else 'bf16'}"
    lib.launch(fn, [-(-N // 16)], [256], [("ptr", lib.to_device(x, "bfloat16")), ("ptr", lib.to_device(w, "bfloat16")),
                                         ("ptr", lib.to_device(b, "bfloat16") if bias else 0), ("ptr", out),
                                         ("i32", M), ("i32", N), ("i32", K)])
    check(out.numpy(), ref.linear(x, w, b))


@pytest.mark.parametrize("fn,R", [("gemv_r1_m1_bf16", 1), ("gemv_r4_m1_bf16", 4)])
def test_gemv_rows_per_warp_variants(lib, rng, fn, R):
    N, K = 1002, 1536
    x, w, b = bf(rng.standard_normal((1, K))), bf(rng.standard_normal((N, K)) * K ** -0.5), bf(rng.standard_normal(N))
    out = lib.empty((1, N), "bfloat16")
    lib.launch(fn, [-(-N // (8 * R))], [256], [("ptr", lib.to_device(x, "bfloat16")), ("ptr", lib.to_device(w, "bfloat16")),
                                              ("ptr", lib.to_device(b, "bfloat16")), ("ptr", out), ("i32", 1), ("i32", N),
                                              ("i32", K)])
    check(out.numpy(), ref.linear(x, w, b))


def test_gemv_gate_silu(lib, rng):
    M, inter, K = 3, 768, 576
    x, w = bf(rng.standard_normal((M, K))), bf(rng.standard_normal((2 * inter, K)) * K ** -0.5)
    out = lib.empty((M, inter), "bfloat16")
    lib.launch("gemv_gate_m4", [inter // 8], [256], [("ptr", lib.to_device(x, "bfloat16")),
                                                    ("ptr", lib.to_device(w, "bfloat16")), ("ptr", out),
                                                    ("i32", M), ("i32", inter), ("i32", K)])
    check(out.numpy(), ref.silu_mul(bf(ref.linear(x, w))))


@pytest.mark.parametrize("tile,M,N,K,out_dtype", [("64x64", 37, 1000, 576, "bfloat16"), ("64x64", 64, 4096, 4096, "float32"),
                                                  ("128x128", 200, 1000, 576, "float32"),
                                                  ("128x128", 256, 6144, 4096, "bfloat16")])
def test_gemm_mma(lib, rng, tile, M, N, K, out_dtype):
    from xserv_aot.plan.kernel_constants import gemm_smem
    bm, bn = (int(v) for v in tile.split("x"))
    x, w = bf(rng.standard_normal((M, K))), bf(rng.standard_normal((N, K)) * K ** -0.5)
    b = bf(rng.standard_normal(N))
    out = lib.empty((M, N), out_dtype)
    smem = gemm_smem(tile)
    lib.launch(f"gemm_{tile}_{'f32' if out_dtype == 'float32' else 'bf16'}", [-(-N // bn), -(-M // bm)],
               [256 if bm == 128 else 128],
               [("ptr", lib.to_device(x, "bfloat16")), ("ptr", lib.to_device(w, "bfloat16")),
                ("ptr", lib.to_device(b, "bfloat16")), ("ptr", out), ("i32", M), ("i32", N), ("i32", K)], smem=smem)
    check(out.numpy(), ref.linear(x, w, b))


@pytest.mark.parametrize("M,N,K,splits,out_dtype", [(8, 4096, 12288, 5, "bfloat16"), (3, 1000, 576, 8, "float32"),
                                                    (64, 6144, 4096, 3, "bfloat16")])
def test_gemm_splitk(lib, rng, M, N, K, splits, out_dtype):
    from xserv_aot.plan.kernel_constants import gemm_smem
    x, w = bf(rng.standard_normal((M, K))), bf(rng.standard_normal((N, K)) * K ** -0.5)
    b = bf(rng.standard_normal(N))
    ws, out = lib.empty((splits, M, N), "float32"), lib.empty((M, N), out_dtype)
    lib.launch("gemm_64x64_splitk", [-(-N // 64), -(-M // 64), splits], [128],
               [("ptr", lib.to_device(x, "bfloat16")), ("ptr", lib.to_device(w, "bfloat16")), ("ptr", 0), ("ptr", ws),
                ("i32", M), ("i32", N), ("i32", K)], smem=gemm_smem("64x64"))
    lib.launch("splitk_reduce", [min(-(-M * N // 2 // 256), 4096)], [256],
               [("ptr", ws), ("ptr", lib.to_device(b, "bfloat16")), ("ptr", out), ("i32", M), ("i32", N),
                ("i32", splits), ("i32", int(out_dtype == "float32"))])
    check(out.numpy(), ref.linear(x, w, b))


def rope_inputs(rng, T, num_slots, hd, nh, nkv, norm, qkv_scale=1.0):
    """Fresh inputs of a qk_norm_rope_cache launch: qkv [T, (nh + 2 nkv) hd], positions < 256, distinct KV slots
    (row 2 writes none: slot -1), QK-norm weights (None without norm), RoPE tables, the KV layer [2, slots, nkv, hd]."""
    qkv = bf(rng.standard_normal((T, (nh + 2 * nkv) * hd)) * qkv_scale)
    pos = rng.integers(0, 256, T).astype(np.int32)
    slots = rng.permutation(num_slots)[:T].astype(np.int32)
    slots[2] = -1
    qn, kn = (bf(1 + 0.2 * rng.standard_normal(hd)), bf(1 + 0.2 * rng.standard_normal(hd))) if norm else (None, None)
    cos, sin = rope_tables(256, hd)
    kv = bf(rng.standard_normal((2, num_slots, nkv, hd)))
    return qkv, pos, slots, qn, kn, cos, sin, kv


def rope_tables(max_len, hd, theta=10000.0):
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(max_len)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@pytest.mark.parametrize("fn,warps", [("qk_norm_rope_cache", 4), ("qk_norm_rope_cache_vec", 4),
                                      ("qk_norm_rope_cache_vec", 8), ("qk_norm_rope_cache_vec", 1)])
@pytest.mark.parametrize("hd,nh,nkv,norm", [(128, 8, 2, True), (64, 9, 3, False), (256, 4, 2, True)])
def test_qk_norm_rope_cache(lib, rng, hd, nh, nkv, norm, fn, warps):
    """The scalar-lane kernel and the vector-lane variant (elementwise_plan.ROPE_KERNEL picks), several block sizes."""
    T, num_slots, eps = 6, 64, 1e-6
    qkv, pos, slots, qn, kn, cos, sin, kv = rope_inputs(rng, T, num_slots, hd, nh, nkv, norm)
    dkv = lib.to_device(kv, "bfloat16")
    q = lib.empty((T, nh, hd), "bfloat16")
    lib.launch(f"{fn}_hd{hd}", [T, -(-(nh + 2 * nkv) // warps)], [32 * warps],
               [("ptr", lib.to_device(qkv, "bfloat16")), ("ptr", lib.to_device(pos)), ("ptr", lib.to_device(slots)),
                ("ptr", lib.to_device(qn, "bfloat16") if norm else 0), ("ptr", lib.to_device(kn, "bfloat16") if norm else 0),
                ("ptr", lib.to_device(cos)), ("ptr", lib.to_device(sin)), ("ptr", q), ("ptr", dkv),
                ("i32", nh), ("i32", nkv), ("f32", eps), ("i32", num_slots)])
    kv_ref = kv.copy()
    q_ref = ref.qk_norm_rope_cache(qkv, pos, slots, qn, kn, cos, sin, kv_ref, nh, nkv, hd, eps)
    check(q.numpy(), q_ref)
    got = dkv.numpy()
    check(got, kv_ref)
    untouched = np.setdiff1d(np.arange(num_slots), slots)
    np.testing.assert_array_equal(got[:, untouched], kv[:, untouched])


def paged_setup(rng, seqs, nkv, hd, block_size=16, num_blocks=256, max_blocks=64):
    """seqs: [(n_new, ctx_len)]; returns (qsl, seq_lens, block_tables, kv, T)."""
    kv = bf(rng.standard_normal((2, num_blocks * block_size, nkv, hd)))
    perm = rng.permutation(num_blocks)
    tables, used = np.zeros((len(seqs), max_blocks), np.int32), 0
    for i, (_, ctx) in enumerate(seqs):
        nb = -(-ctx // block_size)
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    qsl = np.concatenate([[0], np.cumsum([n for n, _ in seqs])]).astype(np.int32)
    lens = np.array([c for _, c in seqs], np.int32)
    return qsl, lens, tables, kv


@pytest.mark.parametrize("hd,nh,nkv", [(128, 32, 8), (64, 9, 3)])
@pytest.mark.parametrize("seqs", [[(1, 1), (1, 300), (1, 700), (0, 0), (1, 17)], [(2, 40), (3, 600)]])
def test_attention_decode_split_kv(lib, rng, hd, nh, nkv, seqs):
    block_size, max_blocks, P = 16, 64, 128
    S = -(-block_size * max_blocks // P)
    qsl, lens, tables, kv = paged_setup(rng, seqs, nkv, hd)
    T = int(qsl[-1]) + 1                                           # one padding row past the tokens
    q = bf(rng.standard_normal((T, nh, hd)))
    out = lib.empty((T, nh * hd), "bfloat16")
    po, pml = lib.empty((T, nh, S, hd), "float32"), lib.empty((T, nh, S, 2), "float32")
    counters = lib.to_device(np.zeros((len(seqs), nkv), np.int32))
    args = [("ptr", lib.to_device(q, "bfloat16")), ("ptr", lib.to_device(kv, "bfloat16")), ("ptr", lib.to_device(qsl)),
            ("ptr", lib.to_device(lens)), ("ptr", lib.to_device(tables)), ("ptr", po), ("ptr", pml),
            ("ptr", counters), ("ptr", out), ("i32", T), ("i32", nh), ("i32", nkv), ("i32", block_size),
            ("i32", max_blocks), ("i32", kv.shape[1]), ("f32", hd ** -0.5), ("i32", S)]
    lib.launch(f"attn_decode_hd{hd}", [len(seqs), nkv, S], [128], args)
    first = out.numpy()
    want = ref.attention(q, kv, qsl, lens, tables, block_size, hd ** -0.5)
    check(first, want)
    assert not first[qsl[-1]:].any()
    assert not counters.numpy().any(), "split counters must be reset for the next launch"
    lib.dev.htod(out.ptr, np.full(out.shape, 0x7FC0, np.uint16))      # poison again: a replay rewrites everything
    lib.launch(f"attn_decode_hd{hd}", [len(seqs), nkv, S], [128], args)
    np.testing.assert_array_equal(out.numpy(), first)


@pytest.mark.parametrize("hd,nh,nkv", [(128, 32, 8), (64, 9, 3)])
def test_attention_prefill(lib, rng, hd, nh, nkv):
    seqs = [(50, 50), (70, 200), (0, 0), (1, 33), (130, 130)]
    block_size, max_blocks = 16, 64
    qsl, lens, tables, kv = paged_setup(rng, seqs, nkv, hd)
    T = int(qsl[-1]) + 7
    q = bf(rng.standard_normal((T, nh, hd)))
    out = lib.empty((T, nh * hd), "bfloat16")
    lib.launch(f"attn_prefill_hd{hd}", [-(-T // 64) + len(seqs), nh], [128],
               [("ptr", lib.to_device(q, "bfloat16")), ("ptr", lib.to_device(kv, "bfloat16")), ("ptr", lib.to_device(qsl)),
                ("ptr", lib.to_device(lens)), ("ptr", lib.to_device(tables)), ("ptr", out), ("i32", T),
                ("i32", len(seqs)), ("i32", nh), ("i32", nkv), ("i32", block_size), ("i32", max_blocks),
                ("i32", kv.shape[1]), ("f32", hd ** -0.5), ("i32", 1)])
    want = ref.attention(q, kv, qsl, lens, tables, block_size, hd ** -0.5)
    check(out.numpy(), want)
    assert not out.numpy()[qsl[-1]:].any()


def sample_rows(lib, logits, temp, top_k, top_p, seeds, offs) -> np.ndarray:
    """The device sampler on [B, V] float32 logits; the sampled ids (int32 [B], output poisoned first)."""
    B, V = logits.shape
    out = lib.empty((B,), "int32")
    lib.launch("sample_rows", [B], [1024],
               [("ptr", lib.to_device(logits)), ("ptr", lib.to_device(temp)), ("ptr", lib.to_device(top_k)),
                ("ptr", lib.to_device(top_p)), ("ptr", lib.to_device(seeds)), ("ptr", lib.to_device(offs)),
                ("ptr", out), ("ptr", lib.empty((B, V), "float32", poison=False)), ("i32", V)])
    return out.numpy()

def test_sample(lib, rng):
    B, V = 64, 50000
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    logits[0, [7, 9000]] = logits[0].max() + 1                        # greedy tie -> lower index
    temp = np.where(np.arange(B) % 2 == 0, 0.0, rng.uniform(0.5, 1.5, B)).astype(np.float32)
    top_k = rng.choice([0, 1, 50, 1000], B).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5], B).astype(np.float32)
    seeds = rng.integers(0, 2**62, B).astype(np.int64)
    offs = rng.integers(0, 1000, B).astype(np.int32)
    got = sample_rows(lib, logits, temp, top_k, top_p, seeds, offs)
    want = ref.sample(logits, temp, top_k, top_p, seeds, offs)
    greedy = (temp <= 0) | (top_k == 1)
    np.testing.assert_array_equal(got[greedy], want[greedy])
    assert got[0] == 7
    agree = (got == want).mean()
    assert agree >= 0.95, f"sampled tokens agree with NumPy on {agree:.0%} of rows"


def test_sample_nonfinite_rows_give_minus_one(lib, rng):
    """A row with a NaN/+Inf logit, or with every logit -Inf, samples no token (-1), greedy or not; a -Inf alone is a
    masked token (apply_token_bitmask) and the row samples as usual; the other rows are untouched."""
    B, V = 8, 5000
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    for row, col, value in ((1, 17, np.nan), (2, V - 1, np.inf), (6, 4000, np.nan)):
        logits[row, col] = value
    second = int(np.argsort(logits[5])[-2])
    logits[5, int(np.argmax(logits[5]))] = -np.inf                         # the best token masked
    logits[7] = -np.inf
    temp = np.array([0, 0, 0.8, 0, 0, 0, 0.7, 0.9], np.float32)
    top_k = np.zeros(B, np.int32)
    top_p = np.ones(B, np.float32)
    seeds = rng.integers(0, 2**62, B).astype(np.int64)
    offs = np.zeros(B, np.int32)
    got = sample_rows(lib, logits, temp, top_k, top_p, seeds, offs)
    assert got[[1, 2, 6, 7]].tolist() == [-1, -1, -1, -1]
    want = ref.sample(logits, temp, top_k, top_p, seeds, offs)
    assert want[[1, 2, 6, 7]].tolist() == [-1, -1, -1, -1]
    assert got[[0, 3, 4, 5]].tolist() == want[[0, 3, 4, 5]].tolist()       # greedy rows: exact
    assert got[5] == second                                                 # the masked best is skipped

"""The prefill row kernels (kernels/rows_prefill.cu, plan/row_kernels.py) against the kernels they replace
(elementwise.cu's add_rmsnorm / rmsnorm / silu_mul, rope_cache.cu's qk_norm_rope_cache): the same bits on fresh
random inputs (outputs poisoned first), and against the NumPy ops (runtime/numpy_ops.py) within bf16 rounding."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import bf, lib, rng  # noqa: F401  (fixtures)
from tests.test_cuda_kernels import check, rope_inputs, rope_tables
from xserv_aot.plan import row_kernels as rk
from xserv_aot.plan.elementwise_plan import norm_threads, qk_rope_launch
from xserv_aot.plan.op_records import AddRmsNorm, QkNormRopeCache, RmsNorm, SiluMul
from xserv_aot.runtime import numpy_ops as ref

pytestmark = pytest.mark.gpu


def bits(arr) -> np.ndarray:
    return arr.numpy().view(np.uint32)


@pytest.mark.parametrize("ef", [False, True])
@pytest.mark.parametrize("k", rk.NORM_KS)
@pytest.mark.parametrize("H", [576, 4096, 8192])
def test_norm_rows_bit_identical(lib, rng, H, k, ef):
    T, eps = 37, 1e-6
    x, d = bf(rng.standard_normal((T, H)) * 3), bf(rng.standard_normal((T, H)))
    w = bf(1 + 0.2 * rng.standard_normal(H))
    dw = lib.to_device(w, "bfloat16")
    args = lambda *p: [("ptr", a) for a in p] + [("i32", H), ("f32", eps)]  # noqa: E731
    old_threads = norm_threads(H, T, few_from=0)
    dx = lib.to_device(x, "bfloat16")
    want = lib.empty((T, H), "bfloat16")
    lib.launch("rmsnorm", [T], [old_threads], args(dx, dw, want))
    rec = rk.norm_rows_launch(RmsNorm(T, inp="x", weight="w", out="o", eps=eps), H, k=k, ef=ef).launch[0]
    got = lib.empty((T, H), "bfloat16")
    lib.launch(rec.fn, rec.grid, rec.block, args(dx, dw, got))
    np.testing.assert_array_equal(bits(got), bits(want))
    check(got.numpy(), ref.rmsnorm(x, w, eps))

    dx_old, dx_new, dd = lib.to_device(x, "bfloat16"), lib.to_device(x, "bfloat16"), lib.to_device(d, "bfloat16")
    want = lib.empty((T, H), "bfloat16")
    lib.launch("add_rmsnorm", [T], [old_threads], args(dx_old, dd, dw, want))
    op = AddRmsNorm(T, residual="x", delta="d", weight="w", out="o", eps=eps)
    rec = rk.norm_rows_launch(op, H, k=k, ef=ef).launch[0]
    assert rec.fn == f"add_rmsnorm_rows_k{k}" + ("_ef" if ef else "") and rec.grid[0] == T
    got = lib.empty((T, H), "bfloat16")
    lib.launch(rec.fn, rec.grid, rec.block, args(dx_new, dd, dw, got))
    np.testing.assert_array_equal(bits(dx_new), bits(dx_old))
    np.testing.assert_array_equal(bits(got), bits(want))
    res = bf(ref.add_rmsnorm(x, d, w, eps)[0])
    np.testing.assert_array_equal(dx_new.numpy(), res)
    check(got.numpy(), ref.rmsnorm(res, w, eps))


@pytest.mark.parametrize("ef", [False, True])
@pytest.mark.parametrize("u", rk.SILU_US)
@pytest.mark.parametrize("rows,inter,threads", [(9, 12288, 256), (5, 1536, 256), (4, 2056, 128)])
def test_silu_rows_bit_identical(lib, rng, rows, inter, threads, u, ef):
    x = bf(rng.standard_normal((rows, 2 * inter)) * 4)
    dx = lib.to_device(x, "bfloat16")
    want = lib.empty((rows, inter), "bfloat16")
    lib.launch("silu_mul", [(rows * inter // 8 + 255) // 256], [256], [("ptr", dx), ("ptr", want), ("i32", rows),
                                                                      ("i32", inter)])
    rec = rk.silu_rows_launch(SiluMul(rows, inp="x", out="o", inter=inter), u=u, threads=threads, ef=ef).launch[0]
    got = lib.empty((rows, inter), "bfloat16")
    lib.launch(rec.fn, rec.grid, rec.block, [("ptr", dx), ("ptr", got), ("i32", inter)])
    np.testing.assert_array_equal(bits(got), bits(want))
    check(got.numpy(), ref.silu_mul(x))


def wide_bf16(rng, shape, max_exp: int) -> np.ndarray:
    """bf16 values (as float32) of random sign, mantissa and biased exponent 0..max_exp (0: subnormals), a few
    infinities and NaNs: the roundings of the hardware conversion and of f2bf meet subnormals, overflow and NaN."""
    e = rng.integers(0, max_exp + 1, shape).astype(np.uint32)
    b = (rng.integers(0, 2, shape).astype(np.uint32) << 15) | (e << 7) | rng.integers(0, 128, shape).astype(np.uint32)
    flat = b.reshape(-1)
    flat[rng.integers(0, flat.size, 3)] = 0x7F80                           # +inf
    flat[rng.integers(0, flat.size, 2)] = 0x7FC0                           # NaN
    return (b << 16).view(np.float32)


@pytest.mark.parametrize("max_exp", [254, 140])
def test_rows_kernels_bit_identical_on_extreme_values(lib, rng, max_exp):
    T, H, I, eps = 12, 4096, 1536, 1e-6
    x, d, w = wide_bf16(rng, (T, H), max_exp), wide_bf16(rng, (T, H), max_exp), bf(1 + 0.2 * rng.standard_normal(H))
    dw, dd = lib.to_device(w, "bfloat16"), lib.to_device(d, "bfloat16")
    args = lambda *p: [("ptr", a) for a in p] + [("i32", H), ("f32", eps)]  # noqa: E731
    res_old = lib.to_device(x, "bfloat16")
    want = lib.empty((T, H), "bfloat16")
    lib.launch("add_rmsnorm", [T], [norm_threads(H, T, few_from=0)], args(res_old, dd, dw, want))
    rec = rk.norm_rows_launch(AddRmsNorm(T, residual="x", delta="d", weight="w", out="o", eps=eps), H, k=4).launch[0]
    for fn in (rec.fn, rec.fn + "_sw"):                       # the hardware conversion, f2bf
        res_new, got = lib.to_device(x, "bfloat16"), lib.empty((T, H), "bfloat16")
        lib.launch(fn, rec.grid, rec.block, args(res_new, dd, dw, got))
        np.testing.assert_array_equal(bits(res_new), bits(res_old))
        np.testing.assert_array_equal(bits(got), bits(want))
    g = lib.to_device(wide_bf16(rng, (T, 2 * I), max_exp), "bfloat16")
    want = lib.empty((T, I), "bfloat16")
    lib.launch("silu_mul", [(T * I // 8 + 255) // 256], [256], [("ptr", g), ("ptr", want), ("i32", T), ("i32", I)])
    rec = rk.silu_rows_launch(SiluMul(T, inp="x", out="o", inter=I), u=3).launch[0]
    for fn in (rec.fn, rec.fn + "_sw"):
        got = lib.empty((T, I), "bfloat16")
        lib.launch(fn, rec.grid, rec.block, [("ptr", g), ("ptr", got), ("i32", I)])
        np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("ef", [False, True])
@pytest.mark.parametrize("warps", [8, 4, 1])
@pytest.mark.parametrize("hd,nh,nkv,norm", [(128, 32, 8, True), (64, 9, 3, False), (256, 4, 2, True)])
def test_rope_rows_bit_identical(lib, rng, hd, nh, nkv, norm, warps, ef):
    """q, the KV slots written and the slots left alone; row 2 writes no KV (slot -1)."""
    T, num_slots, eps = 11, 64, 1e-6
    qkv, pos, slots, qn, kn, cos, sin, kv = rope_inputs(rng, T, num_slots, hd, nh, nkv, norm, qkv_scale=2)
    common = [lib.to_device(qkv, "bfloat16"), lib.to_device(pos), lib.to_device(slots),
              lib.to_device(qn, "bfloat16") if norm else 0, lib.to_device(kn, "bfloat16") if norm else 0,
              lib.to_device(cos), lib.to_device(sin)]
    op = QkNormRopeCache(T, qkv="qkv", positions="p", slot_mapping="s", q_norm="qn", k_norm="kn", cos="c", sin="s",
                         q_out="q", kv_cache="kv", layer=0, num_heads=nh, num_kv_heads=nkv, head_dim=hd, eps=eps)
    outs = []
    for rec in (qk_rope_launch(op, hd, nh, nkv, num_slots).launch[0],
                rk.rope_rows_launch(op, hd, nh, nkv, num_slots, warps=warps, ef=ef).launch[0]):
        q, dkv = lib.empty((T, nh, hd), "bfloat16"), lib.to_device(kv, "bfloat16")
        lib.launch(rec.fn, rec.grid, rec.block, [("ptr", a) for a in common] + [
            ("ptr", q), ("ptr", dkv), ("i32", nh), ("i32", nkv), ("f32", eps), ("i32", num_slots)], smem=rec.smem)
        outs.append((q, dkv))
    (q_old, kv_old), (q_new, kv_new) = outs
    np.testing.assert_array_equal(bits(q_new), bits(q_old))
    np.testing.assert_array_equal(bits(kv_new), bits(kv_old))
    kv_ref = kv.copy()
    check(q_new.numpy(), ref.qk_norm_rope_cache(qkv, pos, slots, qn, kn, cos, sin, kv_ref, nh, nkv, hd, eps))
    got = kv_new.numpy()
    check(got, kv_ref)
    untouched = np.setdiff1d(np.arange(num_slots), slots)
    np.testing.assert_array_equal(got[:, untouched], kv[:, untouched])


def test_rope_rows_v_nan_is_canonical(lib, rng):
    hd, nh, nkv, T, num_slots, eps = 64, 4, 2, 3, 8, 1e-6
    raw = (bf(rng.standard_normal((T, (nh + 2 * nkv) * hd))).view(np.uint32) >> 16).astype(np.uint16)
    col = (nh + nkv) * hd + int(rng.integers(0, nkv * hd))
    raw[1, col] = 0x7F81                                         # a NaN with a payload in row 1's V
    from xserv_aot.runtime.cuda.kernel_lib import DeviceArray
    dq = DeviceArray(lib, lib.dev.alloc(raw.nbytes), raw.shape, "bfloat16")
    lib.dev.htod(dq.ptr, raw)
    cos, sin = rope_tables(16, hd)
    op = QkNormRopeCache(T, qkv="qkv", positions="p", slot_mapping="s", q_norm=None, k_norm=None, cos="c", sin="s",
                         q_out="q", kv_cache="kv", layer=0, num_heads=nh, num_kv_heads=nkv, head_dim=hd, eps=eps)
    rec = rk.rope_rows_launch(op, hd, nh, nkv, num_slots).launch[0]
    kv = lib.to_device(bf(rng.standard_normal((2, num_slots, nkv, hd))), "bfloat16")
    q = lib.empty((T, nh, hd), "bfloat16")
    lib.launch(rec.fn, rec.grid, rec.block, [("ptr", dq), ("ptr", lib.to_device(np.arange(T, dtype=np.int32))),
                                             ("ptr", lib.to_device(np.arange(T, dtype=np.int32))), ("ptr", 0),
                                             ("ptr", 0), ("ptr", lib.to_device(cos)), ("ptr", lib.to_device(sin)),
                                             ("ptr", q), ("ptr", kv), ("i32", nh), ("i32", nkv), ("f32", eps),
                                             ("i32", num_slots)], smem=rec.smem)
    v = kv.numpy()[1, 1].reshape(-1).view(np.uint32) >> 16
    assert v[col - (nh + nkv) * hd] == 0x7FC0

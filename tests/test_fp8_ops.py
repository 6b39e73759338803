"""FP8 NumPy ops (quantize_fp8, W8A16 / W8A8 linears, weight quantization) against an independent float64
reference written here: e4m3 values enumerated from the bit format, round to nearest even by search."""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from xserv_aot import fp8
from xserv_aot.plan.manifest import TensorInfo
from xserv_aot.plan.op_records import Linear, OpRecordError, QuantizeFp8, op_from_dict
from xserv_aot.plan.ops import FP8_W8A16_MAX_ROWS, linear_ops
from xserv_aot.runtime import numpy_ops
from xserv_aot.runtime.numpy_backend import NumpyRank


def e4m3_grid() -> tuple[np.ndarray, np.ndarray]:
    """(value, code) of every non-negative finite e4m3fn code, ascending: exponent bias 7, 3 mantissa bits,
    subnormals at exponent 0, code 0x7f NaN (no infinities)."""
    vals, codes = [], []
    for code in range(0x7f):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
        codes.append(code)
    return np.array(vals), np.array(codes)


GRID, CODES = e4m3_grid()


def ref_e4m3(x: np.ndarray) -> np.ndarray:
    """Nearest e4m3 value (ties: the even code), float64; |x| < 464 (x / s may pass 448 by a float32 ulp: 448)."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    assert a.max(initial=0) < 464
    hi = np.clip(np.searchsorted(GRID, a), 1, len(GRID) - 1)
    lo = hi - 1
    dlo, dhi = a - GRID[lo], GRID[hi] - a
    pick = np.where((dhi < dlo) | ((dhi == dlo) & (CODES[hi] % 2 == 0)), hi, lo)
    return np.sign(x) * GRID[pick]


def ref_quantize_rows(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    m, k = x.shape
    ng = -(-k // group)
    q, s = np.zeros((m, k)), np.zeros((m, ng))
    for g in range(ng):
        cols = slice(g * group, min(k, (g + 1) * group))
        amax = np.abs(x[:, cols].astype(np.float64)).max(axis=1)
        sg = (np.maximum(amax, 1e-12) / 448).astype(np.float32).astype(np.float64)   # the float32 scale
        ratio = (x[:, cols].astype(np.float64) / sg[:, None]).astype(np.float32)       # float32 x / s
        q[:, cols], s[:, g] = ref_e4m3(ratio), sg
    return q, s


def ref_weight_real(w_q: np.ndarray, scale: np.ndarray, scheme: str) -> np.ndarray:
    n, k = w_q.shape
    out = np.zeros((n, k))
    for i in range(n):
        for j in range(k):
            s = scale[i] if scheme == "fp8_channel" else scale[i // 128, j // 128]
            out[i, j] = float(w_q[i, j]) * float(s)
    return out


def bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_e4m3_rounding_matches_the_bit_format(seed):
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.uniform(-448, 448, 4000), rng.uniform(-0.02, 0.02, 4000), GRID, -GRID,
                        (GRID[1:] + GRID[:-1]) / 2]).astype(np.float32)                # exact ties included
    got, _ = numpy_ops.quantize_fp8(x.reshape(1, -1) / np.float32(1), x.size)          # scale 448/448 = 1 here
    ref_q, ref_s = ref_quantize_rows(x.reshape(1, -1), x.size)
    assert ref_s[0, 0] == 1.0
    np.testing.assert_array_equal(got[0], ref_q[0])


@pytest.mark.parametrize("k,group", [(256, 128), (200, 128), (96, 96), (576, 576)])
def test_quantize_fp8_is_bit_exact(seed, k, group):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((7, k)) * rng.uniform(0.01, 30, (7, 1))).astype(np.float32)
    x[3] = 0                                                                            # all-zero row: 1e-12 floor
    q, s = numpy_ops.quantize_fp8(x, group)
    ref_q, ref_s = ref_quantize_rows(x, group)
    np.testing.assert_array_equal(s, ref_s.astype(np.float32))
    np.testing.assert_array_equal(q, ref_q)
    assert s.dtype == np.float32 and s.shape == (7, -(-k // group))


@pytest.mark.parametrize("scheme,n,k", [("fp8_channel", 40, 72), ("fp8_block128", 256, 384),
                                        ("fp8_block128", 200, 136)])
def test_weight_quantization(seed, scheme, n, k):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.001, 2, (n, 1))).astype(np.float32)
    q, s = fp8.quantize_weight(w, scheme)
    assert list(s.shape) == fp8.weight_scale_shape(scheme, n, k)
    for i in range(s.shape[0]):                                                          # scale = block amax / 448
        rows = slice(i, i + 1) if scheme == "fp8_channel" else slice(128 * i, 128 * (i + 1))
        cols = [slice(0, k)] if scheme == "fp8_channel" else [slice(128 * j, 128 * (j + 1)) for j in range(s.shape[1])]
        for j, c in enumerate(cols):
            expect = np.float32(np.abs(w[rows, c].astype(np.float64)).max() / 448)
            assert (s[i] if scheme == "fp8_channel" else s[i, j]) == expect
    ref_scale = fp8.expand_scale(s, scheme, n, k).astype(np.float64)
    np.testing.assert_array_equal(q, ref_e4m3((w / ref_scale).astype(np.float32)))
    real = ref_weight_real(q, s, scheme)
    np.testing.assert_array_equal(fp8.dequantize(q, s, scheme), real.astype(np.float32))
    assert np.all(np.abs(real - w) <= ref_scale * 16 + 1e-30)      # e4m3 half-ulp at 448 is 16 (in scale units)


@pytest.mark.parametrize("scheme,n,k", [("fp8_channel", 48, 96), ("fp8_block128", 160, 320)])
def test_linear_w8a16(seed, scheme, n, k):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, k)).astype(np.float32)
    q, s = fp8.quantize_weight(rng.standard_normal((n, k)).astype(np.float32) * 0.1, scheme)
    b = rng.standard_normal(n).astype(np.float32)
    got = numpy_ops.linear_w8a16(x, fp8.dequantize(q, s, scheme), b)
    ref = bf16(x).astype(np.float64) @ ref_weight_real(q, s, scheme).T + b
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("scheme,n,k", [("fp8_channel", 48, 200), ("fp8_block128", 160, 320),
                                        ("fp8_block128", 136, 200)])
def test_linear_w8a8(seed, scheme, n, k):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((9, k)) * rng.uniform(0.1, 10, (9, 1))).astype(np.float32)
    q, s = fp8.quantize_weight(rng.standard_normal((n, k)).astype(np.float32) * 0.1, scheme)
    group = 128 if scheme == "fp8_block128" else k
    xq, xs = numpy_ops.quantize_fp8(x, group)
    got = numpy_ops.linear_w8a8(xq, xs, q, s, scheme)
    rq, rs = ref_quantize_rows(x, group)
    ref = np.zeros((9, n))
    for m in range(9):
        for j in range(n):
            for g in range(rs.shape[1]):
                cols = slice(g * group, min(k, (g + 1) * group))
                ws = s[j] if scheme == "fp8_channel" else s[j // 128, g]
                ref[m, j] += rs[m, g] * float(ws) * np.dot(rq[m, cols], q[j, cols].astype(np.float64))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # and W8A8 stays close to the exact product (the quantization error, not a bug)
    exact = x.astype(np.float64) @ ref_weight_real(q, s, scheme).T
    assert np.abs(got - exact).max() <= 0.1 * np.abs(exact).max()


def test_linear_record_fields_round_trip_and_old_plans_load():
    old = {"op": "linear", "rows": 4, "inp": "h", "weight": "w", "bias": None, "out": "o", "n": 8, "k": 16}
    rec = op_from_dict(old)
    assert rec.quant is None and rec.to_dict() == old                                   # old plans read the same
    new = {**old, "inp": "xq", "weight_scale": "w.scale", "quant": "fp8_block128", "inp_scale": "xq_scale"}
    assert op_from_dict(new).to_dict() == new
    with pytest.raises(OpRecordError, match="unknown quant 'fp8_tensor'"):
        op_from_dict({**new, "quant": "fp8_tensor"})
    with pytest.raises(OpRecordError, match="must come together"):
        op_from_dict({**old, "quant": "fp8_channel"})
    qrec = {"op": "quantize_fp8", "rows": 4, "inp": "h", "out": "xq", "scale": "xq_scale", "k": 16, "group": 16}
    assert op_from_dict(qrec).to_dict() == qrec


def test_linear_ops_rule():
    quant = {"w": "fp8_block128"}
    assert linear_ops(None, 200, "h", "w", "o", 256, 256) == [Linear(rows=200, inp="h", weight="w", bias=None,
                                                                     out="o", n=256, k=256)]
    small = linear_ops(quant, FP8_W8A16_MAX_ROWS, "h", "w", "o", 256, 384)
    assert len(small) == 1 and small[0].quant == "fp8_block128" and small[0].inp == "h" and not small[0].inp_scale
    big = linear_ops(quant, FP8_W8A16_MAX_ROWS + 1, "h", "w", "o", 256, 384)
    assert big[0] == QuantizeFp8(rows=65, inp="h", out="xq", scale="xq_scale", k=384, group=128)
    assert (big[1].inp, big[1].inp_scale, big[1].weight_scale) == ("xq", "xq_scale", "w.scale")
    assert linear_ops({"w": "fp8_channel"}, 65, "h", "w", "o", 256, 384)[0].group == 384


def _rank(arena: dict[str, tuple[list[int], str]], weights: dict) -> NumpyRank:
    plan = SimpleNamespace(arena={k: TensorInfo(0, s, d) for k, (s, d) in arena.items()},
                           kv_cache={"shape": [1, 2, 1, 1, 1, 1], "dtype": "float32"}, build=None)
    return NumpyRank(plan, weights)


@pytest.mark.parametrize("rows", [3, 70])
def test_backend_runs_the_linear_ops_as_planned(seed, rows):
    """The NumPy backend's dispatch of linear_ops' records (both forms) equals the float64 reference."""
    rng = np.random.default_rng(seed)
    n, k = 256, 200
    q, s = fp8.quantize_weight(rng.standard_normal((n, k)).astype(np.float32) * 0.1, "fp8_block128")
    rank = _rank({"h": ([80, k], "bfloat16"), "o": ([80, n], "float32"), "xq": ([80, 384], "float8_e4m3fn"),
                  "xq_scale": ([80, 3], "float32")}, {"w": q, "w.scale": s})
    x = bf16(rng.standard_normal((80, k)))
    rank.buf["h"][:] = x
    for op in linear_ops({"w": "fp8_block128"}, rows, "h", "w", "o", n, k):
        getattr(rank, "op_" + op.op)(op)
    real = ref_weight_real(q, s, "fp8_block128")
    if rows > FP8_W8A16_MAX_ROWS:
        rq, rs = ref_quantize_rows(x[:rows], 128)
        np.testing.assert_array_equal(rank.buf["xq"].reshape(-1)[:rows * k].reshape(rows, k), rq)   # packed
        ref = sum((rq[:, g * 128:(g + 1) * 128] @ q[:, g * 128:(g + 1) * 128].T.astype(np.float64))
                  * rs[:, g:g + 1] * np.repeat(s[:, g], 128)[None, :n] for g in range(2))
    else:
        ref = x[:rows].astype(np.float64) @ real.T
    np.testing.assert_allclose(rank.buf["o"][:rows], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert not rank.buf["o"][rows:].any()

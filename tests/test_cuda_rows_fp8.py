"""The quantizing prefill row kernels (kernels/rows_prefill.cu `_q` / `_qonly`, quantize_fp8_rows) against the
kernels they replace in FP8 prefill buckets (elementwise.cu's rmsnorm_q / add_rmsnorm_q / silu_mul_q, gemv_fp8.cu's
quantize_fp8): the same bytes (bf16 output, residual, e4m3 rows, scales) on fresh random inputs with outputs
poisoned, NumPy's quantize_fp8 of the bf16 output, `_qonly` leaving the bf16 output untouched; and a tiny FP8 plan
whose prefill runs them: the same logits as the plan without them, and the NumPy backend's within W8A8_STEP_TOL."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import bf, lib, rng  # noqa: F401  (fixtures)
from tests.test_cuda_row_kernels import wide_bf16
from xserv_aot import fp8
from xserv_aot.plan import row_kernels as rk
from xserv_aot.plan.launch_records import f32, i32, launch, ptr
from xserv_aot.plan.op_records import AddRmsNorm, QuantizeFp8, RmsNorm, SiluMul
from xserv_aot.runtime import numpy_ops

pytestmark = pytest.mark.gpu
POISON = 0xFF


def poisoned(lib, shape, dtype):
    a = lib.empty(shape, dtype)
    lib.dev.memset(a.ptr, POISON, a.nbytes)
    return a


def norm_outputs(lib, kind, x, d, w, group, rec=None):
    """Run elementwise.cu's {kind}_q (rec None) or the rows record; -> {out, x (residual), xq, xs} as NumPy."""
    from xserv_aot.plan.elementwise_plan import norm_threads
    rows, H = x.shape
    bufs = {"x": lib.to_device(x, "bfloat16"), "d": lib.to_device(d, "bfloat16"), "w": lib.to_device(w, "bfloat16"),
            "out": poisoned(lib, (rows, H), "bfloat16"), "xq": poisoned(lib, (rows, H), "float8_e4m3fn"),
            "xs": poisoned(lib, (rows, fp8.groups(H, group)), "float32")}
    if rec is None:
        head = [ptr("x")] if kind == "rmsnorm" else [ptr("x"), ptr("d")]
        rec = launch(f"{kind}_q", [rows], [norm_threads(H)], 0, head + [ptr("w"), ptr("out"), ptr("xq"), ptr("xs"),
                                                                         i32(H), f32(1e-6), i32(group)])
    lib.launch_record(rec, bufs)
    return {k: bufs[k].numpy() for k in ("out", "x", "xq", "xs")}


def norm_rows_record(kind, rows, H, group, k, store):
    qop = QuantizeFp8(rows=rows, inp="out", out="xq", scale="xs", k=H, group=group)
    op = (RmsNorm(rows, inp="x", weight="w", out="out", eps=1e-6) if kind == "rmsnorm"
          else AddRmsNorm(rows, residual="x", delta="d", weight="w", out="out", eps=1e-6))
    return rk.norm_rows_launch(op, H, k=k, quant=qop, store_out=store).launch[0]


def assert_same_bytes(got: dict, want: dict, store: bool) -> None:
    for key in ("x", "xq", "xs"):
        np.testing.assert_array_equal(got[key].view(np.uint8), want[key].view(np.uint8), err_msg=key)
    if store:
        np.testing.assert_array_equal(got["out"].view(np.uint8), want["out"].view(np.uint8))
    else:
        poison = np.uint32(POISON * 0x01010000)          # a poisoned bf16 as DeviceArray.numpy()'s float32 holds it
        assert (got["out"].view(np.uint32) == poison).all(), "_qonly wrote its bf16 output"


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("k", rk.NORM_Q_KS)
@pytest.mark.parametrize("rows,H,group", [(37, 4096, 128), (9, 4096, 4096), (5, 576, 128), (7, 576, 576),
                                          (3, 6144, 128), (4, 512, 512)])
@pytest.mark.parametrize("kind", ["rmsnorm", "add_rmsnorm"])
def test_norm_rows_quantizing(lib, rng, kind, rows, H, group, k, store):
    x = bf(rng.standard_normal((rows, H), dtype=np.float32) * np.exp(rng.uniform(-2, 2, (rows, 1))).astype(np.float32))
    d, w = bf(rng.standard_normal((rows, H), dtype=np.float32)), bf(rng.uniform(0.5, 1.5, H).astype(np.float32))
    want = norm_outputs(lib, kind, x, d, w, group)
    rec = norm_rows_record(kind, rows, H, group, k, store)
    assert rec.fn == f"{kind}_rows_k{k}_q" + ("" if store else "only") and rec.fn in rk.QUANTIZING
    got = norm_outputs(lib, kind, x, d, w, group, rec)
    assert_same_bytes(got, want, store)
    want_q, want_s = numpy_ops.quantize_fp8(want["out"].astype(np.float32), group)
    np.testing.assert_array_equal(got["xs"], want_s)
    np.testing.assert_array_equal(got["xq"].astype(np.float32), want_q)


def silu_outputs(lib, g, inter, rec=None):
    rows = g.shape[0]
    bufs = {"g": lib.to_device(g, "bfloat16"), "out": poisoned(lib, (rows, inter), "bfloat16"),
            "xq": poisoned(lib, (rows, inter), "float8_e4m3fn"), "xs": poisoned(lib, (rows, inter // 128), "float32")}
    if rec is None:
        rec = launch("silu_mul_q", [min(-(-(rows * inter // 8) // 256), 4096)], [256], 0,
                     [ptr("g"), ptr("out"), ptr("xq"), ptr("xs"), i32(rows), i32(inter)])
    lib.launch_record(rec, bufs)
    return {k: bufs[k].numpy() for k in ("out", "xq", "xs")}


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("threads", [rk.SILU_THREADS, 128])
@pytest.mark.parametrize("rows,inter", [(9, 12288), (5, 1536), (4, 2176)])
def test_silu_rows_quantizing(lib, rng, rows, inter, threads, store):
    """inter 2176: 272 chunks, so the last warp of a pass holds one half-warp group in the row and one past it."""
    g = bf(rng.standard_normal((rows, 2 * inter), dtype=np.float32) * 3)
    want = silu_outputs(lib, g, inter)
    qop = QuantizeFp8(rows=rows, inp="out", out="xq", scale="xs", k=inter, group=128)
    rec = rk.silu_rows_launch(SiluMul(rows, inp="g", out="out", inter=inter), threads=threads, quant=qop,
                              store_out=store).launch[0]
    assert rec.fn in rk.QUANTIZING
    got = silu_outputs(lib, g, inter, rec)
    assert_same_bytes({**got, "x": g}, {**want, "x": g}, store)
    want_q, want_s = numpy_ops.quantize_fp8(want["out"].astype(np.float32), 128)
    np.testing.assert_array_equal(got["xs"], want_s)
    np.testing.assert_array_equal(got["xq"].astype(np.float32), want_q)


@pytest.mark.parametrize("kc", rk.QUANT_KS)
@pytest.mark.parametrize("rows,K,group", [(11, 4096, 128), (6, 4096, 4096), (5, 12288, 128), (3, 576, 128),
                                          (4, 1040, 1040)])
def test_quantize_rows(lib, rng, rows, K, group, kc):
    from xserv_aot.plan.fp8_build import plan_quantize
    x = bf(rng.standard_normal((rows, K), dtype=np.float32) * np.exp(rng.uniform(-6, 6, (rows, 1))).astype(np.float32))
    op = QuantizeFp8(rows=rows, inp="x", out="xq", scale="xs", k=K, group=group)
    assert rk.quantize_rows_fits(op, kc)
    outs = []
    for rec in (plan_quantize(op).launch[0], rk.quantize_rows_launch(op, kc).launch[0]):
        bufs = {"x": lib.to_device(x, "bfloat16"), "xq": poisoned(lib, (rows, K), "float8_e4m3fn"),
                "xs": poisoned(lib, (rows, fp8.groups(K, group)), "float32")}
        lib.launch_record(rec, bufs)
        outs.append({k: bufs[k].numpy() for k in ("xq", "xs")})
    (old, new) = outs
    np.testing.assert_array_equal(new["xq"].view(np.uint8), old["xq"].view(np.uint8))
    np.testing.assert_array_equal(new["xs"], old["xs"])
    want_q, want_s = numpy_ops.quantize_fp8(x, group)
    np.testing.assert_array_equal(new["xs"], want_s)
    np.testing.assert_array_equal(new["xq"].astype(np.float32), want_q)


@pytest.mark.parametrize("max_exp", [254, 140])
def test_quantizing_rows_on_extreme_values(lib, rng, max_exp):
    """Subnormals, overflow, infinities and NaNs: the rows kernels write the bytes of the kernels they replace."""
    T, H, inter = 12, 4096, 1536
    x, d = wide_bf16(rng, (T, H), max_exp), wide_bf16(rng, (T, H), max_exp)
    w = bf(1 + 0.2 * rng.standard_normal(H).astype(np.float32))
    for group in (128, H):
        want = norm_outputs(lib, "add_rmsnorm", x, d, w, group)
        got = norm_outputs(lib, "add_rmsnorm", x, d, w, group, norm_rows_record("add_rmsnorm", T, H, group, 2, True))
        assert_same_bytes(got, want, True)
    g = wide_bf16(rng, (T, 2 * inter), max_exp)
    qop = QuantizeFp8(rows=T, inp="out", out="xq", scale="xs", k=inter, group=128)
    rec = rk.silu_rows_launch(SiluMul(T, inp="g", out="out", inter=inter), quant=qop).launch[0]
    assert_same_bytes({**silu_outputs(lib, g, inter, rec), "x": g}, {**silu_outputs(lib, g, inter), "x": g}, True)


@pytest.mark.parametrize("scheme", ["auto", "channel"])
def test_tiny_fp8_plan_with_quantizing_rows(tmp_path, seed, monkeypatch, scheme):
    """A 64-row prefill bucket and the 4-row decode bucket given the rows kernels (ROWS_FROM and QUANT_ROWS_FROM
    lowered to 4; TMA W8A8, no CUTLASS library, W8A16 at <= 2 rows):
    logits over prompts and decode steps equal the same plan's without them (prefill_row_kernels v1) bit for bit,
    and the NumPy backend's within W8A8_STEP_TOL."""
    from tests.test_cuda_e2e import SMALL, gpu_or_skip, make_model
    from tests.test_cuda_fp8 import W8A8_STEP_TOL, cuda_vs_numpy
    gpu_or_skip()
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.runtime.cuda.runner import CudaRunner
    from xserv_aot.runtime.session import Session

    monkeypatch.setattr(rk, "ROWS_FROM", 4)
    monkeypatch.setattr(rk, "QUANT_ROWS_FROM", 4)
    r = np.random.default_rng(seed)
    make_model(tmp_path / "hf", SMALL, int(r.integers(1 << 30)))
    plans = {}
    for choice in ("rows", "v1"):
        build = BuildConfig(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[64], max_seq_len=256,
                            block_size=16, dtype="bfloat16", target="sm_90a", quantization="fp8", fp8_scheme=scheme,
                            gemm_library=False, fp8_w8a16_max_rows=2, fp8_quantize_in_producer=True,
                            fp8_w8a8_tma=True, prefill_row_kernels=choice)
        plans[choice] = compile_plan(tmp_path / "hf", tmp_path / f"plan_{choice}", build)
    fns = {rec.fn for bk in plans["rows"].buckets for op in bk.ops if op.cuda for rec in op.cuda.launch}
    assert {"quantize_fp8_rows_k2", f"add_rmsnorm_rows_k{rk.NORM_K}_qonly"} <= fns, sorted(fns)
    assert scheme == "channel" or "silu_mul_rows_u3_qonly" in fns
    prompts = [r.integers(3, SMALL["vocab_size"], n).tolist() for n in (60, 23, 64)]
    forced = r.integers(3, SMALL["vocab_size"], (3, 3)).tolist()

    def logits(runner):
        sess = Session(runner, num_seqs=3)
        got = [sess.prefill(i, p)[1] for i, p in enumerate(prompts)]
        for toks in forced:
            step = sess.step({i: [t] for i, t in enumerate(toks)})[1]
            got += [step[i] for i in range(3)]
        return np.array(got, np.float64)

    runs = {}
    for choice, plan in plans.items():
        runner = CudaRunner(plan, log=print)
        try:
            runs[choice] = logits(runner)
        finally:
            runner.close()
    np.testing.assert_array_equal(runs["rows"], runs["v1"])
    errs = cuda_vs_numpy(plans["rows"], logits)
    print(f"per-row logits relative error CUDA vs NumPy: max {errs.max():.2e}")
    assert errs.max() <= W8A8_STEP_TOL

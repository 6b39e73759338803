"""The GEMV of 1-8 rows on the tensor cores (build setting gemv "tc", kernels/gemv_tc.cu, plan/gemv_tc_plan.py), bf16
and W8A16 FP8: the plan's routing and ring depths (CPU), the kernels against NumPy and float64 on fresh inputs with
poisoned outputs, and whole plans against the NumPy backend and the CUDA-core plan (GPU)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.cuda_fixtures import bf, lib, rng  # noqa: F401  (fixtures)
from tests.test_cuda_fp8 import (AFTER_W8A8_TOL, SCHEMES, compile_fp8_tiny, make_weight, ref_linear, rel_err,
                                 silu_mul_ref, to_dev_fp8)
from xserv_aot import fp8
from xserv_aot.config import BuildConfig, ConfigError
from xserv_aot.plan import gemv_tc_plan as gt
from xserv_aot.plan.kernel_constants import GT_CHUNK, GT_MAX_ROWS, SM90_SMEM_SM
from xserv_aot.plan.linear_plan import plan_linear
from xserv_aot.plan.launch_records import i32, kernel
from xserv_aot.plan.op_records import Linear
from xserv_aot.runtime import numpy_ops


WEIGHTS = ("bfloat16",) + SCHEMES                    # bf16 weights, then the two FP8 schemes


def lin(rows, n, k, wt, bias=False, out="out"):
    quant = None if wt == "bfloat16" else wt
    return Linear(rows=rows, n=n, k=k, inp="x", weight="w", bias="b" if bias else None, out=out,
                  weight_scale=quant and "w.scale", quant=quant)


def weight(rng, n, k, wt):
    """(device buffers, float32 weight as the NumPy op sees it, float64 x -> x W^T)."""
    if wt == "bfloat16":
        w = bf(rng.standard_normal((n, k), dtype=np.float32) * np.float32(k ** -0.5))
        return w, None, (lambda x: x.astype(np.float64) @ w.astype(np.float64).T)
    q, s = make_weight(rng, n, k, wt)
    return q, s, (lambda x: ref_linear(x, q, s, wt))


def device_weight(lib, w, s, wt):
    if wt == "bfloat16":
        return {"w": lib.to_device(w, "bfloat16")}
    return {"w": to_dev_fp8(lib, w), "w.scale": lib.to_device(s)}


def numpy_linear(x, w, s, wt, b=None):
    return numpy_ops.linear(x, w, b) if wt == "bfloat16" else numpy_ops.linear_w8a16(x, fp8.dequantize(w, s, wt), b)


def test_ring_depth_fills_the_sm_and_fits_its_shared_memory():
    """Qwen3-8B at one row: qkv / o / gate_up stream their whole 4 chunks (3 blocks an SM), down 5 of its 12 (2 an
    SM: x is 24 KB); every choice fits the SM with the blocks it counted."""
    assert gt.gemv_tc_stages(1, 4096, 1, 384, True) == 4
    assert gt.gemv_tc_stages(1, 4096, 1, 1536, True) == 4
    assert gt.gemv_tc_stages(1, 12288, 1, 256, True) == 5
    assert gt.gemv_tc_stages(1, 576, 1, 40, False) == 1                      # one chunk
    assert gt.gemv_tc_stages(1, 4096, 2, 384, False) == 6                     # bf16: 6 of 8 chunks, 2 an SM
    for rows in (1, 2, 8):
        for k in (576, 4096, 12288):
            for wb in (1, 2):
                s = gt.gemv_tc_stages(rows, k, wb, 300, True)
                assert 1 <= s <= -(-k * wb // GT_CHUNK)
                assert gt.gemv_tc_smem(rows, k, s, True) + 1024 <= SM90_SMEM_SM


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_tc_routes_the_rows_up_to_8_and_refuses_bad_values(tmp_path, quantization):
    plan = compile_fp8_tiny(tmp_path, fp8_scheme="block128", quantization=quantization, gemv="tc")
    name = "gemv_fp8_tc_blk" if quantization == "fp8" else "gemv_tc"
    seen = set()
    for bk in plan.buckets:
        for i, op in enumerate(bk.ops):
            if op.op == "linear" and op.rows <= GT_MAX_ROWS and (op.quant or quantization == "none"):
                (rec,) = op.cuda.launch
                gate = bk.ops[i + 1].op == "silu_mul"
                f32 = plan.arena[op.out].dtype == "float32"                  # the lm_head
                assert rec.fn == f"{name}_{'gate' if gate else 'f32' if f32 else 'bf16'}", (rec.fn, op.weight)
                assert rec.block == (288, 1, 1) and rec.pdl          # pdl off in the build: the ring fills early
                assert rec.smem == gt.gemv_tc_smem(op.rows, op.k, rec.args[-1][1], bool(op.quant))
                seen.add(bk.num_tokens)
            if op.op == "silu_mul" and bk.num_tokens <= GT_MAX_ROWS:
                assert op.cuda.kernel == "fused_into_previous"
    assert {1, 2, 4} <= seen
    with pytest.raises(ConfigError, match="gemv"):
        BuildConfig(gemv="tensor").validate()


def tc_choice(op, out_dtype, gate, stages=None):
    choice = plan_linear(op, out_dtype, "out" if gate else None, None, decode=True, gemv="tc")
    (rec,) = choice.launch
    assert rec.fn.startswith("gemv_fp8_tc_" if op.quant else "gemv_tc_"), rec.fn
    if stages is None:
        return choice
    rec = dataclasses.replace(rec, args=tuple(rec.args[:-1]) + (i32(stages),),
                              smem=gt.gemv_tc_smem(op.rows, op.k, stages, op.quant == fp8.BLOCK128))
    return kernel(rec)


def launch(lib, choice, bufs, shape, out_dtype):
    out = lib.empty(shape, out_dtype)                                         # poisoned
    lib.launch_record(choice.launch[0], {**bufs, "out": out})
    return out.numpy()


TC_CASES = [  # rows, N, K, out dtype, bias, stages (None: the planner's), x magnitude
    (1, 6144, 4096, "bfloat16", False, None, 1.0),
    (2, 4096, 12288, "float32", True, None, 1.0),
    (5, 1000, 576, "bfloat16", True, None, 1.0),           # N not a multiple of 16, K: half a chunk, 64-k tail
    (8, 1002, 640, "float32", False, None, 1.0),
    (3, 4096, 8192, "float32", False, 2, 1.0),             # the ring wraps four times (bf16: eight)
    (1, 4096, 4096, "float32", False, 1, 3000.0),          # one stage; large inputs (f16 x 2^-4 stays exact)
    (1, 151936, 4096, "float32", False, None, 1.0),        # quantized lm_head
]


@pytest.mark.gpu
@pytest.mark.parametrize("wt", WEIGHTS)
@pytest.mark.parametrize("M,N,K,out_dtype,bias,stages,mag", TC_CASES)
def test_tc_linear(lib, rng, wt, M, N, K, out_dtype, bias, stages, mag):
    w, s, ref_of = weight(rng, N, K, wt)
    x = bf(rng.standard_normal((M, K), dtype=np.float32) * np.float32(mag))
    b = bf(rng.standard_normal(N)) if bias else None
    choice = tc_choice(lin(M, N, K, wt, bias), out_dtype, False, stages)
    bufs = {"x": lib.to_device(x, "bfloat16"), **device_weight(lib, w, s, wt),
            "b": lib.to_device(b, "bfloat16") if bias else None}
    out = launch(lib, choice, bufs, (M, N), out_dtype)
    want = numpy_linear(x, w, s, wt, b)
    ref = ref_of(x) + (0 if b is None else b.astype(np.float64))
    tol = 1e-2 if out_dtype == "bfloat16" else 5e-5
    assert rel_err(out, want) <= tol and rel_err(out, ref) <= tol
    np.testing.assert_array_equal(launch(lib, choice, bufs, (M, N), out_dtype), out)     # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("wt", WEIGHTS)
@pytest.mark.parametrize("M,inter,K,stages", [(1, 12288, 4096, None), (2, 1000, 576, None), (8, 768, 640, None),
                                               (3, 40, 4096, 2)])
def test_tc_gate_silu(lib, rng, wt, M, inter, K, stages):
    """gate_up + silu_mul: A rows 0-7 gate j0.., 8-15 up I + j0..; g and u rounded to bf16 before silu(g) * u."""
    w, s, ref_of = weight(rng, 2 * inter, K, wt)
    x = bf(rng.standard_normal((M, K), dtype=np.float32))
    choice = tc_choice(lin(M, 2 * inter, K, wt, out="gu"), "bfloat16", True, stages)
    bufs = {"x": lib.to_device(x, "bfloat16"), **device_weight(lib, w, s, wt)}
    out = launch(lib, choice, bufs, (M, inter), "bfloat16")
    want = numpy_ops.silu_mul(bf(numpy_linear(x, w, s, wt)))
    assert rel_err(out, want) <= 1e-2 and rel_err(out, silu_mul_ref(ref_of(x))) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("wt", WEIGHTS)
def test_tc_plan_matches_numpy_and_the_cuda_core_plan(tmp_path, wt, seed):
    """A tiny plan with gemv "tc" (same dummy weights as the default plan): graph == eager bit for bit, every step's
    logits (the prefill's lm_head of its last row is a GEMV too) within 1e-2 of the default plan's, the decode
    steps' within AFTER_W8A8_TOL of NumPy's; a 3-sequence step (decode_4) within AFTER_W8A8_TOL of NumPy."""
    from tests.test_cuda_runner import forced_logits, plan_logits
    from xserv_aot.runtime.cuda.runner import CudaRunner
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    from xserv_aot.runtime.select import gpu_available
    from xserv_aot.runtime.session import Session
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    (tmp_path / "t").mkdir(), (tmp_path / "p").mkdir()
    build = dict(quantization="none") if wt == "bfloat16" else dict(fp8_scheme=wt.removeprefix("fp8_"))
    tc = compile_fp8_tiny(tmp_path / "t", gemv="tc", **build)
    plain = compile_fp8_tiny(tmp_path / "p", **build)
    rng = np.random.default_rng(seed)
    prompt, forced = rng.integers(3, 1024, 40).tolist(), rng.integers(3, 1024, 8).tolist()
    graph, eager = plan_logits(tc, prompt, forced, eager=True)
    np.testing.assert_array_equal(graph.view(np.uint32), eager.view(np.uint32))
    base = plan_logits(plain, prompt, forced)
    assert max(rel_err(g, b) for g, b in zip(graph, base)) <= 1e-2
    want = forced_logits(NumpyRunner(tc), prompt, forced)
    assert max(rel_err(g, w) for g, w in zip(graph[1:], want[1:])) <= AFTER_W8A8_TOL

    prompts = [rng.integers(3, 1024, n).tolist() for n in (20, 33, 7)]
    nxt = rng.integers(3, 1024, 3).tolist()

    def three(runner):
        s = Session(runner, num_seqs=3)
        for k, p in enumerate(prompts):
            s.prefill(k, p)
        return np.array(s.step({k: [t] for k, t in enumerate(nxt)})[1])

    r = CudaRunner(tc, log=print)
    try:
        got = three(r)
    finally:
        r.close()
    assert rel_err(got, three(NumpyRunner(tc))) <= AFTER_W8A8_TOL

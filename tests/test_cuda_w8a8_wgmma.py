"""The W8A8 wgmma GEMM (kernels/gemm_w8a8_wgmma.cu: weights as the wgmma A operand, 33-256 activation rows as N,
K split over a thread-block cluster) on the GPU against the NumPy op linear_w8a8 and an independent float64
reference (test_cuda_fp8.check_w8a8), on fresh random inputs (seed printed on failure), outputs poisoned with NaN:
both scale schemes, M / N / K tails of the Qwen3-8B shapes, every routed row count, every built cluster size,
graph replay == eager. The routing tests at the end need no GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import bf, rng  # noqa: F401  (fixtures)
from tests.test_cuda_fp8 import SCHEMES, assert_replay_equals_eager, check_w8a8, run_w8a8, w8a8_op
from xserv_aot import fp8
from xserv_aot.plan import fp8_build
from xserv_aot.plan.kernel_build import plan_linear


@pytest.fixture(scope="module")
def lib():
    """The kernel library of quantize_fp8 (gemv_fp8.cu) and the wgmma GEMM alone (a short NVRTC build)."""
    from xserv_aot.runtime.select import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from xserv_aot.runtime.cuda.kernel_lib import KernelLib
    return KernelLib(sources=("gemv_fp8.cu", "gemm_w8a8_wgmma.cu"))


def run_wgmma(lib, rng, scheme, M, N, K, out_dtype, bias, cluster=None, mbar=None, wide=None):
    """quantize_fp8 (device) + the W8A8 wgmma kernel as the plan routes it (fp8_w8a8_wgmma), or at a forced
    cluster size / ring variant (mbar) / 256-row tile (wide); -> (bufs, records, (x, q, s, b))."""
    forced = cluster or mbar is not None or wide is not None
    bufs, recs, inputs, choice = run_w8a8(
        lib, rng, scheme, M, N, K, out_dtype, bias,
        lambda op: (fp8_build.plan_w8a8_wgmma(op, out_dtype, cluster,
                                              fp8_build.W8A8_WGMMA_MBAR if mbar is None else mbar,
                                              fp8_build.W8A8_WGMMA_WIDE if wide is None else wide)
                    if forced else plan_linear(op, out_dtype, None, {}, decode=True, fp8_wgmma=True)))
    assert choice.kernel.startswith(f"w8a8_wgmma_{fp8_build.SCHEME_TAG[scheme]}_"), choice.kernel
    return bufs, recs, inputs


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("mbar", [False, True])
def test_w8a8_wgmma_every_routed_row_count(lib, rng, scheme, mbar):
    """Rows 33..256 (every count the build setting routes here), fresh inputs each, both ring variants."""
    for M in range(fp8_build.W8A8_SKINNY_MAX_ROWS + 1, fp8_build.W8A8_WGMMA_MAX_ROWS + 1):
        bufs, recs, (x, q, s, b) = run_wgmma(lib, rng, scheme, M, 264, 400, "float32", M % 2 == 0, mbar=mbar)
        try:
            check_w8a8(bufs, x, q, s, b, scheme, "float32")
        except AssertionError as e:
            raise AssertionError(f"rows {M} ({recs[-1].fn}): {e}") from None


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("mbar", [False, True])
@pytest.mark.parametrize("cluster", fp8_build.W8A8_WGMMA_CLUSTERS)
@pytest.mark.parametrize("M,K", [(96, 2176), (40, 576), (250, 1024)])  # 17 steps; 5 (c8: blocks without a step)
def test_w8a8_wgmma_every_cluster(lib, rng, scheme, mbar, cluster, M, K):
    bufs, recs, (x, q, s, b) = run_wgmma(lib, rng, scheme, M, 1000, K, "float32", True, cluster, mbar)
    assert recs[-1].grid[1] == cluster and ("mb_" in recs[-1].fn) == mbar
    check_w8a8(bufs, x, q, s, b, scheme, "float32")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_w8a8_wgmma_wide_tile_every_row_count(lib, rng, scheme):
    """Rows 129..256 on the n256 tile (two n128 halves on one weight tile), fresh inputs each."""
    for M in range(129, fp8_build.W8A8_WGMMA_MAX_ROWS + 1):
        bufs, recs, (x, q, s, b) = run_wgmma(lib, rng, scheme, M, 264, 400, "float32", M % 2 == 1, wide=True)
        assert "_n256c" in recs[-1].fn
        try:
            check_w8a8(bufs, x, q, s, b, scheme, "float32")
        except AssertionError as e:
            raise AssertionError(f"rows {M} ({recs[-1].fn}): {e}") from None


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M,N,K,cluster", [(250, 1000, 1024, c) for c in fp8_build.W8A8_WGMMA_CLUSTERS] +
                         [(129, 6144, 592, None), (256, 4096, 12288, None)])
def test_w8a8_wgmma_wide_tile(lib, rng, scheme, cluster, M, N, K):
    bufs, recs, (x, q, s, b) = run_wgmma(lib, rng, scheme, M, N, K, "bfloat16" if N > 1000 else "float32", True,
                                         cluster, wide=True)
    assert recs[-1].fn.startswith(f"w8a8_wgmma_{fp8_build.SCHEME_TAG[scheme]}_n256c{cluster or ''}")
    check_w8a8(bufs, x, q, s, b, scheme, "bfloat16" if N > 1000 else "float32")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_w8a8_wgmma_graph_replay_equals_eager(lib, rng, scheme):
    bufs, recs, _ = run_wgmma(lib, rng, scheme, 160, 2048, 4096, "bfloat16", True)
    assert_replay_equals_eager(lib, bufs, ("out", "xq", "xs"),
                               lambda stream: [lib.launch_record(r, bufs, sync=False) for r in recs])


CASES = [  # rows, N, K, out dtype, bias: the Qwen3-8B shapes (qkv, o, gate_up, down) and tails
    (33, 6144, 4096, "bfloat16", False),
    (64, 4096, 4096, "float32", True),
    (100, 24576, 4096, "bfloat16", False),
    (256, 4096, 12288, "bfloat16", True),     # two 128-row slices
    (65, 6144, 4096, "float32", False),
    (129, 1000, 592, "float32", True),        # N not a multiple of 128, K not of 128, a 1-row second slice
    (200, 1002, 576, "float32", False),
    (48, 136, 4096, "bfloat16", True),        # one tile, its second warpgroup mostly past N
]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M,N,K,out_dtype,bias", CASES)
def test_w8a8_wgmma_linear(lib, rng, scheme, M, N, K, out_dtype, bias):
    bufs, _, (x, q, s, b) = run_wgmma(lib, rng, scheme, M, N, K, out_dtype, bias)
    check_w8a8(bufs, x, q, s, b, scheme, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M,N,K,out_dtype,bias", CASES[1::2])
def test_w8a8_wgmma_mbarrier_ring(lib, rng, scheme, M, N, K, out_dtype, bias):
    bufs, recs, (x, q, s, b) = run_wgmma(lib, rng, scheme, M, N, K, out_dtype, bias,
                                         mbar=not fp8_build.W8A8_WGMMA_MBAR)
    check_w8a8(bufs, x, q, s, b, scheme, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["auto", "channel"])
def test_tiny_plan_with_wgmma_w8a8_cuda_matches_numpy(tmp_path, seed, scheme):
    check_tiny_w8a8_plan(tmp_path, seed, scheme, "fp8_w8a8_wgmma", "w8a8_wgmma_")


def check_tiny_w8a8_plan(tmp_path, seed, scheme, setting: str, prefix: str) -> None:
    """Build setting `setting` on, no CUTLASS library: the 40-row decode bucket and the 64-row prefill bucket run
    quantize_fp8 (or the producers' quantize) + the kernels named prefix*; CUDA logits against the NumPy
    backend's."""
    from tests.test_cuda_e2e import SMALL, gpu_or_skip, make_model
    from tests.test_cuda_fp8 import W8A8_STEP_TOL, cuda_vs_numpy
    gpu_or_skip()
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.runtime.session import Session

    r = np.random.default_rng(seed)
    make_model(tmp_path / "hf", SMALL, int(r.integers(1 << 30)))
    build = BuildConfig(max_num_seqs=40, decode_buckets=[1, 2, 40], prefill_buckets=[64], max_seq_len=256,
                        block_size=16, dtype="bfloat16", target="sm_90a", quantization="fp8", fp8_scheme=scheme,
                        gemm_library=False, fp8_w8a16_max_rows=2, fp8_quantize_in_producer=True, **{setting: True})
    plan = compile_plan(tmp_path / "hf", tmp_path / "plan", build)
    fns = {rec.fn for bk in plan.buckets for op in bk.ops if op.cuda for rec in op.cuda.launch}
    assert any(f.startswith(prefix) for f in fns) and not any(f.startswith("skinny_w8a8_") for f in fns)
    prompts = [r.integers(3, SMALL["vocab_size"], int(r.integers(5, 20))).tolist() for _ in range(40)]
    forced = r.integers(3, SMALL["vocab_size"], (4, 40)).tolist()

    def logits(runner):
        sess = Session(runner, num_seqs=40)
        got = [sess.prefill(i, p)[1] for i, p in enumerate(prompts)]
        for toks in forced:                                   # 40 sequences a step: the decode_40 bucket
            step = sess.step({i: [t] for i, t in enumerate(toks)})[1]
            got += [step[i] for i in range(40)]
        return np.array(got, np.float64)

    errs = cuda_vs_numpy(plan, logits)
    print(f"per-row logits relative error CUDA vs NumPy: max {errs.max():.2e}, mean {errs.mean():.2e}")
    assert errs.max() <= W8A8_STEP_TOL


# ---- routing (no GPU) ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows,nt,slices", [(33, 64, 1), (64, 64, 1), (65, 128, 1), (128, 128, 1), (129, 128, 2),
                                            (256, 128, 2)])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_w8a8_wgmma_routing(rows, nt, slices, scheme):
    """fp8_w8a8_wgmma: rows 33-256 take the wgmma kernel (NT 64 / 128, slices of 128 on grid x), with or without a
    CUTLASS library; off: CUTLASS (as before)."""
    op = w8a8_op(rows, 4096, 4096, scheme)
    for cutlass in ({}, None):
        (rec,) = plan_linear(op, "bfloat16", None, cutlass, decode=True, fp8_wgmma=True).launch
        assert rec.fn.startswith(f"w8a8_wgmma_{fp8_build.SCHEME_TAG[scheme]}_n{nt}c"), rec.fn
        assert rec.grid[0] == 4096 // 128 * slices and rec.grid[2] == 1 and rec.block == (256, 1, 1)
        assert rec.smem == fp8_build.w8a8_wgmma_smem(nt) <= 227 * 1024
    assert plan_linear(op, "bfloat16", None, {}, decode=True).kernel == "cutlass_fp8"


def test_w8a8_wgmma_keeps_the_skinny_kernel_up_to_32_rows():
    (rec,) = plan_linear(w8a8_op(32, 4096, 4096, fp8.BLOCK128), "bfloat16", None, None, True, fp8_wgmma=True).launch
    assert rec.fn.startswith("skinny_w8a8_blk_m32")
    with pytest.raises(Exception, match="CUTLASS"):
        plan_linear(w8a8_op(257, 4096, 4096, fp8.BLOCK128), "bfloat16", None, None, True, fp8_wgmma=True)


def test_w8a8_wgmma_wide_routing():
    """wide: 129-256 rows as one n256 tile a weight tile (grid x = tiles), 33-128 as before; no mb at n256."""
    for rows, nt in ((64, 64), (128, 128), (129, 256), (256, 256)):
        (rec,) = fp8_build.plan_w8a8_wgmma(w8a8_op(rows, 4096, 4096, fp8.CHANNEL), "float32", mbar=True,
                                               wide=True).launch
        assert f"_n{nt}c" in rec.fn and rec.grid[0] == 32 and ("mb_" in rec.fn) == (nt != 256), rec
        assert rec.smem == fp8_build.w8a8_wgmma_smem(nt) <= 227 * 1024


@pytest.mark.parametrize("rows,n,k,cluster", [(64, 6144, 4096, 2), (64, 4096, 4096, 4), (64, 24576, 4096, 2),
                                              (64, 4096, 12288, 4), (256, 4096, 4096, 2), (256, 24576, 4096, 1),
                                              (100, 1000, 256, 2)])
def test_w8a8_wgmma_cluster_rule(rows, n, k, cluster):
    """One wave where the tiles allow (tiles x C <= 132), else the least idle last wave; C <= 128-k steps."""
    (rec,) = fp8_build.plan_w8a8_wgmma(w8a8_op(rows, n, k, fp8.BLOCK128), "bfloat16").launch
    assert rec.grid[1] == cluster, rec.grid


def test_fp8_plan_routes_33_to_256_rows_to_wgmma(tmp_path):
    """Compile (no GPU), fp8_w8a8_wgmma with and without the CUTLASS library: every W8A8 linear of 33-256 rows
    (decode 48, prefill 64 / 256) on the wgmma kernel, rows <= 32 on the skinny kernel, more on CUTLASS."""
    from tests.test_cuda_fp8 import compile_fp8_tiny
    for lib in (False, True):
        (tmp_path / str(lib)).mkdir()
        plan = compile_fp8_tiny(tmp_path / str(lib), max_num_seqs=48, decode_buckets=[1, 16, 48],
                                prefill_buckets=[64, 256, 512] if lib else [64, 256], fp8_w8a16_max_rows=8, fp8_w8a8_wgmma=True,
                                gemm_library=lib)
        seen = set()
        for bk in plan.buckets:
            for op in bk.ops:
                if op.op == "linear" and op.inp_scale:
                    (rec,) = op.cuda.launch
                    want = ("skinny_w8a8_" if bk.num_tokens <= 32 else "w8a8_wgmma_" if bk.num_tokens <= 256 else
                            "xserv_gemm_fp8")
                    assert rec.fn.startswith(want), (bk.name, rec.fn)
                    seen.add(want)
        assert seen == ({"skinny_w8a8_", "w8a8_wgmma_", "xserv_gemm_fp8"} if lib else {"skinny_w8a8_", "w8a8_wgmma_"})

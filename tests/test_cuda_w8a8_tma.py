"""Tensor-map launch arguments and the TMA-fed W8A8 wgmma GEMM (kernels/gemm_w8a8_tma.cu) on the GPU: a TMA box
against the source bytes (NumPy slicing, the 128B swizzle permutation written out independently), and the GEMM
against the NumPy op linear_w8a8 and float64 (test_cuda_fp8.check_w8a8) on fresh random inputs (seed printed on
failure), outputs poisoned with NaN: both scale schemes, every routed row count class, every built cluster size,
the Qwen3-8B shapes with M / N / K tails, graph replay == eager. The routing tests at the end need no GPU.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tests.cuda_fixtures import bf, rng  # noqa: F401  (fixtures)
from tests.test_cuda_fp8 import SCHEMES, assert_replay_equals_eager, check_w8a8, run_w8a8, w8a8_op
from xserv_aot import fp8
from xserv_aot.plan import fp8_build
from xserv_aot.plan.kernel_build import plan_linear
from xserv_aot.plan.tensor_maps import matrix_map


@pytest.fixture(scope="module")
def lib():
    """quantize_fp8 (gemv_fp8.cu) and the TMA kernels alone (a short NVRTC build)."""
    from xserv_aot.runtime.select import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from xserv_aot.runtime.cuda.kernel_lib import KernelLib
    return KernelLib(sources=("gemv_fp8.cu", "gemm_w8a8_tma.cu"))


def expected_box(src: np.ndarray, c0: int, c1: int, box_cols: int, box_rows: int, swizzle: str) -> np.ndarray:
    """The bytes TMA writes for the box at (c0, c1) of a row-major byte matrix: rows c1.., bytes c0.., zero past the
    edges; 128B swizzle: 16-byte chunk c of box row r lands at chunk c ^ (r % 8)."""
    rows, cols = src.shape
    tile = np.zeros((box_rows, box_cols), np.uint8)
    r1, k1 = min(rows, c1 + box_rows), min(cols, c0 + box_cols)
    tile[:r1 - c1, :k1 - c0] = src[c1:r1, c0:k1]
    if swizzle == "none":
        return tile.reshape(-1)
    out = np.zeros_like(tile)
    for r in range(box_rows):
        for c in range(box_cols // 16):
            d = c ^ (r % 8)
            out[r, 16 * d:16 * d + 16] = tile[r, 16 * c:16 * c + 16]
    return out.reshape(-1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,box_rows,box_cols,swizzle,c0,c1", [
    (200, 4096, 64, 128, "128B", 256, 64),
    (200, 4096, 128, 128, "128B", 3968, 128),     # the last rows past the matrix: zero
    (37, 592, 16, 128, "128B", 512, 32),          # K tail: bytes 592.. zero, rows 37.. zero
    (40, 96, 8, 32, "none", 48, 4),
])
def test_tensor_map_box_equals_source(lib, rng, rows, cols, box_rows, box_cols, swizzle, c0, c1):
    from xserv_aot.runtime.cuda.tensor_map import encode
    src = rng.integers(1, 256, (rows, cols), dtype=np.uint8)
    dev = lib.to_device(src.view(ml_dtypes.float8_e4m3fn))
    nbytes = box_rows * box_cols
    out = lib.empty((nbytes,), "float8_e4m3fn")
    _, spec = matrix_map("src", "float8_e4m3fn", rows, cols, box_rows, box_cols, swizzle=swizzle)
    lib.launch("tma_box_copy", [1], [128], [("tmap", encode(spec, dev.ptr)), ("i32", c0), ("i32", c1),
                                            ("i32", nbytes), ("ptr", out.ptr)], smem=nbytes + 1024)
    got = lib.dev.dtoh(out.ptr, (nbytes,), np.uint8)
    np.testing.assert_array_equal(got, expected_box(src, c0, c1, box_cols, box_rows, swizzle))


def run_tma(lib, rng, scheme, M, N, K, out_dtype, bias, cluster=None, shape=None):
    """quantize_fp8 (device) + the TMA kernel as a plan without the CUTLASS library routes it (fp8_w8a8_tma: rows
    33-256) or at a forced cluster size / block shape."""
    bufs, recs, inputs, choice = run_w8a8(
        lib, rng, scheme, M, N, K, out_dtype, bias,
        lambda op: (fp8_build.plan_w8a8_tma(op, out_dtype, cluster, shape)
                    if cluster or shape else plan_linear(op, out_dtype, None, None, decode=True, fp8_wgmma="tma")))
    assert choice.kernel.startswith(f"w8a8_tma_{fp8_build.SCHEME_TAG[scheme]}_"), choice.kernel
    return bufs, recs, inputs


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_w8a8_tma_every_routed_row_count(lib, rng, scheme):
    """Rows 33..256 (every count fp8_w8a8_tma routes here: n64, n128, two n128 slices), fresh inputs each."""
    for M in range(fp8_build.W8A8_SKINNY_MAX_ROWS + 1, fp8_build.W8A8_WGMMA_MAX_ROWS + 1):
        bufs, recs, (x, q, s, b) = run_tma(lib, rng, scheme, M, 264, 400, "float32", M % 2 == 0)
        try:
            check_w8a8(bufs, x, q, s, b, scheme, "float32")
        except AssertionError as e:
            raise AssertionError(f"rows {M} ({recs[-1].fn}): {e}") from None


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("cluster", fp8_build.W8A8_TMA_CLUSTERS)
@pytest.mark.parametrize("M,K", [(96, 2176), (40, 384), (250, 1024)])  # 17 steps; 3 (c4: a block without a step)
def test_w8a8_tma_every_cluster(lib, rng, scheme, cluster, M, K):
    bufs, recs, (x, q, s, b) = run_tma(lib, rng, scheme, M, 1000, K, "float32", True, cluster)
    assert recs[-1].grid[1] == cluster
    check_w8a8(bufs, x, q, s, b, scheme, "float32")


R256_SHAPES = [sh for sh in fp8_build.W8A8_TMA_SHAPES if sh[0] * sh[1] == 4]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", R256_SHAPES)
@pytest.mark.parametrize("cluster", fp8_build.W8A8_TMA_CLUSTERS_R256)
@pytest.mark.parametrize("M,N,K", [(64, 1000, 2176), (33, 520, 4096), (47, 136, 768)])
def test_w8a8_tma_256_row_blocks(lib, rng, scheme, shape, cluster, M, N, K):
    """The 256-row blocks (2 x 2) at every built cluster size: N tails inside a tile's second 128-row scale
    block (1000, 520) and past it (136: the second block's scale index clamps), K tails, a block with no step."""
    bufs, recs, (x, q, s, b) = run_tma(lib, rng, scheme, M, N, K, "float32", M % 2 == 1, cluster, shape)
    assert recs[-1].grid[1] == cluster and recs[-1].block[0] == 128 * shape[0] + 32
    check_w8a8(bufs, x, q, s, b, scheme, "float32")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", R256_SHAPES)
@pytest.mark.parametrize("M,N,K,out_dtype", [(64, 6144, 4096, "bfloat16"), (40, 4096, 12288, "bfloat16"),
                                             (64, 24576, 4096, "float32"), (57, 4096, 4096, "bfloat16")])
def test_w8a8_tma_256_row_blocks_qwen3_shapes(lib, rng, scheme, shape, M, N, K, out_dtype):
    bufs, recs, (x, q, s, b) = run_tma(lib, rng, scheme, M, N, K, out_dtype, True, None, shape)
    check_w8a8(bufs, x, q, s, b, scheme, out_dtype)
    assert recs[-1].pdl                # the replay overlaps quantize_fp8: the GEMM's X waits for it
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
    (40, 40, 128, "float32", False),          # N below one warpgroup's 64 rows: a 40-row weight box
]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M,N,K,out_dtype,bias", CASES)
def test_w8a8_tma_linear(lib, rng, scheme, M, N, K, out_dtype, bias):
    bufs, _, (x, q, s, b) = run_tma(lib, rng, scheme, M, N, K, out_dtype, bias)
    check_w8a8(bufs, x, q, s, b, scheme, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M", [64, 160])
def test_w8a8_tma_graph_replay_equals_eager(lib, rng, scheme, M):
    bufs, recs, _ = run_tma(lib, rng, scheme, M, 2048, 4096, "bfloat16", True)
    assert_replay_equals_eager(lib, bufs, ("out", "xq", "xs"),
                               lambda stream: [lib.launch_record(r, bufs, sync=False) for r in recs])


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["auto", "channel"])
def test_tiny_plan_with_tma_w8a8_cuda_matches_numpy(tmp_path, seed, scheme):
    """The runtime's own path: tensor maps encoded at plan load, replayed in graphs (test_cuda_w8a8_wgmma)."""
    from tests.test_cuda_w8a8_wgmma import check_tiny_w8a8_plan
    check_tiny_w8a8_plan(tmp_path, seed, scheme, "fp8_w8a8_tma", "w8a8_tma_")


# ---- routing and records (no GPU) -----------------------------------------------------------------------------

@pytest.mark.parametrize("rows,nt,slices", [(33, 64, 1), (64, 64, 1), (65, 128, 1), (128, 128, 1), (129, 128, 2),
                                            (256, 128, 2)])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_w8a8_tma_routing(rows, nt, slices, scheme):
    """fp8_w8a8_tma: rows 33-64 take the TMA kernel with two tensor maps (weight: 128 rows a box, xq: the tile's
    rows or all of M), more rows CUTLASS where the plan has it, else the TMA kernel up to 256; K < 128: the
    cp.async wgmma kernel."""
    op = w8a8_op(rows, 4096, 4096, scheme)
    if rows > fp8_build.W8A8_TMA_MAX_ROWS:
        assert plan_linear(op, "bfloat16", None, {}, decode=True, fp8_wgmma="tma").kernel == "cutlass_fp8"
    for cutlass in ({}, None) if rows <= fp8_build.W8A8_TMA_MAX_ROWS else (None,):
        (rec,) = plan_linear(op, "bfloat16", None, cutlass, decode=True, fp8_wgmma="tma").launch
        assert rec.fn.startswith(f"w8a8_tma_{fp8_build.SCHEME_TAG[scheme]}_n{nt}c"), rec.fn
        assert rec.grid[0] == 4096 // 128 * slices and rec.block == (288, 1, 1)
        (_, tw), (_, tx) = rec.args[:2]
        assert (tw["buffer"], tw["dims"], tw["strides"], tw["box"]) == ("w", [4096, 4096], [4096], [128, 128])
        assert (tx["buffer"], tx["dims"], tx["box"]) == ("xq", [4096, rows], [128, min(nt, rows)])
        assert tw["swizzle"] == tx["swizzle"] == "128B" and tw["oob_fill"] == "zero"
    (rec,) = plan_linear(w8a8_op(rows, 4096, 64, scheme), "bfloat16", None, {}, decode=True, fp8_wgmma="tma").launch
    assert rec.fn.startswith("w8a8_wgmma_"), rec.fn


@pytest.mark.parametrize("rows,n,k,cluster", [(64, 6144, 4096, 2), (64, 4096, 4096, 3), (64, 24576, 4096, 1),
                                              (64, 4096, 12288, 3), (256, 4096, 4096, 1), (256, 6144, 4096, 1),
                                              (100, 1000, 256, 2), (64, 1000, 128, 1)])
def test_w8a8_tma_cluster_rule(rows, n, k, cluster):
    """Clustered grids within W8A8_TMA_BLOCKS (96) blocks; more tiles: the fewest waves per K share; C <= steps."""
    (rec,) = fp8_build.plan_w8a8_tma(w8a8_op(rows, n, k, fp8.BLOCK128), "bfloat16").launch
    assert rec.grid[1] == cluster, rec.grid


@pytest.mark.parametrize("rows,n,shape", [(64, 24576, (2, 2)), (33, 17000, (2, 2)), (64, 16896, (2, 1)),
                                          (64, 6144, (2, 1)), (64, 4096, (2, 1)), (65, 24576, (2, 1))])
def test_w8a8_tma_shape_rule(rows, n, shape):
    """256-row blocks where the 128-row tiles are more than one wave (> 132) at <= 64 rows, else 128-row ones;
    every TMA launch is a PDL one (its weights stream before griddepcontrol.wait)."""
    assert fp8_build.tma_shape(n, rows) == shape
    (rec,) = fp8_build.plan_w8a8_tma(w8a8_op(rows, n, 4096, fp8.BLOCK128), "bfloat16").launch
    assert rec.block[0] == 128 * shape[0] + 32 and rec.pdl
    assert fp8_build.W8A8_TMA_SHAPES[shape] in rec.fn
    d = rec.to_dict()
    assert d["pdl"] is True and type(rec).from_dict(d, "t") == rec


@pytest.mark.parametrize("shape", R256_SHAPES)
@pytest.mark.parametrize("rows,n,k,tiles,cluster", [(64, 6144, 4096, 24, 4), (64, 4096, 4096, 16, 6),
                                                    (64, 24576, 4096, 96, 1), (48, 4096, 12288, 16, 6),
                                                    (64, 1000, 256, 4, 2)])
def test_w8a8_tma_256_row_records(shape, rows, n, k, tiles, cluster):
    """A 256-row block: 128 x warpgroups + 32 threads, one 256-row weight box, clusters from (1, 2, 3, 4, 6) within
    96 blocks, shared memory within the SM's 227 KB; above 64 rows the plan keeps the 128-row block."""
    op = w8a8_op(rows, n, k, fp8.BLOCK128)
    (rec,) = fp8_build.plan_w8a8_tma(op, "bfloat16", None, shape).launch
    tag = fp8_build.W8A8_TMA_SHAPES[shape]
    assert rec.fn == f"w8a8_tma_blk_n64c{cluster}{tag}_bf16" and rec.grid[:2] == (tiles, cluster), rec
    assert rec.block == (128 * shape[0] + 32, 1, 1) and rec.smem <= 227 * 1024
    (_, tw), (_, tx) = rec.args[:2]
    assert tw["box"] == [128, 256] and tx["box"] == [128, rows]
    (rec,) = fp8_build.plan_w8a8_tma(w8a8_op(100, n, k, fp8.BLOCK128), "bfloat16", None, shape).launch
    assert rec.fn.startswith("w8a8_tma_blk_n128c") and rec.block == (288, 1, 1)


@pytest.fixture(scope="module")
def gemm_lib(tmp_path_factory, pytestconfig):
    """The CUTLASS library the W8A8 routing sizes split-K workspaces from: --gemm-lib, else built (cached by key)."""
    from pathlib import Path
    from xserv_aot.plan import cutlass_build as cb
    if pytestconfig.getoption("--gemm-lib"):
        return Path(pytestconfig.getoption("--gemm-lib"))
    try:
        cb.find_nvcc()
    except cb.GemmBuildError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("gemm")
    return out / cb.build_gemm_library(out)["file"]


def test_h200_build_routes_33_to_64_rows_to_tma(gemm_lib):
    """plans/h200.build.json (fp8_w8a8_tma, what the H200 measured faster): its FP8 decode buckets of 33-64 rows run
    the Qwen3-8B linears on the TMA kernel, larger ones on CUTLASS W8A8 (no compile: plan_linear per shape)."""
    import json
    from tests.conftest import ROOT
    from xserv_aot.config import BuildConfig
    build = BuildConfig.from_dict(json.loads((ROOT / "plans" / "h200.build.json").read_text())).validate()
    assert build.fp8_w8a8_tma and build.fp8_w8a16_max_rows < fp8_build.W8A8_SKINNY_MAX_ROWS
    seen = set()
    for rows in build.decode_buckets:
        for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
            if rows <= build.fp8_w8a16_max_rows:
                continue
            c = plan_linear(w8a8_op(rows, n, k, fp8.BLOCK128), "bfloat16", None, {"path": gemm_lib}, decode=True,
                            fp8_wgmma="tma")
            want = ("skinny_w8a8_" if rows <= 32 else "w8a8_tma_" if rows <= 64 else "cutlass_fp8")
            assert c.kernel.startswith(want), (rows, n, k, c.kernel)
            seen.add(want)
    assert seen == {"skinny_w8a8_", "w8a8_tma_", "cutlass_fp8"}


def test_fp8_plan_routes_33_to_256_rows_to_tma(tmp_path):
    """Compile (no GPU), fp8_w8a8_tma without the CUTLASS library: the W8A8 linears of 33-256 rows run the TMA
    kernel, their records pass the signature and tensor-map checks, and the plan loads back."""
    from tests.test_cuda_fp8 import compile_fp8_tiny
    from xserv_aot.plan.manifest import Plan
    plan = compile_fp8_tiny(tmp_path, max_num_seqs=48, decode_buckets=[1, 16, 48], prefill_buckets=[64, 256],
                            fp8_w8a16_max_rows=8, fp8_w8a8_tma=True, gemm_library=False)
    fns = {bk.num_tokens: rec.fn for bk in plan.buckets for op in bk.ops if op.op == "linear" and op.inp_scale
           for rec in op.cuda.launch}
    assert fns[16].startswith("skinny_w8a8_") and all(fns[r].startswith("w8a8_tma_") for r in (48, 64, 256)), fns
    assert Plan.load(tmp_path / "plan").buckets

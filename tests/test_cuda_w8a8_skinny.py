"""The W8A8 skinny kernel (kernels/gemm_skinny_w8a8.cu: quantize_fp8's rows x e4m3 weights on mma.sync e4m3, K
split over a thread-block cluster) on the GPU against the NumPy op linear_w8a8 and an independent float64
reference, on fresh random inputs (seed printed on failure), outputs poisoned with NaN; every built cluster size;
graph replay == eager; a tiny FP8 plan whose decode buckets run W8A8 (fp8_w8a16_max_rows) CUDA vs NumPy. The
routing tests at the end need no GPU. The producers that quantize: tests/test_cuda_fp8_producers.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import bf, lib, rng  # noqa: F401  (fixtures)
from tests.test_cuda_fp8 import (SCHEMES, W8A8_STEP_TOL, assert_replay_equals_eager, check_w8a8, cuda_vs_numpy,
                                 make_weight, ref_weight_real, rel_err, run_w8a8, to_dev_fp8)
from xserv_aot import fp8
from xserv_aot.plan import fp8_build
from xserv_aot.plan.kernel_build import plan_linear
from xserv_aot.plan.op_records import Linear
from xserv_aot.runtime import numpy_ops


def run_w8a8_skinny(lib, rng, scheme, M, N, K, out_dtype, bias, cluster=None, half=False):
    """quantize_fp8 (device) + the W8A8 skinny kernel; -> (bufs, records, (x, q, s, b))."""
    direct = cluster or half or M > fp8_build.W8A8_SKINNY_MAX_ROWS        # 128-row tiles: bench only, not routed
    bufs, recs, inputs, choice = run_w8a8(
        lib, rng, scheme, M, N, K, out_dtype, bias,
        lambda op: (fp8_build.plan_w8a8_skinny(op, out_dtype, cluster, half=half) if direct else
                    plan_linear(op, out_dtype, None, None, decode=True)))
    assert choice.kernel.startswith(f"skinny_w8a8_{fp8_build.SCHEME_TAG[scheme]}_"), choice.kernel
    return bufs, recs, inputs



CASES = [  # rows, N, K, out dtype, bias
    (16, 4096, 4096, "bfloat16", False),
    (37, 2048, 4096, "bfloat16", True),       # M not a multiple of 8
    (64, 1024, 12288, "bfloat16", False),
    (32, 4096, 2048, "float32", True),
    (5, 1000, 576, "float32", True),          # N not a multiple of the 256-row tile, K not of 128
    (48, 1002, 592, "float32", False),
    (128, 2048, 2048, "bfloat16", True),      # the 128-row tile (bench only)
    (100, 1000, 576, "float32", False),
    (200, 1000, 576, "float32", True),        # two 128-row slices on grid z
]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M,N,K,out_dtype,bias", CASES)
def test_w8a8_skinny_linear(lib, rng, scheme, M, N, K, out_dtype, bias):
    bufs, _, (x, q, s, b) = run_w8a8_skinny(lib, rng, scheme, M, N, K, out_dtype, bias)
    check_w8a8(bufs, x, q, s, b, scheme, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("cluster", fp8_build.W8A8_SKINNY_CLUSTERS)
@pytest.mark.parametrize("M,K", [(64, 2176), (20, 576)])   # 17 steps; 5 (c8: blocks without a step)
def test_w8a8_skinny_every_cluster(lib, rng, scheme, cluster, M, K):
    bufs, _, (x, q, s, b) = run_w8a8_skinny(lib, rng, scheme, M, 1000, K, "float32", True, cluster)
    check_w8a8(bufs, x, q, s, b, scheme, "float32")


def run_blkq(lib, rng, M, N, K, out_dtype, bias, cluster=None, half=False):
    """The blkq kernel (bf16 X quantized in the kernel); -> (out, x, q, s, b, record)."""
    q, s = make_weight(rng, N, K, fp8.BLOCK128)
    x = bf(rng.standard_normal((M, K), dtype=np.float32) * np.exp(rng.uniform(-2, 2, (M, 1))).astype(np.float32))
    x[0, :128] = 0.0                                                   # an all-zero group: amax clamps to 1e-12
    b = bf(rng.standard_normal(N)) if bias else None
    op = Linear(rows=M, n=N, k=K, inp="xq", inp_scale="xs", weight="w", bias="b" if bias else None, out="out",
                weight_scale="w.scale", quant=fp8.BLOCK128)
    (rec,) = fp8_build.plan_w8a8_skinny(op, out_dtype, cluster, quantized_from="x", half=half).launch
    assert rec.fn.startswith("skinny_w8a8_blkq_")
    bufs = {"x": lib.to_device(x, "bfloat16"), "w": to_dev_fp8(lib, q), "w.scale": lib.to_device(s),
            "b": lib.to_device(b, "bfloat16") if bias else None, "out": lib.empty((M, N), out_dtype)}
    lib.dev.memset(bufs["out"].ptr, 0xFF, bufs["out"].nbytes)
    lib.launch_record(rec, bufs)
    return bufs, rec, (x, q, s, b)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,out_dtype,bias", CASES[::2])
def test_w8a8_skinny_quantizing_in_kernel(lib, rng, M, N, K, out_dtype, bias):
    """blkq == quantize_fp8 (NumPy, the op the plan keeps) + linear_w8a8; the in-kernel e4m3 bytes and scales are
    those of the quantize op, so the only difference is the fp32 summation order."""
    bufs, _, (x, q, s, b) = run_blkq(lib, rng, M, N, K, out_dtype, bias)
    xq, xs = numpy_ops.quantize_fp8(x, fp8.BLOCK)
    out = bufs["out"].numpy()
    tol = 1e-2 if out_dtype == "bfloat16" else 3e-4
    assert rel_err(out, numpy_ops.linear_w8a8(xq, xs, q, s, fp8.BLOCK128, b)) <= tol
    wr = ref_weight_real(q, s, fp8.BLOCK128)
    assert rel_err(out, x.astype(np.float64) @ wr.T + (0 if b is None else b)) <= 6e-2


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", fp8_build.W8A8_SKINNY_CLUSTERS)
def test_w8a8_skinny_quantizing_in_kernel_every_cluster(lib, rng, cluster):
    bufs, _, (x, q, s, b) = run_blkq(lib, rng, 33, 1000, 2176, "float32", True, cluster)
    xq, xs = numpy_ops.quantize_fp8(x, fp8.BLOCK)
    assert rel_err(bufs["out"].numpy(), numpy_ops.linear_w8a8(xq, xs, q, s, fp8.BLOCK128, b)) <= 3e-4


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,cluster", [(64, 2048, 4096, None), (40, 1000, 592, 5)])
def test_w8a8_skinny_half_width_blocks(lib, rng, M, N, K, cluster):
    """The r1 variants (128-row blocks at 33-64 rows), both schemes and the in-kernel quantize."""
    for scheme in SCHEMES:
        bufs, recs, (x, q, s, b) = run_w8a8_skinny(lib, rng, scheme, M, N, K, "float32", True, cluster, half=True)
        assert "r1c" in recs[-1].fn
        check_w8a8(bufs, x, q, s, b, scheme, "float32")
    bufs, rec, (x, q, s, b) = run_blkq(lib, rng, M, N, K, "float32", True, cluster, half=True)
    assert "r1c" in rec.fn
    xq, xs = numpy_ops.quantize_fp8(x, fp8.BLOCK)
    assert rel_err(bufs["out"].numpy(), numpy_ops.linear_w8a8(xq, xs, q, s, fp8.BLOCK128, b)) <= 3e-4


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_w8a8_skinny_graph_replay_equals_eager(lib, rng, scheme):
    bufs, recs, _ = run_w8a8_skinny(lib, rng, scheme, 64, 2048, 4096, "bfloat16", True)
    assert_replay_equals_eager(lib, bufs, ("out", "xq", "xs"),
                               lambda stream: [lib.launch_record(r, bufs, sync=False) for r in recs])


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,producer", [("auto", False), ("auto", True), ("channel", True)])
def test_tiny_plan_with_w8a8_decode_cuda_matches_numpy(tmp_path, seed, scheme, producer):
    """fp8_w8a16_max_rows 2: the 4-row decode bucket and the 16-row prefill bucket run quantize_fp8 + the W8A8
    skinny kernel (no CUTLASS library needed; producer: the norms write the quantized rows); CUDA logits against
    the NumPy backend's."""
    from tests.test_cuda_e2e import SMALL, gpu_or_skip, make_model
    gpu_or_skip()
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.runtime.session import Session

    r = np.random.default_rng(seed)
    make_model(tmp_path / "hf", SMALL, int(r.integers(1 << 30)))
    build = BuildConfig(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[16], max_seq_len=256,
                        block_size=16, dtype="bfloat16", target="sm_90a", quantization="fp8", fp8_scheme=scheme,
                        gemm_library=False, fp8_w8a16_max_rows=2, fp8_quantize_in_producer=producer)
    plan = compile_plan(tmp_path / "hf", tmp_path / "plan", build)
    fns = {rec.fn for bk in plan.buckets for op in bk.ops if op.cuda for rec in op.cuda.launch}
    assert any(f.startswith("skinny_w8a8_") for f in fns) and not any(f.startswith("skinny_fp8_") for f in fns)
    assert any(f.startswith("skinny_w8a8_blkq_") for f in fns) == (scheme == "auto" and fp8_build.W8A8_QUANTIZE_IN_KERNEL)
    assert ("add_rmsnorm_q" in fns) == producer
    prompts = [r.integers(3, SMALL["vocab_size"], 12).tolist() for _ in range(4)]
    forced = r.integers(3, SMALL["vocab_size"], (8, 4)).tolist()

    def logits(runner):
        sess = Session(runner, num_seqs=4)
        got = [sess.prefill(i, p)[1] for i, p in enumerate(prompts)]
        for toks in forced:                                   # 4 sequences a step: the decode_4 bucket (W8A8)
            step = sess.step({i: [t] for i, t in enumerate(toks)})[1]
            got += [step[i] for i in range(4)]
        return np.array(got, np.float64)

    errs = cuda_vs_numpy(plan, logits)
    print(f"per-row logits relative error CUDA vs NumPy: max {errs.max():.2e}, mean {errs.mean():.2e}")
    assert errs.max() <= W8A8_STEP_TOL            # every step is W8A8 here (test_cuda_fp8.py: why this bound)


# ---- routing (no GPU) ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("qx", [False, True])
@pytest.mark.parametrize("scheme", ["auto", "channel"])
def test_w8a8_plan_routing_and_fused_quantize(tmp_path, monkeypatch, scheme, qx):
    """Compile (no GPU), fp8_w8a16_max_rows 2: rows 1-2 W8A16 GEMVs; rows 4 and 16 quantize + W8A8 skinny; with
    W8A8_QUANTIZE_IN_KERNEL the quantize is folded into the block128 kernels (blkq, reading the bf16 input; auto =
    block128 for this model), else (and for channel ones) launched before them."""
    pytest.importorskip("cuda.core")
    from tests.test_cuda_fp8 import compile_fp8_tiny
    monkeypatch.setattr(fp8_build, "W8A8_QUANTIZE_IN_KERNEL", qx)
    plan = compile_fp8_tiny(tmp_path, prefill_buckets=[16], fp8_w8a16_max_rows=2, fp8_scheme=scheme)
    seen = set()
    for bk in plan.buckets:
        for i, op in enumerate(bk.ops):
            if op.op == "linear" and op.quant:
                fn = op.cuda.launch[0].fn
                if bk.num_tokens <= 2:
                    assert fn.startswith("gemv_fp8_") and not op.inp_scale, fn
                    continue
                prev = bk.ops[i - 1]
                assert prev.op == "quantize_fp8" and op.inp_scale
                fused = op.quant == fp8.BLOCK128 and qx
                assert (prev.cuda.kernel == "fused_into_next") == fused
                tag = "blkq" if fused else fp8_build.SCHEME_TAG[op.quant]
                assert fn.startswith(f"skinny_w8a8_{tag}_"), fn
                assert (op.cuda.launch[0].args[0] == ("ptr", prev.inp)) == fused
                seen.add(fused)
    assert seen == {scheme == "auto" and qx}


def w8a8_op(rows, n, k, scheme=fp8.BLOCK128):
    return Linear(rows=rows, n=n, k=k, inp="xq", inp_scale="xs", weight="w", bias=None, out="y",
                  weight_scale="w.scale", quant=scheme)


@pytest.mark.parametrize("n,k,cluster", [(6144, 4096, 4), (4096, 4096, 5), (24576, 4096, 1), (4096, 12288, 5),
                                         (256, 128, 1), (1000, 576, 5), (151936, 4096, 1)])
def test_w8a8_skinny_cluster_rule(n, k, cluster):
    """The H200 sweep's best K splits on the Qwen3-8B shapes: qkv 24 tiles x 4, o / down 16 x 5, gate_up 96 x 1
    (at most W8A8_SKINNY_BLOCKS blocks); never more blocks a cluster than 128-k steps."""
    (rec,) = plan_linear(w8a8_op(32, n, k), "bfloat16", None, {}, decode=True).launch
    assert rec.fn == f"skinny_w8a8_blk_m32c{cluster}_bf16" and rec.grid == (-(-n // 256), cluster, 1)
    assert fp8_build.w8a8_cluster(n, k) == cluster


@pytest.mark.parametrize("rows,mt", [(3, 16), (16, 16), (17, 32), (48, 64), (64, 64)])
def test_w8a8_rows_up_to_64_take_the_skinny_kernel_without_cutlass(rows, mt):
    (rec,) = plan_linear(w8a8_op(rows, 4096, 4096, fp8.CHANNEL), "float32", None, None, decode=True).launch
    assert rec.fn == f"skinny_w8a8_ch_m{mt}c5_f32"
    with_lib = plan_linear(w8a8_op(rows, 4096, 4096, fp8.CHANNEL), "float32", None, {}, decode=True)
    assert (with_lib.kernel == "cutlass_fp8") == (rows > fp8_build.W8A8_SKINNY_MAX_ROWS)
    assert rec.smem == fp8_build.skinny_w8a8_smem(mt) and rec.smem <= 227 * 1024
    assert fp8_build.skinny_w8a8_smem(mt, qx=True) <= 227 * 1024 and fp8_build.skinny_w8a8_smem(128) <= 227 * 1024

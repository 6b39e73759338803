"""The add_rmsnorm folded into the FP8 GEMVs around it (build setting fold_norm with gemv "cuda_cores", plan/norm_fold.folds_norm,
kernels/gemv_fp8.cu RES / NORM): the plan's routing (CPU), each kernel against NumPy and float64 on fresh inputs with
poisoned outputs, the pair against the unfused kernels, and whole plans (GPU)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import bf, lib, rng  # noqa: F401  (fixtures)
from tests.test_cuda_fp8 import (AFTER_W8A8_TOL, SCHEMES, compile_fp8_tiny, make_weight, ref_linear, rel_err,
                                 silu_mul_ref, to_dev_fp8)
from xserv_aot import fp8
from xserv_aot.plan import fp8_build, norm_fold
from xserv_aot.plan.elementwise_plan import norm_launch
from xserv_aot.plan.op_records import AddRmsNorm, GatherRows, Linear
from xserv_aot.runtime import numpy_ops

EPS = 1e-6


def lin(inp, out, rows=1, n=64, k=64, quant=fp8.CHANNEL, **kw):
    return Linear(rows=rows, n=n, k=k, inp=inp, weight="w", bias=None, out=out, weight_scale=quant and "w.scale",
                  quant=quant, **kw)


def norm(rows=1):
    return AddRmsNorm(residual="x", delta="o", weight="nw", out="h", rows=rows, eps=EPS)


def test_folds_only_between_two_fp8_gemvs_whose_buffers_nobody_else_reads():
    ops = [lin("attn", "o"), norm(), lin("h", "qkv")]
    assert norm_fold.folds_norm(ops, 1, True) and not norm_fold.folds_norm(ops, 1, False)
    folded = norm_fold.folded_norms(ops, True)
    assert folded == {1} and not norm_fold.folded_norms(ops, False)
    assert norm_fold.fold_role(ops, 0, folded) == ("res", ops[1]) and norm_fold.fold_role(ops, 2, folded) == ("norm", ops[1])
    assert not norm_fold.folds_norm(ops + [GatherRows(inp="h", indices="i", out="hl", rows=1)], 1, True)
    assert not norm_fold.folds_norm(ops + [GatherRows(inp="o", indices="i", out="hl", rows=1)], 1, True)
    assert not norm_fold.folds_norm([lin("attn", "o"), norm(), lin("h", "qkv", quant=None)], 1, True)
    assert not norm_fold.folds_norm([lin("attn", "o", rows=4), norm(4), lin("h", "qkv", rows=4)], 1, True)
    assert not norm_fold.folds_norm([lin("attn", "o", inp_scale="xq_scale"), norm(), lin("h", "qkv")], 1, True)
    assert not norm_fold.folds_norm([lin("attn", "o", n=128), norm(), lin("h", "qkv")], 1, True)


@pytest.mark.parametrize("scheme", ["channel", "block128"])
def test_fold_routes_the_1_2_row_buckets_only(tmp_path, scheme):
    """Compile (no GPU): in decode_1 / decode_2 every add_rmsnorm but the final one launches nothing, the linear
    before it adds into x (res kernel), the one after reads x normed (norm kernels); other buckets unchanged."""
    plan = compile_fp8_tiny(tmp_path, fp8_scheme=scheme, fold_norm=True)
    assert list(plan.arena[fp8_build.NORM_PARTIALS].shape) == [2, 256 // fp8_build.GEMV_BLOCK_ROWS]
    tag = {"channel": "ch", "block128": "blk"}[scheme]
    for bk in plan.buckets:
        ops = bk.ops
        folded = [i for i, op in enumerate(ops) if op.cuda.kernel == "fused_into_neighbours"]
        if bk.num_tokens > 2:
            assert not folded
            continue
        norms = [i for i, op in enumerate(ops) if op.op == "add_rmsnorm"]
        assert folded == norms[:-1] and len(folded) == 3            # 2 layers: post-attention x 2, input of layer 1
        for i in folded:
            before, after = ops[i - 1].cuda, ops[i + 1].cuda
            assert before.launch[0].fn == f"gemv_fp8_{tag}_res_m{bk.num_tokens}" and before.fused_residual == "x"
            assert after.launch[0].fn.startswith(f"gemv_fp8_{tag}_norm_")
            assert after.launch[0].args[0] == ("ptr", "x") and after.launch[0].args[3] == ("i32", 16)
    (tmp_path / "plain").mkdir()
    plain = compile_fp8_tiny(tmp_path / "plain", fp8_scheme=scheme)
    assert fp8_build.NORM_PARTIALS not in plain.arena
    assert not any(op.cuda.kernel == "fused_into_neighbours" for bk in plain.buckets for op in bk.ops)


def parts_of(x: np.ndarray) -> np.ndarray:
    """float64 sums of squares of x [M, N] over each 16-column block -> [M, ceil(N / 16)]."""
    m, n = x.shape
    pad = np.zeros((m, -(-n // 16) * 16))
    pad[:, :n] = x.astype(np.float64) ** 2
    return pad.reshape(m, -1, 16).sum(-1)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (2, 4096, 12288), (1, 1000, 576), (2, 264, 256)])
def test_res_gemv_adds_into_the_residual_and_writes_partials(lib, rng, scheme, M, N, K):
    q, s = make_weight(rng, N, K, scheme)
    a = bf(rng.standard_normal((M, K), dtype=np.float32))
    x = bf(rng.standard_normal((M, N), dtype=np.float32))
    op = Linear(rows=M, n=N, k=K, inp="a", weight="w", bias=None, out="o", weight_scale="w.scale", quant=scheme)
    nrm = AddRmsNorm(residual="x", delta="o", weight="nw", out="h", rows=M, eps=EPS)
    (rec,) = fp8_build.plan_fp8_linear(op, "bfloat16", None, None, fold=("res", nrm)).launch
    blocks = -(-N // 16)
    parts = lib.to_device(np.full(2 * blocks + 5, np.nan, np.float32))     # packed [M, blocks], then poison
    xd = lib.to_device(x, "bfloat16")
    lib.launch_record(rec, {"a": lib.to_device(a, "bfloat16"), "w": to_dev_fp8(lib, q), "w.scale": lib.to_device(s),
                            "x": xd, fp8_build.NORM_PARTIALS: parts})
    got = xd.numpy().astype(np.float32)
    want = bf(x + bf(numpy_ops.linear_w8a16(a, fp8.dequantize(q, s, scheme))))
    ref = x.astype(np.float64) + ref_linear(a, q, s, scheme)
    assert rel_err(got, want) <= 1e-2 and rel_err(got, ref) <= 1e-2
    assert np.mean(got == want) >= 0.99                           # the same bf16 roundings as linear + add
    p = parts.numpy()
    np.testing.assert_allclose(p[:M * blocks].reshape(M, blocks), parts_of(got), rtol=1e-5)
    assert np.isnan(p[M * blocks:]).all()                         # nothing beyond its rows' blocks


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M,N,K,gate", [(1, 6144, 4096, False), (2, 1000, 576, False), (1, 24576, 4096, True),
                                        (2, 1000, 256, True)])
def test_norm_gemv_reads_the_residual_normed(lib, rng, scheme, M, N, K, gate):
    q, s = make_weight(rng, N, K, scheme)
    x = bf(rng.standard_normal((M, K), dtype=np.float32) * 3)
    nw = bf(rng.uniform(0.5, 1.5, K).astype(np.float32))
    parts = np.zeros((2, K // 16), np.float32)
    parts[:M] = parts_of(x)
    op = Linear(rows=M, n=N, k=K, inp="h", weight="w", bias=None, out="y", weight_scale="w.scale", quant=scheme)
    nrm = AddRmsNorm(residual="x", delta="o", weight="nw", out="h", rows=M, eps=EPS)
    (rec,) = fp8_build.plan_fp8_linear(op, "bfloat16", "y" if gate else None, None, fold=("norm", nrm)).launch
    width = N // 2 if gate else N
    out = lib.empty((M, width), "bfloat16")                       # poisoned
    lib.launch_record(rec, {"x": lib.to_device(x, "bfloat16"), "nw": lib.to_device(nw, "bfloat16"),
                            fp8_build.NORM_PARTIALS: lib.to_device(parts), "w": to_dev_fp8(lib, q),
                            "w.scale": lib.to_device(s), "y": out})
    check_normed_output(out.numpy(), x, nw, gate, lambda h: bf(numpy_ops.linear_w8a16(h, fp8.dequantize(q, s, scheme))),
                        lambda h: ref_linear(h, q, s, scheme))


def check_normed_output(got, x, nw, gate, linear, reference):
    """A `_norm` GEMV's output (gate: fused with silu_mul) against NumPy, rmsnorm(x, nw) in bf16 -> linear(h) ->
    silu_mul of its bf16 rows, and against float64, reference(h) -> silu_mul_ref."""
    h = bf(numpy_ops.rmsnorm(x, nw, EPS))
    want, ref = linear(h), reference(h)
    if gate:
        want, ref = numpy_ops.silu_mul(bf(want)), silu_mul_ref(ref)
    assert rel_err(got, want) <= 1e-2 and rel_err(got, ref) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M", [1, 2])
def test_folded_pair_equals_linear_add_rmsnorm_linear(lib, rng, scheme, M):
    """o_proj -> add_rmsnorm -> gate_up (Qwen3-8B shapes) folded against the three unfused kernels: the residual
    bit for bit, the output within the float32 sum-of-squares order (one bf16 ulp of h where inv lands differently:
    a row's worth of outputs may move; seed 2434638923 moved 3.9% at 2 rows)."""
    H, Q, inter = 4096, 4096, 12288
    q1, s1 = make_weight(rng, H, Q, scheme)
    q2, s2 = make_weight(rng, 2 * inter, H, scheme)
    a = bf(rng.standard_normal((M, Q), dtype=np.float32))
    x = bf(rng.standard_normal((M, H), dtype=np.float32))
    nw = bf(rng.uniform(0.5, 1.5, H).astype(np.float32))
    o_proj = Linear(rows=M, n=H, k=Q, inp="a", weight="w1", bias=None, out="o", weight_scale="w1.scale", quant=scheme)
    nrm = AddRmsNorm(residual="x", delta="o", weight="nw", out="h", rows=M, eps=EPS)
    gate_up = Linear(rows=M, n=2 * inter, k=H, inp="h", weight="w2", bias=None, out="gu", weight_scale="w2.scale",
                     quant=scheme)
    common = {"a": lib.to_device(a, "bfloat16"), "nw": lib.to_device(nw, "bfloat16"), "w1": to_dev_fp8(lib, q1),
              "w1.scale": lib.to_device(s1), "w2": to_dev_fp8(lib, q2), "w2.scale": lib.to_device(s2)}

    def run(choices):
        bufs = {**common, "x": lib.to_device(x, "bfloat16"), "o": lib.empty((M, H), "bfloat16"),
                "h": lib.empty((M, H), "bfloat16"), "act": lib.empty((M, inter), "bfloat16"),
                fp8_build.NORM_PARTIALS: lib.to_device(np.full((2, H // 16), np.nan, np.float32))}
        for c in choices:
            for rec in c.launch:
                lib.launch_record(rec, bufs)
        return bufs["x"].numpy(), bufs["act"].numpy()

    x_un, act_un = run([fp8_build.plan_fp8_linear(o_proj, "bfloat16", None, None), norm_launch(nrm, H),
                        fp8_build.plan_fp8_linear(gate_up, "bfloat16", "act", None)])
    x_f, act_f = run([fp8_build.plan_fp8_linear(o_proj, "bfloat16", None, None, fold=("res", nrm)),
                      fp8_build.plan_fp8_linear(gate_up, "bfloat16", "act", None, fold=("norm", nrm))])
    np.testing.assert_array_equal(x_f.view(np.uint16), x_un.view(np.uint16))
    assert rel_err(act_f, act_un) <= 1e-3 and np.mean(act_f == act_un) >= 0.8


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["channel", "block128"])
def test_folded_plan_matches_the_unfolded_plan_and_numpy(tmp_path, scheme, seed):
    """A tiny FP8 plan with and without fold_norm (same dummy weights): graph == eager bit for bit, the prefill
    (no fold) bit-equal, decode logits within 1e-3 of the unfolded plan and AFTER_W8A8_TOL of NumPy."""
    from tests.test_cuda_runner import forced_logits, plan_logits
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    from xserv_aot.runtime.select import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    (tmp_path / "f").mkdir(), (tmp_path / "p").mkdir()
    folded = compile_fp8_tiny(tmp_path / "f", fp8_scheme=scheme, fold_norm=True)
    plain = compile_fp8_tiny(tmp_path / "p", fp8_scheme=scheme)
    rng = np.random.default_rng(seed)
    prompt, forced = rng.integers(3, 1024, 40).tolist(), rng.integers(3, 1024, 8).tolist()
    graph, eager = plan_logits(folded, prompt, forced, eager=True)
    np.testing.assert_array_equal(graph.view(np.uint32), eager.view(np.uint32))
    base = plan_logits(plain, prompt, forced)
    np.testing.assert_array_equal(graph[0].view(np.uint32), base[0].view(np.uint32))
    assert max(rel_err(g, b) for g, b in zip(graph[1:], base[1:])) <= 1e-3
    want = forced_logits(NumpyRunner(folded), prompt, forced)
    assert max(rel_err(g, w) for g, w in zip(graph[1:], want[1:])) <= AFTER_W8A8_TOL

"""The add_rmsnorm folded into the tensor-core GEMVs around it (build settings gemv "tc" + fold_norm,
plan/norm_fold.folds_norm, kernels/gemv_tc.cu RES / NORM), bf16 and W8A16 FP8: the plan's routing (CPU), each kernel
against NumPy and float64 on fresh inputs with poisoned outputs, the pair against the unfused kernels, and whole
plans (GPU)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import bf, lib, rng  # noqa: F401  (fixtures)
from tests.test_cuda_fp8 import AFTER_W8A8_TOL, compile_fp8_tiny, rel_err
from tests.test_cuda_fp8_fold import check_normed_output
from tests.test_cuda_gemv_tc import WEIGHTS, device_weight, lin, numpy_linear, weight
from xserv_aot.plan import fp8_build, norm_fold
from xserv_aot.plan.gemv_tc_plan import gemv_tc_fits, plan_gemv_tc
from xserv_aot.plan.elementwise_plan import norm_launch
from xserv_aot.plan.op_records import AddRmsNorm, Linear, SiluMul

EPS = 1e-6


def nrm(rows=1):
    return AddRmsNorm(residual="r", delta="o", weight="nw", out="h", rows=rows, eps=EPS)


def test_tc_folds_between_two_tc_gemvs_of_one_row():
    """gemv "tc": bf16 and W8A16 linears of TC_FOLD_MAX_ROWS (1) rows fold (bias too), the gate pair only where its
    halves fit the kernel; W8A8, more rows and a delta read later do not."""
    def ops(rows=1, quant=None, gate_n=64, **kw):
        o = Linear(rows=rows, n=64, k=64, inp="a", weight="w1", bias=kw.get("bias"), out="o",
                   weight_scale=quant and "s1", quant=quant, inp_scale=kw.get("inp_scale"))
        gu = Linear(rows=rows, n=gate_n, k=64, inp="h", weight="w2", bias=None, out="gu", weight_scale=quant and "s2",
                    quant=quant)
        return [o, nrm(rows), gu, SiluMul(inp="gu", out="act", rows=rows, inter=gate_n // 2)]
    assert norm_fold.TC_FOLD_MAX_ROWS == 1
    for quant in (None, "fp8_channel", "fp8_block128"):
        assert norm_fold.folded_norms(ops(1, quant), True, "tc") == {1}
        assert not norm_fold.folded_norms(ops(1, quant), False, "tc")
        assert not norm_fold.folded_norms(ops(2, quant), True, "tc")
    assert norm_fold.folded_norms(ops(bias="b"), True, "tc") == {1}
    assert not norm_fold.folded_norms(ops(gate_n=72), True, "tc")                   # I = 36: not whole 8-row tiles
    assert not norm_fold.folded_norms(ops(1, None), True, "cuda_cores")             # bf16: the tc kernels only
    assert not norm_fold.folded_norms(ops(1, "fp8_channel", inp_scale="xs"), True, "tc")
    later = ops() + [Linear(rows=1, n=64, k=64, inp="o", weight="w3", bias=None, out="z")]
    assert not norm_fold.folded_norms(later, True, "tc")


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_tc_fold_routes_every_norm_between_gemvs(tmp_path, quantization):
    """Compile (no GPU): in decode_1 every add_rmsnorm but the final one (a gather_rows before the lm_head)
    launches nothing, the linear before adds into x (`_res`), the one after reads x (`_norm_*`); no NORM_PARTIALS;
    the other buckets unchanged."""
    plan = compile_fp8_tiny(tmp_path, fp8_scheme="block128", quantization=quantization, gemv="tc", fold_norm=True)
    name = "gemv_fp8_tc_blk" if quantization == "fp8" else "gemv_tc"
    assert fp8_build.NORM_PARTIALS not in plan.arena
    for bk in plan.buckets:
        ops = bk.ops
        folded = [i for i, op in enumerate(ops) if op.cuda.kernel == "fused_into_neighbours"]
        if bk.num_tokens > norm_fold.TC_FOLD_MAX_ROWS:
            assert not folded
            continue
        norms = [i for i, op in enumerate(ops) if op.op == "add_rmsnorm"]
        assert folded == norms[:-1] and len(folded) == 3            # 2 layers: post-attention x 2, input of layer 1
        for i in folded:
            before, after = ops[i - 1].cuda.launch[0], ops[i + 1].cuda.launch[0]
            assert before.fn == f"{name}_res" and ops[i - 1].cuda.fused_residual == "x" and before.pdl
            assert before.args[-5] == ("ptr", "x")
            assert after.fn == f"{name}_norm_{'gate' if ops[i + 2].op == 'silu_mul' else 'bf16'}", after.fn
            assert after.args[:3] == (("ptr", "x"), ("ptr", ops[i].weight), ("f32", EPS)) and after.pdl


@pytest.mark.gpu
@pytest.mark.parametrize("wt", WEIGHTS)
@pytest.mark.parametrize("M,N,K,bias", [(1, 4096, 4096, False), (2, 4096, 12288, True), (8, 1000, 576, False),
                                        (3, 264, 256, True)])
def test_res_gemv_adds_into_the_residual(lib, rng, wt, M, N, K, bias):
    w, s, ref_of = weight(rng, N, K, wt)
    a = bf(rng.standard_normal((M, K), dtype=np.float32))
    r = bf(rng.standard_normal((M, N), dtype=np.float32))
    b = bf(rng.standard_normal(N)) if bias else None
    op = lin(M, N, K, wt, bias, out="o")
    (rec,) = plan_gemv_tc(op, "bfloat16", None, ("res", nrm(M))).launch
    rd = lib.to_device(r, "bfloat16")
    lib.launch_record(rec, {"x": lib.to_device(a, "bfloat16"), **device_weight(lib, w, s, wt), "r": rd,
                            "b": lib.to_device(b, "bfloat16") if bias else None})
    got = rd.numpy().astype(np.float32)
    want = bf(r + bf(numpy_linear(a, w, s, wt, b)))
    ref = r.astype(np.float64) + ref_of(a) + (0 if b is None else b.astype(np.float64))
    assert rel_err(got, want) <= 1e-2 and rel_err(got, ref) <= 1e-2
    assert np.mean(got == want) >= 0.99                           # the same bf16 roundings as linear + add


@pytest.mark.gpu
@pytest.mark.parametrize("wt", WEIGHTS)
@pytest.mark.parametrize("M,N,K,gate", [(1, 6144, 4096, False), (2, 1000, 576, False), (8, 24576, 4096, True),
                                        (3, 1008, 256, True), (5, 1002, 640, False), (1, 4096, 12288, False)])
def test_norm_gemv_reads_the_residual_normed(lib, rng, wt, M, N, K, gate):
    w, s, ref_of = weight(rng, N, K, wt)
    x = bf(rng.standard_normal((M, K), dtype=np.float32) * 3)
    nw = bf(rng.uniform(0.5, 1.5, K).astype(np.float32))
    assert gemv_tc_fits(lin(M, N, K, wt), gate)            # a gate's 8 up rows in one 128-row scale block: I % 8 == 0
    (rec,) = plan_gemv_tc(lin(M, N, K, wt), "bfloat16", "out" if gate else None, ("norm", nrm(M))).launch
    width = N // 2 if gate else N
    out = lib.empty((M, width), "bfloat16")                                           # poisoned
    lib.launch_record(rec, {"r": lib.to_device(x, "bfloat16"), "nw": lib.to_device(nw, "bfloat16"),
                            **device_weight(lib, w, s, wt), "out": out})
    check_normed_output(out.numpy(), x, nw, gate, lambda h: numpy_linear(h, w, s, wt), ref_of)


@pytest.mark.gpu
@pytest.mark.parametrize("wt", WEIGHTS)
@pytest.mark.parametrize("M", [1, 2, 8])
def test_folded_pair_equals_linear_add_rmsnorm_linear(lib, rng, wt, M):
    """o_proj -> add_rmsnorm -> gate_up (Qwen3-8B shapes) folded against the three unfused kernels: the residual
    bit for bit, the output within the float32 sum-of-squares order (one bf16 ulp of h where inv lands differently:
    a row's worth of outputs may move, 1/8 of them at 8 rows)."""
    H, Q, inter = 4096, 4096, 12288
    w1, s1, _ = weight(rng, H, Q, wt)
    w2, s2, _ = weight(rng, 2 * inter, H, wt)
    a = bf(rng.standard_normal((M, Q), dtype=np.float32))
    x = bf(rng.standard_normal((M, H), dtype=np.float32))
    nw = bf(rng.uniform(0.5, 1.5, H).astype(np.float32))
    quant = None if wt == "bfloat16" else wt
    o_proj = Linear(rows=M, n=H, k=Q, inp="a", weight="w1", bias=None, out="o", weight_scale=quant and "w1.scale",
                    quant=quant)
    norm = AddRmsNorm(residual="x", delta="o", weight="nw", out="h", rows=M, eps=EPS)
    gate_up = Linear(rows=M, n=2 * inter, k=H, inp="h", weight="w2", bias=None, out="gu",
                     weight_scale=quant and "w2.scale", quant=quant)
    d1, d2 = device_weight(lib, w1, s1, wt), device_weight(lib, w2, s2, wt)
    common = {"a": lib.to_device(a, "bfloat16"), "nw": lib.to_device(nw, "bfloat16"), "w1": d1["w"],
              "w2": d2["w"], "w1.scale": d1.get("w.scale"), "w2.scale": d2.get("w.scale")}

    def run(choices):
        bufs = {**common, "x": lib.to_device(x, "bfloat16"), "o": lib.empty((M, H), "bfloat16"),
                "h": lib.empty((M, H), "bfloat16"), "act": lib.empty((M, inter), "bfloat16")}
        for c in choices:
            for rec in c.launch:
                lib.launch_record(rec, bufs)
        return bufs["x"].numpy(), bufs["act"].numpy()

    x_un, act_un = run([plan_gemv_tc(o_proj, "bfloat16", None), norm_launch(norm, H),
                        plan_gemv_tc(gate_up, "bfloat16", "act")])
    x_f, act_f = run([plan_gemv_tc(o_proj, "bfloat16", None, ("res", norm)),
                      plan_gemv_tc(gate_up, "bfloat16", "act", ("norm", norm))])
    np.testing.assert_array_equal(x_f.view(np.uint16), x_un.view(np.uint16))
    assert rel_err(act_f, act_un) <= 1e-3 and np.mean(act_f == act_un) >= 0.8


@pytest.mark.gpu
@pytest.mark.parametrize("wt", WEIGHTS)
def test_folded_tc_plan_matches_the_unfolded_plan_and_numpy(tmp_path, wt, seed):
    """A tiny gemv "tc" plan with and without fold_norm (same dummy weights): graph == eager bit for bit, the
    prefill (no fold) bit-equal, decode logits within 1e-3 of the unfolded plan's and AFTER_W8A8_TOL of NumPy's."""
    from tests.test_cuda_runner import forced_logits, plan_logits
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    from xserv_aot.runtime.select import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    (tmp_path / "f").mkdir(), (tmp_path / "p").mkdir()
    build = dict(quantization="none") if wt == "bfloat16" else dict(fp8_scheme=wt.removeprefix("fp8_"))
    folded = compile_fp8_tiny(tmp_path / "f", gemv="tc", fold_norm=True, **build)
    plain = compile_fp8_tiny(tmp_path / "p", gemv="tc", **build)
    rng = np.random.default_rng(seed)
    prompt, forced = rng.integers(3, 1024, 40).tolist(), rng.integers(3, 1024, 8).tolist()
    graph, eager = plan_logits(folded, prompt, forced, eager=True)
    np.testing.assert_array_equal(graph.view(np.uint32), eager.view(np.uint32))
    base = plan_logits(plain, prompt, forced)
    np.testing.assert_array_equal(graph[0].view(np.uint32), base[0].view(np.uint32))
    assert max(rel_err(g, b) for g, b in zip(graph[1:], base[1:])) <= 1e-3
    want = forced_logits(NumpyRunner(folded), prompt, forced)
    assert max(rel_err(g, w) for g, w in zip(graph[1:], want[1:])) <= AFTER_W8A8_TOL

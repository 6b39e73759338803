"""fp8_scale "refit": plan/scale_refit.py's least-squares scales against independent float64 references (a
brute-force scan per row; numpy lstsq on the explicit design matrix per 128-row block), its fallbacks, and the
compile (manifest record, scales that lower the calibration output error, plans that run), refusals."""
from __future__ import annotations

import numpy as np
import pytest

from tests.test_fp8_gptq import BUILD, e4m3, one_line, problem, qwen3_with_tokenizer
from tests.test_fp8_compile import plan_tensor
from xserv_aot import fp8
from xserv_aot.config import BuildConfig, ConfigError
from xserv_aot.plan import fp8_calibrate, gptq
from xserv_aot.plan.builder import compile_plan
from xserv_aot.plan.scale_refit import refit_scales
from xserv_aot.runtime.numpy_backend import NumpyRunner
from xserv_aot.runtime.session import Session


def h_error(w, q, s_full, h):
    e = np.asarray(w, np.float64) - np.asarray(q, np.float64) * np.asarray(s_full, np.float64)
    return float(np.einsum("nk,nk->", e @ h, e))


def codes(w, scheme):
    return fp8.quantize_weight(w, scheme)


def test_channel_refit_is_the_minimum_of_a_scan(seed):
    rng = np.random.default_rng(seed)
    w, x = problem(rng, 12, 64)
    h = x.T.astype(np.float64) @ x
    q, s = codes(w, fp8.CHANNEL)
    got = refit_scales(w, q, h, fp8.CHANNEL, s)
    assert got.dtype == np.float32 and got.shape == s.shape
    for n in range(len(w)):
        grid = np.float64(s[n]) * np.linspace(0.9, 1.1, 20001)
        e = w[n].astype(np.float64)[None, :] - grid[:, None] * q[n].astype(np.float64)[None, :]
        errs = np.einsum("gk,kl,gl->g", e, h, e)
        best = grid[np.argmin(errs)]
        assert abs(got[n] - best) <= 2 * (grid[1] - grid[0]) + 1e-6 * best, (seed, n, got[n], best)
        mine = h_error(w[n:n + 1], q[n:n + 1], np.float64(got[n]), h)
        assert mine <= errs.min() * (1 + 1e-6), (seed, n, mine, errs.min())


def block_reference(w, q, h, s):
    """Per 128-row block: lstsq over the stacked rows L^T q_n restricted to each column block (H = L L^T)."""
    n, k = w.shape
    lt = np.linalg.cholesky(h).T
    g = -(-k // 128)
    out = np.array(s, np.float64)
    for rb in range(-(-n // 128)):
        rows = range(rb * 128, min(n, rb * 128 + 128))
        design = np.zeros((len(rows) * k, g))
        target = np.zeros(len(rows) * k)
        for i, r in enumerate(rows):
            for c in range(g):
                part = np.zeros(k)
                part[c * 128:(c + 1) * 128] = q[r, c * 128:(c + 1) * 128]
                design[i * k:(i + 1) * k, c] = lt @ part
            target[i * k:(i + 1) * k] = lt @ w[r].astype(np.float64)
        out[rb] = np.linalg.lstsq(design, target, rcond=None)[0]
    return out


def test_block_refit_matches_lstsq_reference(seed):
    rng = np.random.default_rng(seed)
    w, x = problem(rng, 150, 200, t=400)                          # partial tiles in both directions
    h = x.T.astype(np.float64) @ x
    q, s = codes(w, fp8.BLOCK128)
    got = refit_scales(w, q, h, fp8.BLOCK128, s)
    want = block_reference(w, q, h, s)
    np.testing.assert_allclose(got, want, rtol=2e-5, err_msg=f"seed {seed}")
    per = fp8.expand_scale(got, fp8.BLOCK128, *w.shape)
    before = h_error(w, q, fp8.expand_scale(s, fp8.BLOCK128, *w.shape), h)
    assert h_error(w, q, per, h) <= before, seed
    for _ in range(5):                                             # a local minimum in every direction
        nudged = got * (1 + 1e-3 * rng.standard_normal(got.shape)).astype(np.float32)
        assert h_error(w, q, fp8.expand_scale(nudged, fp8.BLOCK128, *w.shape), h) >= h_error(w, q, per, h)


def test_refit_keeps_undetermined_scales(seed):
    rng = np.random.default_rng(seed)
    w, x = problem(rng, 140, 136)
    w[3] = 0                                                      # a dead row: zero codes
    w[128:, 128:] = 0                                             # a dead block
    h = x.T.astype(np.float64) @ x
    for scheme in fp8.SCHEMES:
        q, s = codes(w, scheme)
        fallback = np.full_like(s, 0.125)
        got = refit_scales(w, q, h, scheme, fallback)
        assert np.isfinite(got).all() and (got > 0).all()
        if scheme == fp8.CHANNEL:
            assert got[3] == 0.125 and (got[np.arange(140) != 3] != 0.125).all()
        else:
            assert got[1, 1] == 0.125 and (got[:, 0] != 0.125).all()


@pytest.mark.parametrize("scheme", fp8.SCHEMES)
def test_refit_after_gptq_lowers_output_error(seed, scheme):
    rng = np.random.default_rng(seed)
    w, x = problem(rng, 130, 160, t=512)
    x[:, 7] *= 30                                                 # one outlier input, as real activations have
    h = fp8_calibrate.hessian([x])
    s = codes(w, scheme)[1]
    q = gptq.gptq_round(w, fp8.expand_scale(s, scheme, *w.shape), h)
    got = refit_scales(w, q, h, scheme, s)
    assert h_error(w, q, fp8.expand_scale(got, scheme, *w.shape), h) < h_error(
        w, q, fp8.expand_scale(s, scheme, *w.shape), h), seed
    assert np.array_equal(e4m3(q), q)


@pytest.mark.parametrize("rounding,scheme", [("nearest", "auto"), ("gptq", "auto"), ("nearest", "block128")])
def test_refit_compile(tmp_path, seed, rounding, scheme):
    """Each FP8 linear's scales refitted to its plan values on the calibration inputs; the plan runs."""
    hf = qwen3_with_tokenizer(tmp_path, seed)
    build = dict(BUILD, fp8_rounding=rounding, fp8_scheme=scheme)
    plan = compile_plan(hf, tmp_path / "p", BuildConfig(**build, fp8_scale="refit"))
    amax = compile_plan(hf, tmp_path / "a", BuildConfig(**build))
    assert set(plan.fp8_schemes.values()) == {fp8.BLOCK128 if scheme == "block128" else fp8.CHANNEL}
    record = plan.quantization
    assert record["scale"] == "refit" and record["rounding"]["method"] == rounding
    assert record["rounding"]["refit"]["rounds"] == fp8_calibrate.REFIT_ROUNDS[rounding]
    assert record["rounding"]["calibration"]["tokens"] > 0
    for name in plan.fp8_schemes:
        s, s0 = plan_tensor(plan, name + ".scale"), plan_tensor(amax, name + ".scale")
        assert s.shape == s0.shape and (s > 0).all() and not np.array_equal(s, s0), name
        q = plan_tensor(plan, name)
        assert np.array_equal(e4m3(q), q) and np.abs(q).max() <= 448
    _, a = Session(NumpyRunner(plan), num_seqs=1).prefill(0, [1, 5, 9, 13, 17])
    _, b = Session(NumpyRunner(amax), num_seqs=1).prefill(0, [1, 5, 9, 13, 17])
    assert np.isfinite(a).all() and np.linalg.norm(a - b) < 0.2 * np.linalg.norm(b)


def test_refit_refusals(tmp_path, seed):
    from tests.tiny_models import make_tiny_model
    hf = make_tiny_model(tmp_path / "hf", "qwen3", seed=seed)
    with pytest.raises(ConfigError) as e:
        compile_plan(hf, tmp_path / "p", BuildConfig(**BUILD, fp8_scale="refit"), dummy_weights=True)
    one_line(e, "--dummy-weights")
    with pytest.raises(ConfigError) as e:
        compile_plan(hf, tmp_path / "p", BuildConfig(**BUILD, fp8_scale="refit"))
    one_line(e, "tokenizer")
    with pytest.raises(ConfigError) as e:
        BuildConfig(**{**BUILD, "quantization": "none"}, fp8_scale="refit").validate()
    one_line(e, "quantization fp8")
    for bad in (-1, 2):
        with pytest.raises(ConfigError) as e:
            BuildConfig(**BUILD, fp8_refit_rounds=bad, fp8_scale="refit" if bad < 0 else "amax").validate()
        one_line(e, f"fp8_refit_rounds {bad}", "fp8_scale refit")
    assert not (tmp_path / "p").exists()


def test_refit_rounds_setting(tmp_path, seed):
    """fp8_refit_rounds 2 with nearest: round at amax, refit, round again at that scale, refit (the plan's scales
    are the second refit of the values rounded at the first), recorded in the manifest."""
    from xserv_aot.tokenizer import Tokenizer
    hf = qwen3_with_tokenizer(tmp_path, seed)
    plan = compile_plan(hf, tmp_path / "p", BuildConfig(**BUILD, fp8_scale="refit", fp8_refit_rounds=2))
    assert plan.quantization["rounding"]["refit"] == {"rounds": 2}
    from safetensors.numpy import load_file
    from tests.test_fp8_compile import LINEARS
    sd = load_file(hf / "model.safetensors")
    src = np.concatenate([sd[f"model.layers.0.{p}.weight"] for p in LINEARS["qkv"]]).astype(np.float32)
    tok = Tokenizer.from_dir(hf)
    from xserv_aot.plan import calibration_text
    from xserv_aot.runtime import numpy_ops as ops
    xs = [ops.rmsnorm(ops.embedding(np.asarray(tok.encode(t)), sd["model.embed_tokens.weight"].astype(np.float32)),
                      sd["model.layers.0.input_layernorm.weight"].astype(np.float32), 1e-6)
          for t in calibration_text.TEXTS]
    h = fp8_calibrate.hessian(xs)
    scheme = plan.fp8_schemes["layers.0.qkv"]
    q, s = codes(src, scheme)
    s1 = refit_scales(src, q, h, scheme, s)
    q1 = fp8.quantize_weight(src, scheme, s1)[0]
    s2 = refit_scales(src, q1, h, scheme, s1)
    np.testing.assert_array_equal(plan_tensor(plan, "layers.0.qkv"), q1)
    np.testing.assert_allclose(plan_tensor(plan, "layers.0.qkv.scale"), s2, rtol=1e-5)

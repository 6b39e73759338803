"""fp8_rounding "gptq": plan/gptq.py against a plain float64 optimal-brain-surgeon reference written here, its
output error on the calibration inputs against round-to-nearest, the calibration forward against the NumPy
backend, compiles from an HF dir and a GGUF (manifest record, scales, e4m3 grid, plans that run), refusals."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from tests.conftest import ensure_qwen3_tokenizer
from tests.test_compile_checks import gguf_tensors
from tests.test_fp8_compile import plan_tensor
from tests.test_gguf import _write, gguf_meta, hf_to_gguf
from tests.test_gguf_tokenizer_llama3 import byte_alphabet
from tests.tiny_models import load_hf_model, make_tiny_model
from xserv_aot import fp8
from xserv_aot.config import BuildConfig, ConfigError
from xserv_aot.plan import calibration_text, fp8_calibrate, gptq
from xserv_aot.plan.builder import compile_plan
from xserv_aot.plan.manifest import Plan
from xserv_aot.runtime.numpy_backend import NumpyRunner
from xserv_aot.runtime.session import Session

BUILD = dict(max_num_seqs=2, decode_buckets=[1, 2], prefill_buckets=[16], max_seq_len=64, block_size=4,
             dtype="bfloat16", target="cpu", quantization="fp8")


def e4m3(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def obs_reference(w, scale, h, damp):
    """Columns in decreasing diag(H) order; after rounding column j, the remaining columns move by the OBS update
    -err_j / Hinv[j, j] * Hinv[j, :] and column j leaves the inverse Hessian (Schur complement), float64."""
    k = w.shape[1]
    order = np.argsort(-np.diag(h), kind="stable")
    hh = np.array(h, np.float64)[np.ix_(order, order)]
    d = np.diag(hh).copy()
    d[d == 0] = 1.0
    hh[np.diag_indices(k)] = d + damp * d.mean()
    hinv = np.linalg.inv(hh)
    w, s = np.array(w, np.float64)[:, order], np.asarray(scale, np.float64)[:, order]
    q = np.zeros_like(w)
    for j in range(k):
        q[:, j] = e4m3(np.clip(w[:, j].astype(np.float32) / s[:, j].astype(np.float32), -448, 448))
        err = w[:, j] - q[:, j] * s[:, j]
        w[:, j:] -= np.outer(err / hinv[j, j], hinv[j, j:])
        hinv = hinv - np.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    out = np.zeros_like(q)
    out[:, order] = q
    return out


def problem(rng, n, k, t=256, dead=0):
    """W [n, k] and correlated calibration inputs X [t, k] (dead: that many input columns always zero)."""
    x = rng.standard_normal((t, k)) @ (rng.standard_normal((k, k)) * 0.3 + np.eye(k))
    x[:, rng.choice(k, dead, replace=False)] = 0
    w = rng.standard_normal((n, k)) * rng.uniform(0.2, 2.0, size=(n, 1))
    return w.astype(np.float32), x.astype(np.float32)


def scales(w, scheme):
    _, s = fp8.quantize_weight(w, scheme)
    return s, fp8.expand_scale(s, scheme, *w.shape)


@pytest.mark.parametrize("scheme,n,k,dead", [(fp8.CHANNEL, 24, 80, 0), (fp8.CHANNEL, 16, 72, 5),
                                             (fp8.BLOCK128, 136, 160, 0)])
def test_gptq_matches_float64_obs_reference(seed, scheme, n, k, dead):
    rng = np.random.default_rng(seed)
    w, x = problem(rng, n, k, dead=dead)
    h = x.T.astype(np.float64) @ x
    _, per = scales(w, scheme)
    got = gptq.gptq_round(w, per, h, block=32)
    want = obs_reference(w, per, h, gptq.DAMP)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")


@pytest.mark.parametrize("scheme", [fp8.CHANNEL, fp8.BLOCK128])
def test_gptq_output_error_below_round_to_nearest(seed, scheme):
    rng = np.random.default_rng(seed)
    for trial in range(3):
        w, x = problem(rng, 160, 192, t=512)
        s, per = scales(w, scheme)
        q = gptq.gptq_round(w, per, fp8_calibrate.hessian([x[:200], x[200:]]))
        nearest, _ = fp8.quantize_weight(w, scheme)
        x64, w64 = x.astype(np.float64), w.astype(np.float64)
        err_gptq = np.linalg.norm(x64 @ (w64 - q * per).T)
        err_nearest = np.linalg.norm(x64 @ (w64 - nearest.astype(np.float64) * per).T)
        assert err_gptq < err_nearest, (seed, trial, err_gptq, err_nearest)
        assert np.array_equal(e4m3(q), q) and np.abs(q).max() <= 448               # on the e4m3 grid
        assert not np.array_equal(q, nearest)


def test_gptq_with_diagonal_hessian_is_round_to_nearest(seed):
    rng = np.random.default_rng(seed)
    w, x = problem(rng, 32, 96)
    _, per = scales(w, fp8.CHANNEL)
    h = np.diag(rng.uniform(0.5, 2.0, 96))
    np.testing.assert_array_equal(gptq.gptq_round(w, per, h), fp8.quantize_weight(w, fp8.CHANNEL)[0])


def float32_build():
    return BuildConfig(**{**BUILD, "quantization": "none", "dtype": "float32", "prefill_buckets": [32]})


def test_calibration_forward_matches_numpy_backend(tmp_path, seed):
    """The calibration forward (fp8_calibrate.layer_forward) gives the float32 plan's prefill logits."""
    rng = np.random.default_rng(seed)
    hf = make_tiny_model(tmp_path / "hf", "qwen3", seed=int(rng.integers(1 << 30)))
    plan = compile_plan(hf, tmp_path / "plan", float32_build())
    ids = [int(i) for i in rng.integers(0, 256, 20)]
    _, logits = Session(NumpyRunner(plan), num_seqs=1).prefill(0, ids)
    w = {name: plan_tensor(plan, name).astype(np.float32) for name in plan.weights}
    m = plan.model
    xs = [w["embed_tokens"][ids]]
    for li in range(m.num_layers):
        lw = {k.split(".")[2]: v for k, v in w.items() if k.startswith(f"layers.{li}.")}
        xs = fp8_calibrate.layer_forward(m, lw, xs, w["rope_cos"], w["rope_sin"], lambda kind, a, inp: a)
    final = xs[0][-1:] / np.sqrt((xs[0][-1:] ** 2).mean() + m.rms_norm_eps) * w["final_norm"]
    want = final @ w["lm_head"].T
    np.testing.assert_allclose(np.asarray(logits).ravel(), want.ravel(), rtol=1e-4, atol=1e-4 * np.abs(want).max())


def qwen3_with_tokenizer(tmp_path, seed, **kw):
    import shutil
    tok = ensure_qwen3_tokenizer()
    hf = make_tiny_model(tmp_path / "hf", "qwen3", seed=seed, vocab_size=151936, bos_token_id=151643,
                         eos_token_id=151645, **kw)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, hf / f)
    return hf


def check_gptq_plan(plan: Plan, nearest: Plan, num_tokens: int, unquantized: Plan):
    q = plan.quantization
    assert q["rounding"] == {"method": "gptq", "damp": gptq.DAMP, "block": gptq.BLOCK, "act_order": True,
                             "sequential": True, "calibration": {"texts": len(calibration_text.TEXTS),
                                                                 "tokens": num_tokens,
                                                                 "sha256": calibration_text.digest()}}
    assert nearest.quantization["rounding"] == {"method": "nearest"} and plan.fp8_schemes == nearest.fp8_schemes
    assert q["scale"] == nearest.quantization["scale"] == "amax"
    changed = 0
    for name in plan.fp8_schemes:
        got, ref = plan_tensor(plan, name), plan_tensor(nearest, name)
        np.testing.assert_array_equal(plan_tensor(plan, name + ".scale"), plan_tensor(nearest, name + ".scale"))
        assert np.abs(got).max() <= 448
        changed += not np.array_equal(got, ref)
    assert changed == len(plan.fp8_schemes)
    for name in plan.weights:                                      # everything else is the same
        if name not in plan.fp8_schemes and not name.endswith(".scale"):
            np.testing.assert_array_equal(plan_tensor(plan, name), plan_tensor(nearest, name), err_msg=name)
    # GPTQ moves the logits from nearest rounding's by at most a few times nearest's own FP8 error against the
    # unquantized plan (tiny random models, 13 seeds: 0.9 - 1.9x; a fixed 20% of the logits failed 1 seed in 25,
    # where nearest's error alone was 16%)
    a, b, f = (Session(NumpyRunner(p), num_seqs=1).prefill(0, [1, 5, 9, 13, 17])[1]
               for p in (plan, nearest, unquantized))
    assert np.isfinite(a).all() and np.linalg.norm(a - b) < 3 * np.linalg.norm(b - f)


@pytest.mark.parametrize("tie,lm_head", [(False, False), (False, True), (True, True)])
def test_gptq_compile_from_hf_dir(tmp_path, seed, tie, lm_head):
    hf = qwen3_with_tokenizer(tmp_path, seed, tie=tie)
    build = dict(BUILD, quantize_lm_head=lm_head)
    plan = compile_plan(hf, tmp_path / "gptq", BuildConfig(**build, fp8_rounding="gptq"))
    nearest = compile_plan(hf, tmp_path / "nearest", BuildConfig(**build))
    from xserv_aot.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(hf)
    unquantized = compile_plan(hf, tmp_path / "unquantized", BuildConfig(**{**build, "quantization": "none"}))
    check_gptq_plan(plan, nearest, sum(len(tok.encode(t)) for t in calibration_text.TEXTS), unquantized)
    assert ("lm_head" in plan.fp8_schemes) == lm_head
    assert json.loads((plan.dir / "manifest.json").read_text())["build"]["fp8_rounding"] == "gptq"


def test_gptq_compile_from_gguf(tmp_path, seed):
    """A tiny llama GGUF with a byte-level vocabulary of its own (257 tokens)."""
    hf = make_tiny_model(tmp_path / "hf", "llama", seed=seed, vocab_size=257)
    path, _, _ = hf_to_gguf(hf, tmp_path / "m.gguf", "llama", half=False)
    tokens = byte_alphabet() + ["ab"]
    meta = {**gguf_meta("llama", load_hf_model(hf).config), "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.token_type": [1] * len(tokens)}
    gguf = _write(tmp_path / "t.gguf", "llama", meta, gguf_tensors(path))
    plan = compile_plan(gguf, tmp_path / "gptq", BuildConfig(**BUILD, fp8_rounding="gptq"))
    nearest = compile_plan(gguf, tmp_path / "nearest", BuildConfig(**BUILD))
    num = sum(len(t.encode()) for t in calibration_text.TEXTS) - sum(t.count("ab") for t in calibration_text.TEXTS)
    check_gptq_plan(plan, nearest, num, compile_plan(gguf, tmp_path / "unquantized",
                                                    BuildConfig(**{**BUILD, "quantization": "none"})))


def mse_reference(w, scheme):
    """Per row (channel) or 128 x 128 block (zero-padded): the scale max(alpha * amax, 1e-12) / 448 of the least
    squared error, alpha = 1, 0.99, ..., 0.5, the first on ties; float64 sums."""
    rows, cols = (1, w.shape[1]) if scheme == fp8.CHANNEL else (128, 128)
    nb, kb = -(-w.shape[0] // rows), -(-w.shape[1] // cols)
    out = np.zeros((nb, kb), np.float32)
    for i in range(nb):
        for j in range(kb):
            b = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            best = None
            for alpha in np.linspace(1.0, 0.5, 51):
                sc = np.float32(max(np.float32(alpha) * np.abs(b).max(), np.float32(1e-12))) / np.float32(448)
                err = ((e4m3(np.clip(b / sc, -448, 448)) * np.float64(sc) - b) ** 2).sum()
                if best is None or err < best[0]:
                    best = (err, sc)
            out[i, j] = best[1]
    return out[:, 0] if scheme == fp8.CHANNEL else out


# block128 at 520 x 392: 20 blocks (tails on both sides), so some block's best clip is below 1 for any seed (with the
# 4 blocks of 200 x 136 every block kept alpha 1 for ~7% of seeds)
@pytest.mark.parametrize("scheme,n,k", [(fp8.CHANNEL, 40, 96), (fp8.BLOCK128, 520, 392)])
def test_mse_scale_matches_reference_and_never_loses(seed, scheme, n, k):
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(3, size=(n, k)) * rng.uniform(0.01, 1.0, size=(n, 1))).astype(np.float32)
    s = fp8.mse_scale(w, scheme)
    np.testing.assert_array_equal(s, mse_reference(w, scheme), err_msg=f"seed {seed}")
    amax_q, amax_s = fp8.quantize_weight(w, scheme)
    q, s2 = fp8.quantize_weight(w, scheme, s)
    assert np.array_equal(s2, s) and np.array_equal(e4m3(q), q)
    err, amax_err = (np.linalg.norm(fp8.dequantize(a, b, scheme) - w) for a, b in ((q, s), (amax_q, amax_s)))
    assert err <= amax_err
    assert (s <= amax_s).all() and (s < amax_s).any()


def test_gptq_with_mse_scales_compiles(tmp_path, seed):
    """Scales are chosen from the checkpoint's weights before rounding: fp8.mse_scale of each source weight."""
    from safetensors.numpy import load_file
    from tests.test_fp8_compile import LINEARS
    hf = qwen3_with_tokenizer(tmp_path, seed)
    plan = compile_plan(hf, tmp_path / "p", BuildConfig(**BUILD, fp8_rounding="gptq", fp8_scale="mse"))
    assert plan.quantization["scale"] == "mse" and plan.quantization["rounding"]["method"] == "gptq"
    sd = load_file(hf / "model.safetensors")
    for li in range(2):
        for kind, parts in LINEARS.items():
            src = np.concatenate([sd[f"model.layers.{li}.{p}.weight"] for p in parts]).astype(np.float32)
            name = f"layers.{li}.{kind}"
            np.testing.assert_array_equal(plan_tensor(plan, name + ".scale"),
                                          fp8.mse_scale(src, plan.fp8_schemes[name]))


def one_line(exc, *parts):
    msg = str(exc.value)
    assert msg and "\n" not in msg and all(p in msg for p in parts), msg


def test_gptq_refusals(tmp_path, seed):
    hf = make_tiny_model(tmp_path / "hf", "qwen3", seed=seed)
    with pytest.raises(ConfigError) as e:
        compile_plan(hf, tmp_path / "p", BuildConfig(**BUILD, fp8_rounding="gptq"), dummy_weights=True)
    one_line(e, "--dummy-weights")
    with pytest.raises(ConfigError) as e:
        compile_plan(hf, tmp_path / "p", BuildConfig(**BUILD, fp8_rounding="gptq"))
    one_line(e, "tokenizer")
    with pytest.raises(ConfigError) as e:
        BuildConfig(**{**BUILD, "quantization": "none"}, fp8_rounding="gptq").validate()
    one_line(e, "quantization fp8")
    with pytest.raises(ConfigError) as e:
        BuildConfig(**BUILD, fp8_rounding="obs").validate()
    one_line(e, "fp8_rounding 'obs'", "nearest, gptq")
    with pytest.raises(ConfigError) as e:
        BuildConfig(**BUILD, fp8_scale="max").validate()
    one_line(e, "fp8_scale 'max'", "amax, mse")
    with pytest.raises(ConfigError) as e:
        BuildConfig(**{**BUILD, "quantization": "none"}, fp8_scale="mse").validate()
    one_line(e, "quantization fp8")
    with pytest.raises(ConfigError) as e:
        compile_plan(hf, tmp_path / "p", BuildConfig(**BUILD, fp8_scale="mse"), dummy_weights=True)
    one_line(e, "--dummy-weights")
    assert not (tmp_path / "p").exists()


def test_gptq_refuses_a_prequantized_checkpoint(tmp_path, seed):
    from tests.test_fp8_checkpoints import QWEN, make_fp8_checkpoint
    hf, _ = make_fp8_checkpoint(tmp_path, "block", QWEN, seed % (1 << 30))
    with pytest.raises(ConfigError) as e:
        compile_plan(hf, tmp_path / "p", BuildConfig(**BUILD, fp8_rounding="gptq"))
    one_line(e, "already stores", "FP8 weights")


def test_cli_fp8_rounding(tmp_path, seed):
    from typer.testing import CliRunner
    from xserv_aot.cli import app
    hf = make_tiny_model(tmp_path / "hf", "qwen3", seed=seed)
    r = CliRunner().invoke(app, ["compile", str(hf), "-o", str(tmp_path / "p"), "--target", "cpu", "--quantization",
                                 "fp8", "--fp8-rounding", "gptq", "--dummy-weights"])
    assert r.exit_code != 0 and "--dummy-weights" in r.output and not (tmp_path / "p").exists()
    r = CliRunner().invoke(app, ["compile", "--help"])
    assert "--fp8-rounding" in r.output

"""`compile --quantization fp8`: FP8 weights + scales in weights.bin, the manifest's quantization section, the
plan's logits against HF float32 on the NumPy backend (W8A16 decode, W8A8 prefill), dummy FP8 weights, refusals."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch

from tests.tiny_models import load_hf_model, make_tiny_model
from xserv_aot.config import BuildConfig, ConfigError
from xserv_aot.plan.builder import compile_plan
from xserv_aot.plan.manifest import Plan
from xserv_aot.runtime.numpy_backend import NumpyRunner
from xserv_aot.runtime.session import Session

BUILD = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[16, 80], max_seq_len=128, block_size=4,
             dtype="bfloat16", target="cpu", quantization="fp8")
TILED = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
LINEARS = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o_proj": ["self_attn.o_proj"],
           "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def plan_tensor(plan: Plan, name: str) -> np.ndarray:
    """A plan weight from weights.bin, decoded here (float64)."""
    info = plan.weights[name]
    raw = np.fromfile(plan.dir / "weights.bin", dtype=np.uint8)[info.offset:]
    if info.dtype == "float8_e4m3fn":
        return raw[:int(np.prod(info.shape))].view(ml_dtypes.float8_e4m3fn).astype(np.float64).reshape(info.shape)
    if info.dtype == "bfloat16":
        return raw[:2 * int(np.prod(info.shape))].view(ml_dtypes.bfloat16).astype(np.float64).reshape(info.shape)
    return raw[:4 * int(np.prod(info.shape))].view(np.float32).astype(np.float64).reshape(info.shape)


def dequantized(plan: Plan, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(W_real, per-element scale) of an FP8 plan weight."""
    w, s = plan_tensor(plan, name), plan_tensor(plan, name + ".scale")
    n, k = w.shape
    per = np.repeat(s[:, None], k, axis=1) if s.ndim == 1 else np.kron(s, np.ones((128, 128)))[:n, :k]
    return w * per, per


def hf_weights(model_dir, layer: int) -> dict[str, np.ndarray]:
    sd = load_hf_model(model_dir).state_dict()
    return {name: np.concatenate([sd[f"model.layers.{layer}.{p}.weight"].double().numpy() for p in parts])
            for name, parts in LINEARS.items()}


@pytest.mark.parametrize("dims,scheme", [(TILED, "fp8_block128"), ({}, "fp8_channel")], ids=["tiled", "untiled"])
def test_fp8_plan_weights_and_logits(tmp_path, seed, dims, scheme):
    rng = np.random.default_rng(seed)
    model_dir = make_tiny_model(tmp_path / "hf", "qwen3", seed=int(rng.integers(1 << 30)), dtype="bfloat16", **dims)
    plan = compile_plan(model_dir, tmp_path / "plan", BuildConfig(**BUILD))
    q = plan.manifest["quantization"]
    assert q["method"] == "fp8" and q["lm_head"] is False and q["from_checkpoint"] == []
    assert q["schemes"] == {f"layers.{li}.{n}": scheme for li in range(2) for n in LINEARS}    # "auto" by shape
    assert plan.weights["embed_tokens"].dtype == "bfloat16" and plan.weights["layers.0.input_norm"].dtype == "bfloat16"
    ref = hf_weights(model_dir, 1)
    for name, w in ref.items():
        real, per = dequantized(plan, f"layers.1.{name}")
        assert np.all(np.abs(real - w) <= np.abs(w) * 2.0 ** -4 + per * 2.0 ** -10)    # e4m3: 3 mantissa bits
        assert np.abs(real).max() > 0.5 * np.abs(w).max()                              # not all flushed to zero
    group = 128 if scheme == "fp8_block128" else None
    short = rng.integers(3, 256, size=10).tolist()                           # W8A16 only (every linear <= 64 rows)
    tokens, logits = Session(NumpyRunner(plan)).greedy(short, 4)
    with torch.no_grad():
        ref = fake_quant_hf(model_dir, plan, group, 0)(torch.tensor([short + tokens[:-1]])).logits[0]
    assert rel_err(logits, ref.double().numpy()[len(short) - 1:]) <= 3e-2               # bf16 activations alone

    prompt = rng.integers(3, 256, size=70).tolist()                          # one 80-row prefill: W8A8 linears
    assert any(op.op == "quantize_fp8" for op in plan.buckets[-1].ops)
    assert not any(op.op == "quantize_fp8" for b in plan.decode_buckets for op in b.ops)
    runner, first_qkv = NumpyRunner(plan), []
    run_linear = runner.ranks[0].op_linear
    runner.ranks[0].op_linear = lambda op: (run_linear(op), op.weight == "layers.0.qkv" and op.rows == 80 and
                                            first_qkv.append(runner.buf["qkv"][:len(prompt)].copy()))
    tokens, logits = Session(runner).greedy(prompt, 4)
    ref_model, proj = fake_quant_hf(model_dir, plan, group, len(prompt)), []
    hook = ref_model.model.layers[0].self_attn
    for m in (hook.q_proj, hook.k_proj, hook.v_proj):
        m.register_forward_hook(lambda mod, args, out: proj.append(out[0].double().numpy()))
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt + tokens[:-1]])).logits[0].double().numpy()[len(prompt) - 1:]
    assert rel_err(first_qkv[0], np.concatenate(proj, axis=1)[:len(prompt)]) <= 1e-2     # the first W8A8 linear
    # later W8A8 inputs differ from the reference's by bf16 / summation order (~1%), which e4m3 rounding turns
    # into sqrt(1% * 2^-4) ~ 2.5% per linear: only a loose end-to-end bound is meaningful here
    assert rel_err(logits, ref) <= 0.2


def fake_quant_hf(model_dir, plan: Plan, group: int | None, quant_rows: int):
    """HF float32 with the plan's dequantized FP8 weights, and each layer linear's input rows < quant_rows (the W8A8
    prefill rows) replaced by their per-row, per-group e4m3 fake quantization (torch's float8_e4m3fn)."""
    model = load_hf_model(model_dir)
    sd = model.state_dict()
    with torch.no_grad():
        for li in range(plan.model.num_layers):
            for name, parts in LINEARS.items():
                real, off = dequantized(plan, f"layers.{li}.{name}")[0], 0
                for p in parts:
                    t = sd[f"model.layers.{li}.{p}.weight"]
                    t.copy_(torch.tensor(real[off:off + t.shape[0]]))
                    off += t.shape[0]

    def hook(_, args):
        x = args[0].clone()
        rows = x[0, :quant_rows]
        rows[:] = rows.to(torch.bfloat16).to(torch.float32)                         # the plan's bf16 activations
        g = group or rows.shape[-1]
        for c in range(0, rows.shape[-1], g):
            part = rows[:, c:c + g]
            s = torch.clamp(part.abs().amax(dim=-1, keepdim=True), min=1e-12) / 448
            rows[:, c:c + g] = (part / s).to(torch.float8_e4m3fn).to(torch.float32) * s
        return (x,)

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            mod.register_forward_pre_hook(hook)
    return model


def test_quantize_lm_head_tied_and_untied(tmp_path, seed):
    for tie in (False, True):
        model_dir = make_tiny_model(tmp_path / f"hf{tie}", "llama", tie=tie, seed=seed % (1 << 30), **TILED)
        plan = compile_plan(model_dir, tmp_path / f"plan{tie}", BuildConfig(**BUILD, quantize_lm_head=True))
        assert plan.manifest["quantization"]["lm_head"] is True
        assert plan.weights["lm_head"].dtype == "float8_e4m3fn" and plan.weights["embed_tokens"].dtype == "bfloat16"
        head = [op for op in plan.buckets[0].ops if op.op == "linear"][-1]
        assert (head.weight, head.quant) == ("lm_head", "fp8_block128")
        src = load_hf_model(model_dir).state_dict()["lm_head.weight" if not tie else "model.embed_tokens.weight"]
        real, per = dequantized(plan, "lm_head")
        w = src.double().numpy()
        assert np.all(np.abs(real - w) <= np.abs(w) * 2.0 ** -4 + per * 2.0 ** -10)


@pytest.mark.parametrize("scheme", ["channel", "block128"])
def test_explicit_scheme_and_dummy_weights(tmp_path, scheme):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 300, "hidden_size": 128,
                               "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
                               "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True}))
    plan = compile_plan(cfg, tmp_path / "plan", BuildConfig(**BUILD, fp8_scheme=scheme), dummy_weights=True)
    assert set(plan.manifest["quantization"]["schemes"].values()) == {f"fp8_{scheme}"}
    runner = NumpyRunner(plan)
    w, s = runner.w["layers.0.down"], runner.w["layers.0.down.scale"]
    assert plan.weights["layers.0.down"].dtype == "float8_e4m3fn" and w.shape == (128, 384)
    assert s.shape == ((128,) if scheme == "channel" else (1, 3))
    assert np.abs(w).max() == 448 and 0.01 < np.abs(w).mean() / 448 < 0.5          # amax-scaled, well spread
    amax, std = s * 448, 384 ** -0.5
    assert np.all((amax > 2 * std) & (amax <= 2 * np.sqrt(3) * std * 1.0001))      # under the Irwin-Hall bound
    tokens, logits = Session(runner).greedy(list(range(3, 73)), 3)
    assert np.isfinite(logits).all()


def test_qwen3_8b_h200_fp8_dummy_manifest(tmp_path):
    """plans/qwen3-8b + h200 build config (CPU target here): every layer linear FP8 at block128 (shapes tile)."""
    from tests.conftest import ROOT
    base = json.loads((ROOT / "plans" / "h200.build.json").read_text())
    build = BuildConfig(**{**base, "target": "cpu", "quantization": "fp8"})
    plan = compile_plan(ROOT / "plans" / "qwen3-8b.config.json", tmp_path / "plan", build, dummy_weights=True)
    fp8_bytes = sum(i.nbytes for n, i in plan.weights.items() if i.dtype == "float8_e4m3fn")
    assert set(plan.fp8_schemes.values()) == {"fp8_block128"} and len(plan.fp8_schemes) == 4 * 36
    assert 6.8e9 < fp8_bytes < 7.0e9                                                # 36 x 4 linears of Qwen3-8B
    rows = max(build.prefill_chunk, build.max_num_seqs)                               # the largest bucket's rows
    assert plan.arena["xq"].shape == [rows, 12288] and plan.arena["xq_scale"].shape == [rows, 96]


@pytest.mark.parametrize("target", ["sm_80", "sm_86", "sm_75"])
def test_fp8_refused_below_sm89(tmp_path, target):
    with pytest.raises(ConfigError, match=f"FP8 weights need FP8 tensor cores .*target {target} has none"):
        _compile_tiny(tmp_path, target)


def _compile_tiny(tmp_path, target):
    model_dir = make_tiny_model(tmp_path / "hf", "qwen3", seed=1)
    compile_plan(model_dir, tmp_path / "plan", BuildConfig(**{**BUILD, "target": target}))


def test_fp8_with_tensor_parallel_refused(tmp_path):
    model_dir = make_tiny_model(tmp_path / "hf", "qwen3", seed=1)
    with pytest.raises(ConfigError, match="tensor_parallel > 1"):
        compile_plan(model_dir, tmp_path / "plan", BuildConfig(**{**BUILD, "tensor_parallel": 2}))


def test_bad_quantization_settings():
    with pytest.raises(ConfigError, match="quantization 'int4'"):
        BuildConfig(quantization="int4").validate()
    with pytest.raises(ConfigError, match="fp8_scheme 'tensor'"):
        BuildConfig(quantization="fp8", fp8_scheme="tensor").validate()


def test_inspect_shows_the_scheme_and_fp8_bytes(tmp_path, seed):
    from xserv_aot.plan import roofline
    from xserv_aot.plan.inspect import describe
    model_dir = make_tiny_model(tmp_path / "hf", "qwen3", seed=seed % (1 << 30), **TILED)
    fp8_plan = compile_plan(model_dir, tmp_path / "fp8", BuildConfig(**BUILD))
    bf16_plan = compile_plan(model_dir, tmp_path / "bf16", BuildConfig(**{**BUILD, "quantization": "none"}))
    text = describe(fp8_plan.dir)
    assert "quantization: fp8, 8 weights (0 stored FP8 by the checkpoint), lm_head bfloat16" in text
    for kind in LINEARS:
        assert f"  {kind:<8} fp8_block128  x2" in text
    # layer linears of this model: 2 x (256*128 + 128*128 + 512*128 + 128*256) e4m3 bytes + their block scales
    fp8_bytes = 2 * (256 * 128 + 128 * 128 + 512 * 128 + 128 * 256) + 2 * 4 * (2 + 1 + 4 + 2)
    assert f"FP8 weights + scales {fp8_bytes / 2**20:10.1f} MiB" in text and "2.00x" in text
    assert "quantization" not in describe(bf16_plan.dir)
    # roofline: a decode linear reads n * k bytes + scales instead of 2 n k
    op8 = next(op for op in fp8_plan.buckets[0].ops if op.op == "linear" and op.weight == "layers.0.down")
    op16 = next(op for op in bf16_plan.buckets[0].ops if op.op == "linear" and op.weight == "layers.0.down")
    b8, b16 = (roofline.op_bytes(op, p, 128, 1) for op, p in ((op8, fp8_plan), (op16, bf16_plan)))
    assert b16 - b8 == 128 * 256 - 2 * 4
    ops = fp8_plan.buckets[-1].ops                                    # prefill_80: quantize_fp8 + W8A8 down
    i = next(i for i, op in enumerate(ops) if op.op == "linear" and op.weight == "layers.0.down")
    q, lin = ops[i - 1], ops[i]
    assert (q.op, q.k, lin.inp_scale) == ("quantize_fp8", 256, "xq_scale")
    assert roofline.op_bytes(q, fp8_plan, 128, 1) == 80 * 256 * 3 + 80 * 2 * 4
    assert roofline.op_bytes(lin, fp8_plan, 128, 1) == 128 * 256 + 2 * 4 + 80 * 256 + 80 * 2 * 4 + 80 * 128 * 2


def test_cli_fp8_flags_and_refusals(tmp_path):
    from tests.conftest import ROOT
    from tests.test_cli import assert_one_line_error, cli
    cfg = ROOT / "plans" / "qwen3-0.6b.config.json"
    base = ("compile", cfg, "--dummy-weights", "--max-seq-len", "256", "--quantization", "fp8")
    assert_one_line_error(cli(*base, "-o", tmp_path / "a", "--target", "sm_80"), "need FP8 tensor cores")
    assert_one_line_error(cli(*base, "-o", tmp_path / "b", "--target", "cpu", "--fp8-scheme", "tensor"),
                          "fp8_scheme 'tensor'")
    r = cli(*base, "-o", tmp_path / "c", "--target", "cpu", "--fp8-scheme", "channel", "--quantize-lm-head")
    assert r.returncode == 0, r.stderr
    plan = Plan.load(tmp_path / "c", verify="none")
    assert set(plan.fp8_schemes.values()) == {"fp8_channel"} and "lm_head" in plan.fp8_schemes
    assert (plan.build.quantization, plan.build.fp8_scheme, plan.build.quantize_lm_head) == ("fp8", "channel", True)
    shown = cli("inspect", tmp_path / "c")
    assert shown.returncode == 0 and "quantization: fp8, 113 weights" in shown.stdout and "lm_head fp8" in shown.stdout


def test_plan_load_checks_fp8_weights_against_the_ops(tmp_path, seed):
    from xserv_aot.plan.integrity import PlanError
    model_dir = make_tiny_model(tmp_path / "hf", "qwen3", seed=seed % (1 << 30), **TILED)
    compile_plan(model_dir, tmp_path / "plan", BuildConfig(**BUILD))
    path = tmp_path / "plan" / "manifest.json"
    good = json.loads(path.read_text())
    for edit, match in [(lambda m: m["weights"]["tensors"]["layers.0.down.scale"].update(shape=[2, 2]),
                         r"scale layers.0.down.scale is \[2, 2\] float32, fp8_block128 needs \[1, 2\] float32"),
                        (lambda m: [op.pop(f) for op in m["buckets"][0]["ops"] if op.get("weight") == "layers.1.qkv"
                                    for f in ("quant", "weight_scale")],
                         "linear layers.1.qkv: weight dtype float8_e4m3fn does not fit quant None")]:
        bad = json.loads(json.dumps(good))
        edit(bad)
        path.write_text(json.dumps(bad))
        with pytest.raises(PlanError, match=match):
            Plan.load(tmp_path / "plan", verify="none")


def test_w8a16_max_rows_moves_decode_rows_to_w8a8(tmp_path, seed):
    """fp8_w8a16_max_rows 2: the 4-row decode bucket quantizes its activations (quantize_fp8 + W8A8 linears),
    decode_1/2 stay W8A16; on the NumPy backend its logits stay within the W8A8 error of the W8A16 plan's."""
    for bad in (1, 65, True, 8.0):
        with pytest.raises(ConfigError, match="fp8_w8a16_max_rows"):
            BuildConfig(**{**BUILD, "fp8_w8a16_max_rows": bad}).validate()
    rng = np.random.default_rng(seed)
    model_dir = make_tiny_model(tmp_path / "hf", "qwen3", seed=int(rng.integers(1 << 30)), dtype="bfloat16", **TILED)
    plans = {r: compile_plan(model_dir, tmp_path / f"plan{r}", BuildConfig(**BUILD, fp8_w8a16_max_rows=r))
             for r in (64, 2)}
    for b in plans[2].decode_buckets:
        assert any(op.op == "quantize_fp8" for op in b.ops) == (b.num_tokens > 2), b.name
    assert not any(op.op == "quantize_fp8" for b in plans[64].decode_buckets for op in b.ops)
    prompts = [rng.integers(3, 256, size=6).tolist() for _ in range(4)]
    step = rng.integers(3, 256, size=4).tolist()

    def decode_logits(plan):
        s = Session(NumpyRunner(plan), num_seqs=4)
        for k, p in enumerate(prompts):
            s.prefill(k, p)
        return np.asarray(s.step({k: [t] for k, t in enumerate(step)})[1], np.float64)

    w8a16, w8a8 = decode_logits(plans[64]), decode_logits(plans[2])
    assert np.isfinite(w8a8).all() and 0 < rel_err(w8a8, w8a16) <= 0.2     # the W8A8 bound of the test above

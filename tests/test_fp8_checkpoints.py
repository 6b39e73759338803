"""Pre-quantized FP8 checkpoints (checkpoint/fp8_layouts.py): small checkpoints in Qwen's block layout and
llm-compressor's FP8 dynamic (per channel) / FP8 static (per tensor) layouts, with the real tensor names, quantized
here with torch; the plan's dequantized weights must equal the checkpoint's, and bad layouts are refused."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_fp8_compile import LINEARS, dequantized, rel_err
from tests.tiny_models import make_tiny_model
from xserv_aot.checkpoint import CheckpointError
from xserv_aot.config import BuildConfig
from xserv_aot.plan.builder import compile_plan
from xserv_aot.runtime.numpy_backend import NumpyRunner
from xserv_aot.runtime.session import Session

DIMS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=32)
BUILD = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[16, 80], max_seq_len=128, block_size=4,
             dtype="bfloat16", target="cpu")
QWEN = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def compressed(strategy: str, static_inputs: bool) -> dict:
    acts = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
            if static_inputs else {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                   "symmetric": True})
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "kv_cache_scheme": None, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "output_activations": None,
                                          "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                      "symmetric": True, "dynamic": False, "observer": "minmax"}}}}


def quantize(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, scale as the layout stores it), in torch."""
    w = w.float()
    if layout == "block":
        n, k = w.shape
        pn, pk = -(-n // 128) * 128, -(-k // 128) * 128
        blocks = torch.nn.functional.pad(w, (0, pk - k, 0, pn - n)).reshape(pn // 128, 128, pk // 128, 128)
        s = blocks.abs().amax(dim=(1, 3)) / 448
        q = (blocks / s[:, None, :, None]).reshape(pn, pk)[:n, :k]
    elif layout == "channel":
        s = (w.abs().amax(dim=1, keepdim=True) / 448).to(torch.bfloat16).float()   # [N, 1], stored as bf16
        q = w / s
    else:
        s = w.abs().amax() / 448                                        # scalar
        q = w / s
    return q.clamp(-448, 448).to(torch.float8_e4m3fn), (s.to(torch.bfloat16) if layout == "channel" else s)


def real(q: torch.Tensor, s: torch.Tensor, layout: str) -> np.ndarray:
    q, s = q.double().numpy(), s.double().numpy()
    if layout == "block":
        return q * np.kron(s, np.ones((128, 128)))[:q.shape[0], :q.shape[1]]
    return q * (s.reshape(-1, 1) if layout == "channel" else s)


def make_fp8_checkpoint(tmp_path, layout: str, qcfg: dict, seed: int, input_scales: bool = False, **dims):
    """A tiny qwen3 with every layer linear FP8 in `layout`; returns (dir, {hf weight name: W_real float64})."""
    d = make_tiny_model(tmp_path / "hf", "qwen3", seed=seed, dtype="bfloat16", **{**DIMS, **dims})
    sd, out, reals = load_file(d / "model.safetensors"), {}, {}
    for name, t in sd.items():
        if any(f".{p}.weight" in name for parts in LINEARS.values() for p in parts):
            q, s = quantize(t, layout)
            base = name[:-len(".weight")]
            out[name] = q
            out[base + (".weight_scale_inv" if qcfg.get("weight_block_size") else ".weight_scale")] = s
            if input_scales:
                out[base + ".input_scale"] = torch.tensor(0.05)
            reals[name] = real(q, s, layout)
        else:
            out[name] = t
    save_file(out, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
    return d, reals


LAYOUTS = [("block", QWEN, False, "fp8_block128"), ("channel", compressed("channel", False), False, "fp8_channel"),
           ("tensor", compressed("tensor", True), True, "fp8_channel")]


@pytest.mark.parametrize("layout,qcfg,inputs,scheme", LAYOUTS, ids=["qwen-block", "ct-dynamic", "ct-static"])
def test_plan_weights_equal_the_checkpoints(tmp_path, seed, layout, qcfg, inputs, scheme):
    d, reals = make_fp8_checkpoint(tmp_path, layout, qcfg, seed % (1 << 30), inputs)
    plan = compile_plan(d, tmp_path / "plan", BuildConfig(**BUILD))           # FP8 without --quantization
    q = plan.manifest["quantization"]
    assert set(q["schemes"].values()) == {scheme} and len(q["from_checkpoint"]) == 4 * 2
    assert q["ignored_input_scales"] == (7 * 2 if inputs else 0) and q["lm_head"] is False
    assert plan.weights["lm_head"].dtype == "bfloat16"
    for li in range(2):
        for name, parts in LINEARS.items():
            want = np.concatenate([reals[f"model.layers.{li}.{p}.weight"] for p in parts])
            np.testing.assert_array_equal(dequantized(plan, f"layers.{li}.{name}")[0], want)
    # and the plan runs: logits of a short prompt next to an HF model holding the dequantized weights
    from tests.tiny_models import load_hf_model
    ref_dir = make_tiny_model(tmp_path / "ref", "qwen3", seed=seed % (1 << 30), dtype="float32", **DIMS)
    hf = load_hf_model(ref_dir)
    with torch.no_grad():
        for name, w in reals.items():
            hf.state_dict()[name].copy_(torch.tensor(w))
    prompt = list(range(5, 15))
    tokens, logits = Session(NumpyRunner(plan)).greedy(prompt, 3)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens[:-1]])).logits[0].double().numpy()[len(prompt) - 1:]
    assert rel_err(logits, ref) <= 3e-2


def test_quantize_flag_adds_the_unquantized_head(tmp_path, seed):
    d, _ = make_fp8_checkpoint(tmp_path, "block", QWEN, seed % (1 << 30))
    plan = compile_plan(d, tmp_path / "plan", BuildConfig(**BUILD, quantization="fp8", quantize_lm_head=True))
    q = plan.manifest["quantization"]
    assert q["lm_head"] is True and "lm_head" not in q["from_checkpoint"] and q["schemes"]["lm_head"] == "fp8_block128"


def refused(tmp_path, match: str):
    with pytest.raises((CheckpointError, ValueError), match=match) as e:
        compile_plan(tmp_path / "hf", tmp_path / "plan", BuildConfig(**BUILD))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "plan").exists()


def edit(d, fn):
    sd = load_file(d / "model.safetensors")
    fn(sd)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})


def test_refusals(tmp_path):
    k_proj = "model.layers.0.self_attn.k_proj"
    d, _ = make_fp8_checkpoint(tmp_path / "a", "block", QWEN, 1, num_key_value_heads=2)    # k_proj: 64 rows
    refused(tmp_path / "a", f"{k_proj}.weight: 64 rows, not a multiple of 128")

    d, _ = make_fp8_checkpoint(tmp_path / "b", "block", QWEN, 1)
    edit(d, lambda sd: sd.pop(f"{k_proj}.weight_scale_inv"))
    refused(tmp_path / "b", f"{k_proj}.weight: FP8 weight without its scale {k_proj}.weight_scale_inv")

    d, _ = make_fp8_checkpoint(tmp_path / "c", "channel", compressed("channel", False), 1)
    edit(d, lambda sd: sd.__setitem__(f"{k_proj}.weight_scale", torch.ones(3, 1)))
    refused(tmp_path / "c", f"{k_proj}.weight_scale: shape \\[3, 1\\] fits none")

    d, _ = make_fp8_checkpoint(tmp_path / "d", "channel", compressed("channel", False), 1)
    edit(d, lambda sd: sd.__setitem__("model.embed_tokens.weight", sd["model.embed_tokens.weight"].to(torch.float8_e4m3fn)))
    refused(tmp_path / "d", "model.embed_tokens.weight: FP8, but not a layer linear")

    d, _ = make_fp8_checkpoint(tmp_path / "e", "channel", compressed("channel", False), 1)
    edit(d, lambda sd: sd.__setitem__(f"{k_proj}.weight", sd[f"{k_proj}.weight"].float().to(torch.float8_e5m2)))
    refused(tmp_path / "e", f"{k_proj}.weight: dtype F8_E5M2 is not supported")

    d, _ = make_fp8_checkpoint(tmp_path / "f", "block", QWEN, 1)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}))
    refused(tmp_path / "f", "F8_E4M3 but config.json has no quantization_config")

    for name, qcfg, match in [("g", {"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
                              ("h", {**compressed("channel", False), "kv_cache_scheme": {"num_bits": 8}},
                               "kv_cache_scheme"),
                              ("i", {**QWEN, "weight_block_size": [64, 64]}, "weight_block_size \\[64, 64\\]")]:
        d, _ = make_fp8_checkpoint(tmp_path / name, "block", QWEN, 1)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
        refused(tmp_path / name, match)

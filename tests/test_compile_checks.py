"""Compile refuses checkpoints it would turn into a silently wrong model: tensors the model does not use (biases the
architecture lacks), and NaN/Inf weights; each in one line naming the tensor, with no plan left behind."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from safetensors.numpy import load_file, save_file

from tests.test_gguf import _write, gguf_meta, hf_to_gguf
from tests.tiny_models import load_hf_model, make_tiny_model
from xserv_aot.config import BuildConfig, ConfigError
from xserv_aot.plan.builder import compile_plan
from xserv_aot.plan.weights import WeightError

BUILD = dict(max_num_seqs=2, decode_buckets=[1, 2], prefill_buckets=[8], max_seq_len=32, block_size=4,
             dtype="float32", target="cpu")


def compile_fails(src: Path, out: Path, exc, *needles: str) -> str:
    with pytest.raises(exc) as e:
        compile_plan(src, out, BuildConfig(**BUILD))
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    assert not any(p.name == out.name or p.name.startswith(f".{out.name}.") for p in out.parent.iterdir())
    return msg


def edit_safetensors(model_dir: Path, edit) -> Path:
    path = model_dir / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})
    return model_dir


def gguf_tensors(path: Path) -> dict:
    return {t.name: (np.array(t.data).reshape(tuple(reversed(t.shape.tolist()))), None)
            for t in gguf.GGUFReader(path).tensors}


def test_qwen3_attention_bias_is_refused(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", "qwen3", attention_bias=True)
    assert "model.layers.0.self_attn.o_proj.bias" in load_file(hf / "model.safetensors")
    compile_fails(hf, tmp_path / "plan", ConfigError, "qwen3", "attention_bias")


@pytest.mark.parametrize("arch, extra", [("qwen3", "model.layers.1.self_attn.q_proj.bias"),
                                         ("llama", "model.layers.0.mlp.down_proj.bias"),
                                         ("qwen2", "model.layers.0.self_attn.o_proj.bias"),
                                         ("llama", "model.layers.0.self_attn.rotary_emb.scale")])
def test_unused_safetensors_tensor_is_named(tmp_path, arch, extra):
    hf = make_tiny_model(tmp_path / "hf", arch)
    edit_safetensors(hf, lambda s: s.__setitem__(extra, np.ones(64, np.float32)))
    compile_fails(hf, tmp_path / "plan", WeightError, extra, "not used")


def test_tied_head_copy_is_accepted_a_different_one_refused(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", "llama", tie=True)
    emb = load_file(hf / "model.safetensors")["model.embed_tokens.weight"]
    edit_safetensors(hf, lambda s: s.__setitem__("lm_head.weight", emb.copy()))
    compile_plan(hf, tmp_path / "ok", BuildConfig(**BUILD))
    edit_safetensors(hf, lambda s: s.__setitem__("lm_head.weight", emb * 2))
    compile_fails(hf, tmp_path / "plan", WeightError, "lm_head.weight")


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_gguf_attention_bias_is_named(tmp_path, arch):
    hf = make_tiny_model(tmp_path / "hf", arch)
    model = load_hf_model(hf)
    path, _, _ = hf_to_gguf(hf, tmp_path / "m.gguf", arch, half=False)
    tensors = gguf_tensors(path)
    tensors["blk.0.attn_k.bias"] = (np.zeros(model.config.num_key_value_heads * model.config.head_dim, np.float32),
                                    None)
    bad = _write(tmp_path / "b.gguf", arch, gguf_meta(arch, model.config), tensors)
    compile_fails(bad, tmp_path / "plan", WeightError, "blk.0.attn_k.bias")


def test_unknown_gguf_tensor_is_named(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", "qwen3")
    model = load_hf_model(hf)
    path, _, _ = hf_to_gguf(hf, tmp_path / "m.gguf", "qwen3", half=False)
    tensors = gguf_tensors(path)
    tensors["blk.1.attn_sinks.weight"] = (np.zeros(4, np.float32), None)
    bad = _write(tmp_path / "b.gguf", "qwen3", gguf_meta("qwen3", model.config), tensors)
    compile_fails(bad, tmp_path / "plan", WeightError, "blk.1.attn_sinks.weight")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nan_inf_safetensors_weight_is_named(tmp_path, value):
    hf = make_tiny_model(tmp_path / "hf", "qwen3")

    def poison(s):
        s["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    edit_safetensors(hf, poison)
    compile_fails(hf, tmp_path / "plan", WeightError, "model.layers.1.mlp.up_proj.weight", "NaN/Inf")


def test_corrupted_gguf_data_is_named(tmp_path):
    """1 KB of 0xFF bytes inside an F16 tensor's data: f16 0xFFFF is NaN."""
    hf = make_tiny_model(tmp_path / "hf", "qwen3")
    path, _, _ = hf_to_gguf(hf, tmp_path / "m.gguf", "qwen3", half=True)
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_gate.weight")
    assert t.tensor_type == QT.F16
    raw = bytearray(path.read_bytes())
    raw[t.data_offset + 256: t.data_offset + 256 + 1024] = b"\xff" * 1024
    path.write_bytes(bytes(raw))
    compile_fails(path, tmp_path / "plan", WeightError, "blk.1.ffn_gate.weight", "NaN/Inf")

"""safetensors checkpoints: tensors and config from open_checkpoint against what transformers loads."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_models import LLAMA3_ROPE, load_hf_model, make_tiny_model
from xserv_aot.checkpoint import CheckpointError, open_checkpoint


def _one_line_error(exc_info, *must_contain: str) -> str:
    msg = str(exc_info.value)
    assert isinstance(exc_info.value, ValueError)
    assert "\n" not in msg and msg.strip() == msg and msg
    for part in must_contain:
        assert part in msg, (part, msg)
    return msg


def assert_matches_hf(model_dir: Path, *, expect_dtype: str) -> None:
    config, tensors, fmt = open_checkpoint(model_dir)
    model = load_hf_model(model_dir)
    hf = model.config
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    assert fmt == "safetensors"

    tied = hf.tie_word_embeddings
    assert set(tensors.names()) == set(state) - ({"lm_head.weight"} if tied else set())
    for name in tensors.names():
        got = tensors.get(name)
        assert got.dtype == np.float32 and got.shape == tensors.shape(name) == state[name].shape, name
        np.testing.assert_array_equal(got, state[name], err_msg=name)
    if tied:
        np.testing.assert_array_equal(tensors.get("model.embed_tokens.weight"), state["lm_head.weight"])

    assert config.arch == hf.model_type
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert config.rms_norm_eps == hf.rms_norm_eps
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.max_position_embeddings == hf.max_position_embeddings
    assert config.tie_word_embeddings == tied
    assert config.bos_token_id == hf.bos_token_id and config.eos_token_ids == [hf.eos_token_id]
    assert config.source_dtype == expect_dtype
    assert config.q_size == tensors.shape("model.layers.0.self_attn.q_proj.weight")[0]
    assert config.kv_size == tensors.shape("model.layers.0.self_attn.k_proj.weight")[0]
    assert config.qk_norm == ("model.layers.0.self_attn.q_norm.weight" in tensors.names())
    assert config.qkv_bias == ("model.layers.0.self_attn.q_proj.bias" in tensors.names())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_tiny_models_match_transformers(tmp_path, arch, sharded, dtype, seed):
    tie = sharded != (dtype == "bfloat16")
    d = make_tiny_model(tmp_path / "m", arch, sharded=sharded, dtype=dtype, tie=tie, seed=seed)
    if sharded:
        assert len(list(d.glob("*.safetensors"))) >= 2 and (d / "model.safetensors.index.json").is_file()
    assert_matches_hf(d, expect_dtype=dtype)


def test_float16_and_wide_head_dim(tmp_path):
    d = make_tiny_model(tmp_path / "m", "qwen3", dtype="float16", head_dim=32, seed=7)
    assert_matches_hf(d, expect_dtype="float16")
    config, tensors, _ = open_checkpoint(d)
    assert config.head_dim == 32 and tensors.shape("model.layers.1.self_attn.q_proj.weight") == (128, 64)


def test_llama3_rope_scaling(tmp_path):
    d = make_tiny_model(tmp_path / "m", "llama", rope_scaling=dict(LLAMA3_ROPE), rope_theta=500000.0)
    config, _, _ = open_checkpoint(d)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["rope_type"] == "llama3"
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        assert config.rope_scaling[key] == LLAMA3_ROPE[key]


def test_independent_safetensors_writer(tmp_path, seed):
    """A checkpoint written by the safetensors package itself (not transformers) reads back bit-exactly."""
    from safetensors.numpy import save_file

    d = make_tiny_model(tmp_path / "m", "qwen3")
    rng = np.random.default_rng(seed)
    fp16 = {"extra.half": rng.standard_normal((3, 5)).astype(np.float16),
            "extra.single": rng.standard_normal((7,)).astype(np.float32)}
    save_file(fp16, d / "model.safetensors", metadata={"format": "np"})
    _, tensors, _ = open_checkpoint(d)
    assert sorted(tensors.names()) == sorted(fp16)
    for name, want in fp16.items():
        np.testing.assert_array_equal(tensors.get(name), want.astype(np.float32))


# ---- errors: one line, naming the problem ----

def test_no_config(tmp_path):
    with pytest.raises(ValueError) as e:
        open_checkpoint(tmp_path)
    _one_line_error(e, str(tmp_path), "config.json")


def test_missing_path_and_wrong_file(tmp_path):
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(tmp_path / "nope")
    _one_line_error(e, "nope")
    (tmp_path / "weights.bin").write_bytes(b"xx")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(tmp_path / "weights.bin")
    _one_line_error(e, "weights.bin")


def _rewrite_config(model_dir: Path, **changes) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    (model_dir / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, expect", [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "GPT2LMHeadModel"),
    (dict(architectures=["MistralForCausalLM"], model_type="mistral"), "MistralForCausalLM"),
    (dict(num_experts=8, num_experts_per_tok=2), "mixture-of-experts"),
])
def test_unsupported_configs(tmp_path, changes, expect):
    d = make_tiny_model(tmp_path / "m", "qwen3")
    _rewrite_config(d, **changes)
    with pytest.raises(ValueError) as e:
        open_checkpoint(d)
    _one_line_error(e, expect)


def test_missing_tensor(tmp_path):
    d = make_tiny_model(tmp_path / "m", "llama")
    _, tensors, _ = open_checkpoint(d)
    with pytest.raises(CheckpointError) as e:
        tensors.get("model.layers.3.mlp.down_proj.weight")
    msg = _one_line_error(e, "model.layers.3.mlp.down_proj.weight", str(d))
    assert msg == f"model.layers.3.mlp.down_proj.weight: missing from checkpoint {d}"
    with pytest.raises(CheckpointError):
        tensors.shape("lm_head.bias")


def test_missing_shard(tmp_path):
    d = make_tiny_model(tmp_path / "m", "qwen2", sharded=True)
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    _one_line_error(e, shard.name, "missing shard")


def test_no_weights(tmp_path):
    d = make_tiny_model(tmp_path / "m", "qwen3")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    _one_line_error(e, "model.safetensors")


def _single(tmp_path) -> Path:
    return make_tiny_model(tmp_path / "m", "qwen3") / "model.safetensors"


def test_corrupt_header_length(tmp_path):
    f = _single(tmp_path)
    raw = bytearray(f.read_bytes())
    raw[:8] = (len(raw) * 2).to_bytes(8, "little")
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(f.parent)
    _one_line_error(e, str(f), "header")


def test_corrupt_header_json(tmp_path):
    f = _single(tmp_path)
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[8 + n // 2] = ord("}")
    raw[8 + n // 2 + 1] = 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(f.parent)
    _one_line_error(e, str(f), "invalid JSON")


def test_truncated_file(tmp_path):
    f = _single(tmp_path)
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(f.parent)
    _one_line_error(e, str(f), "truncated")


def test_unsupported_dtype(tmp_path):
    from safetensors.numpy import save_file

    d = make_tiny_model(tmp_path / "m", "qwen3")
    save_file({"model.embed_tokens.weight": np.zeros((4, 4), np.int8)}, d / "model.safetensors")
    _, tensors, _ = open_checkpoint(d)
    with pytest.raises(CheckpointError) as e:
        tensors.get("model.embed_tokens.weight")
    _one_line_error(e, "model.embed_tokens.weight", "I8")


def test_sharded_copy_is_independent_of_location(tmp_path):
    """Shards resolve relative to the index, so a moved directory still opens."""
    d = make_tiny_model(tmp_path / "m", "llama", sharded=True, dtype="bfloat16")
    moved = shutil.move(str(d), str(tmp_path / "elsewhere"))
    config, tensors, _ = open_checkpoint(Path(moved))
    state = load_hf_model(moved).state_dict()
    name = "model.layers.1.mlp.up_proj.weight"
    np.testing.assert_array_equal(tensors.get(name), state[name].to(torch.float32).numpy())

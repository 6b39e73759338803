"""GGUF checkpoints: dequantization vs float64 references, HF round trip through GGUFWriter, real SmolLM2 vs transformers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tests.tiny_models import load_hf_model, make_tiny_model
from xserv_aot.checkpoint import CheckpointError, open_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "build/assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float64)


# ---- float64 reference dequantizers, one block row at a time (llama.cpp block layouts) ----

def ref_q8_0(b: np.ndarray) -> np.ndarray:          # d:f16 | q:int8[32]
    b = b.reshape(-1, 34)
    return (_f16(b[:, :2]) * b[:, 2:].view(np.int8)).ravel()


def ref_q4_0(b: np.ndarray) -> np.ndarray:          # d:f16 | q:u8[16]; x[j] = lo nibble, x[j+16] = hi nibble
    b = b.reshape(-1, 18)
    q = b[:, 2:].astype(np.int64)
    return (_f16(b[:, :2]) * (np.concatenate([q & 15, q >> 4], axis=1) - 8)).ravel()


def ref_q4_1(b: np.ndarray) -> np.ndarray:          # d:f16 | m:f16 | q:u8[16]
    b = b.reshape(-1, 20)
    q = b[:, 4:].astype(np.int64)
    return (_f16(b[:, :2]) * np.concatenate([q & 15, q >> 4], axis=1) + _f16(b[:, 2:4])).ravel()


def _scale_min_k4(j: int, s: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(s[j]) & 63, int(s[j + 4]) & 63
    return (int(s[j + 4]) & 15) | ((int(s[j - 4]) >> 6) << 4), (int(s[j + 4]) >> 4) | ((int(s[j]) >> 6) << 4)


def ref_q4_k(b: np.ndarray) -> np.ndarray:          # d:f16 | dmin:f16 | scales:u8[12] | q:u8[128], 256 values
    out = []
    for blk in b.reshape(-1, 144):
        d, dmin = _f16(blk[0:2])[0], _f16(blk[2:4])[0]
        scales, q = blk[4:16], blk[16:].astype(np.int64)
        for j in range(4):
            sc1, m1 = _scale_min_k4(2 * j, scales)
            sc2, m2 = _scale_min_k4(2 * j + 1, scales)
            chunk = q[32 * j: 32 * j + 32]
            out += [d * sc1 * (chunk & 15) - dmin * m1, d * sc2 * (chunk >> 4) - dmin * m2]
    return np.concatenate(out)


def ref_q6_k(b: np.ndarray) -> np.ndarray:          # ql:u8[128] | qh:u8[64] | scales:i8[16] | d:f16, 256 values
    out = []
    for blk in b.reshape(-1, 210):
        ql, qh = blk[:128].astype(np.int64), blk[128:192].astype(np.int64)
        sc, d = blk[192:208].view(np.int8).astype(np.float64), _f16(blk[208:210])[0]
        y = np.zeros(256)
        for half in range(2):
            L, H, S, Y = ql[64 * half:], qh[32 * half:], sc[8 * half:], 128 * half
            for l in range(32):
                s = l // 16
                y[Y + l] = d * S[s] * (((L[l] & 15) | (((H[l] >> 0) & 3) << 4)) - 32)
                y[Y + l + 32] = d * S[s + 2] * (((L[l + 32] & 15) | (((H[l] >> 2) & 3) << 4)) - 32)
                y[Y + l + 64] = d * S[s + 4] * (((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32)
                y[Y + l + 96] = d * S[s + 6] * (((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32)
        out.append(y)
    return np.concatenate(out)


def ref_bf16(b: np.ndarray) -> np.ndarray:
    return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# qtype: (reference, block values, block bytes, byte offsets of f16 scale fields)
QUANTS = {
    QT.Q8_0: (ref_q8_0, 32, 34, [0]),
    QT.Q4_0: (ref_q4_0, 32, 18, [0]),
    QT.Q4_1: (ref_q4_1, 32, 20, [0, 2]),
    QT.Q4_K: (ref_q4_k, 256, 144, [0, 2]),
    QT.Q6_K: (ref_q6_k, 256, 210, [208]),
}


def random_blocks(rng, qtype, rows: int, cols: int) -> np.ndarray:
    """Random block bytes [rows, cols/bs*bytes] whose f16 scale fields are finite."""
    _, bs, nbytes, f16_at = QUANTS[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // bs, nbytes), dtype=np.uint8)
    for off in f16_at:
        blocks[:, off:off + 2] = rng.uniform(-0.5, 0.5, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


# ---- writing GGUF files ----

def _write(path: Path, arch: str, meta: dict, tensors: dict[str, tuple[np.ndarray, QT | None]]) -> Path:
    w = gguf.GGUFWriter(path, arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_string(key, value)
    for name, (arr, raw_dtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_meta(arch: str, hf) -> dict:
    return {
        f"{arch}.block_count": hf.num_hidden_layers, f"{arch}.context_length": hf.max_position_embeddings,
        f"{arch}.embedding_length": hf.hidden_size, f"{arch}.feed_forward_length": hf.intermediate_size,
        f"{arch}.attention.head_count": hf.num_attention_heads,
        f"{arch}.attention.head_count_kv": hf.num_key_value_heads,
        f"{arch}.attention.key_length": hf.head_dim, f"{arch}.attention.value_length": hf.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": float(hf.rms_norm_eps),
        f"{arch}.rope.freq_base": float(hf.rope_parameters["rope_theta"]),
        "tokenizer.ggml.bos_token_id": hf.bos_token_id, "tokenizer.ggml.eos_token_id": hf.eos_token_id,
    }


HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def to_gguf_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What convert_hf_to_gguf does to llama q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_to_gguf(model_dir: Path, out: Path, arch: str, half: bool):
    model = load_hf_model(model_dir)
    hf = model.config
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    tensors = {}
    for name, w in state.items():
        if name == "lm_head.weight" and hf.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = llama_cpp_permute(w, hf.num_attention_heads if "q_proj" in name else hf.num_key_value_heads)
        store = np.float16 if half and w.ndim == 2 else np.float32
        tensors[to_gguf_name(name)] = (np.ascontiguousarray(w, dtype=store), None)
    return _write(out, arch, gguf_meta(arch, hf), tensors), model, state


def _one_line_error(exc_info, *must_contain: str) -> str:
    msg = str(exc_info.value)
    assert isinstance(exc_info.value, ValueError) and msg and "\n" not in msg
    for part in must_contain:
        assert part in msg, (part, msg)
    return msg


# ---- tests ----

@pytest.mark.parametrize("qtype", list(QUANTS))
def test_dequant_matches_float64_reference(tmp_path, qtype, seed):
    rng = np.random.default_rng(seed)
    ref, bs, _, _ = QUANTS[qtype]
    rows, cols = 3, 2 * max(bs, 256)
    blocks = random_blocks(rng, qtype, rows, cols)
    path = _write(tmp_path / "q.gguf", "qwen3", {"qwen3.block_count": 1, "qwen3.embedding_length": cols,
                  "qwen3.feed_forward_length": rows, "qwen3.attention.head_count": 2, "qwen3.vocab_size": 8},
                  {"blk.0.ffn_down.weight": (blocks, qtype)})
    _, tensors, fmt = open_checkpoint(path)
    assert fmt == "gguf" and tensors.shape("model.layers.0.mlp.down_proj.weight") == (rows, cols)
    got = tensors.get("model.layers.0.mlp.down_proj.weight")
    want = np.stack([ref(row) for row in blocks])
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_bf16_tensor(tmp_path, seed):
    rng = np.random.default_rng(seed)
    vals = rng.standard_normal((4, 8)).astype(np.float32)
    bits = (vals.view(np.uint32) >> 16).astype(np.uint16)
    path = _write(tmp_path / "b.gguf", "qwen3", {"qwen3.block_count": 1, "qwen3.embedding_length": 8,
                  "qwen3.feed_forward_length": 4, "qwen3.attention.head_count": 2, "qwen3.vocab_size": 8},
                  {"blk.0.ffn_up.weight": (bits.view(np.uint8), QT.BF16)})
    _, tensors, _ = open_checkpoint(path)
    np.testing.assert_array_equal(tensors.get("model.layers.0.mlp.up_proj.weight"),
                                  np.stack([ref_bf16(r.view(np.uint8)) for r in bits]).astype(np.float32))


@pytest.mark.parametrize("arch, tie, half", [("qwen3", False, False), ("qwen3", True, True),
                                             ("qwen2", True, False), ("llama", False, True), ("llama", True, False)])
def test_round_trip_from_hf(tmp_path, arch, tie, half, seed):
    d = make_tiny_model(tmp_path / "hf", arch, tie=tie, seed=seed)
    path, model, state = hf_to_gguf(d, tmp_path / "m.gguf", arch, half)
    hf = model.config
    config, tensors, fmt = open_checkpoint(path)
    assert fmt == "gguf"
    assert (config.arch, config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers) == (
        arch, hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert config.rms_norm_eps == hf.rms_norm_eps and config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.max_position_embeddings == hf.max_position_embeddings
    assert config.tie_word_embeddings == tie and config.source_dtype == ("float16" if half else "float32")
    assert config.bos_token_id == hf.bos_token_id and config.eos_token_ids == [hf.eos_token_id]
    assert set(tensors.names()) == set(state) - ({"lm_head.weight"} if tie else set())
    for name in tensors.names():
        want = state[name].astype(np.float16).astype(np.float32) if half and state[name].ndim == 2 else state[name]
        assert tensors.shape(name) == want.shape
        np.testing.assert_array_equal(tensors.get(name), want, err_msg=name)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    if not SMOLLM2.is_file():
        env = {**os.environ, "PYTHON": sys.executable}
        subprocess.run(["bash", str(ROOT / "scripts/fetch_assets.sh")], env=env, capture_output=True, timeout=600)
    if not SMOLLM2.is_file():
        pytest.skip("SmolLM2 GGUF asset unavailable (scripts/fetch_assets.sh failed)")
    return SMOLLM2


@pytest.fixture(scope="module")
def smollm2_ours(smollm2):
    return open_checkpoint(smollm2)


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2):
    """(config, tensors) as transformers loads and dequantizes the same GGUF (the from_pretrained(gguf_file=) path)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    loaded = load_gguf_checkpoint(str(smollm2), return_tensors=True, model_to_load=skeleton)
    return config, loaded["tensors"]


def test_smollm2_matches_transformers(smollm2_ours, smollm2_transformers, seed):
    hf_config, hf_tensors = smollm2_transformers
    config, tensors, fmt = smollm2_ours
    assert fmt == "gguf"
    assert (config.arch, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        "llama", 30, 576, 9, 3)
    assert config.tie_word_embeddings and "lm_head.weight" not in tensors.names() and config.source_dtype == "q4_1"
    assert (config.vocab_size, config.intermediate_size, config.head_dim) == (
        hf_config.vocab_size, hf_config.intermediate_size, hf_config.head_dim)
    assert config.rope_theta == hf_config.rope_parameters["rope_theta"]
    assert abs(config.rms_norm_eps - hf_config.rms_norm_eps) < 1e-12
    assert config.max_position_embeddings == hf_config.max_position_embeddings
    assert config.bos_token_id == hf_config.bos_token_id and hf_config.eos_token_id in config.eos_token_ids
    assert set(tensors.names()) == set(hf_tensors)

    layer = int(np.random.default_rng(seed).integers(1, 30))
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{m}" for i in (0, layer) for m in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight", "input_layernorm.weight")]
    for name in names:
        np.testing.assert_array_equal(tensors.get(name), hf_tensors[name].float().numpy(), err_msg=name)


def test_smollm2_qk_rows_are_unpermuted(smollm2, smollm2_ours):
    """The raw GGUF q rows differ from ours, and re-applying llama.cpp's permutation gives them back."""
    _, tensors, _ = smollm2_ours
    raw = {t.name: t for t in gguf.GGUFReader(smollm2).tensors if t.name.startswith("blk.2.attn_")}
    for short, hf_name, heads in (("q", "q_proj", 9), ("k", "k_proj", 3)):
        t = raw[f"blk.2.attn_{short}.weight"]
        stored = gguf.quants.dequantize(t.data, t.tensor_type)
        ours = tensors.get(f"model.layers.2.self_attn.{hf_name}.weight")
        assert not np.array_equal(ours, stored)
        np.testing.assert_array_equal(llama_cpp_permute(ours, heads), stored)


# ---- errors ----

@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    d = make_tiny_model(tmp_path / "hf", "qwen3")
    return hf_to_gguf(d, tmp_path / "m.gguf", "qwen3", half=False)[0]


@pytest.mark.parametrize("keep", [0.5, 0.9, 40])
def test_truncated_gguf(tmp_path, tiny_gguf, keep):
    raw = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[: int(len(raw) * keep) if keep < 1 else keep])
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(cut)
    _one_line_error(e, str(cut))


def test_not_a_gguf(tmp_path, seed):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(bad)
    _one_line_error(e, str(bad), "not a GGUF file")


def test_gguf_missing_tensor(tiny_gguf):
    _, tensors, _ = open_checkpoint(tiny_gguf)
    with pytest.raises(CheckpointError) as e:
        tensors.get("model.layers.3.mlp.down_proj.weight")
    assert _one_line_error(e) == f"model.layers.3.mlp.down_proj.weight: missing from checkpoint {tiny_gguf}"


META = {"block_count": 1, "embedding_length": 8, "feed_forward_length": 16, "attention.head_count": 2}
EMBD = {"token_embd.weight": (np.zeros((10, 8), np.float32), None)}


@pytest.mark.parametrize("arch, extra, expect", [
    ("gpt2", {}, "gpt2"),
    ("qwen3", {"expert_count": 8}, "mixture-of-experts"),
    ("llama", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, "yarn"),
])
def test_unsupported_gguf_models(tmp_path, arch, extra, expect):
    meta = {f"{arch}.{k}": v for k, v in {**META, **extra}.items()}
    path = _write(tmp_path / "u.gguf", arch, meta, EMBD)
    with pytest.raises(ValueError) as e:
        open_checkpoint(path)
    _one_line_error(e, expect)


def test_baked_rope_freqs_refused(tmp_path):
    meta = {f"llama.{k}": v for k, v in META.items()}
    freqs = {"rope_freqs.weight": (np.array([1.0, 1.0, 2.0, 8.0], np.float32), None)}
    path = _write(tmp_path / "r.gguf", "llama", meta, {**EMBD, **freqs})
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    _one_line_error(e, "rope_freqs")


def test_vocab_from_tokenizer_when_no_embedding(tmp_path):
    meta = {f"qwen3.{k}": v for k, v in META.items()}
    meta["tokenizer.ggml.tokens"] = [f"t{i}" for i in range(37)]
    path = _write(tmp_path / "v.gguf", "qwen3", meta, {"output_norm.weight": (np.ones(8, np.float32), None)})
    config, _, _ = open_checkpoint(path)
    assert config.vocab_size == 37 and config.head_dim == 4 and config.num_kv_heads == 2

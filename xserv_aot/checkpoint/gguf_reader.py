"""GGUF reader: llama.cpp tensor names -> HF names, dequantization to float32, ModelConfig from GGUF metadata.

GGUF stores dims in ggml order (ne[0] = innermost), so a Linear weight [out, in] is listed as [in, out].
llama.cpp permutes the rows of llama q/k weights per head (rotary pairs interleaved); we undo that.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from xserv_aot.checkpoint import CheckpointError, one_line
from xserv_aot.config import ConfigError
from xserv_aot.model_config import SUPPORTED_ARCHS, ModelConfig

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """HF tensor name for a llama.cpp tensor name, or None for tensors HF models do not have."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's reshape(n_head, 2, d/2, ...).swapaxes(1, 2) row permutation."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _float32_str(x: float) -> float:
    return float(str(np.float32(x)))   # 9.999999747e-06 (stored as float32) -> 1e-05


def _rope_scaling(fields: dict, arch: str) -> dict | None:
    prefix = f"{arch}.rope.scaling."
    scaling = {k[len(prefix):]: f.contents() for k, f in fields.items() if k.startswith(prefix)}
    kind = scaling.pop("type", None)
    if kind in (None, "none"):
        return None
    if "original_context_length" in scaling:
        scaling["original_max_position_embeddings"] = int(scaling.pop("original_context_length"))
    return {"rope_type": kind, **scaling}


class GGUFCheckpoint:
    """TensorSource over one .gguf file; `config` is the ModelConfig from its metadata."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._reader = GGUFReader(self.path)
        except Exception as e:  # the reader raises raw ValueError/IndexError/KeyError on damaged files
            raise CheckpointError(f"{self.path}: truncated or not a GGUF file ({type(e).__name__}: {one_line(e)})") from None
        size = self.path.stat().st_size
        self._tensors: dict[str, ReaderTensor] = {}
        self._unmapped: list[str] = []               # GGUF tensors with no HF counterpart (reported as unused)
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes < t.n_bytes:
                raise CheckpointError(f"{self.path}: truncated: tensor {t.name} ends at byte "
                                      f"{t.data_offset + t.n_bytes} but the file has {size} bytes")
            name = hf_name(t.name)
            if name is not None:
                self._tensors[name] = t
            elif t.name != "rope_freqs.weight":      # checked below to be the identity
                self._unmapped.append(t.name)
        self._meta = self._reader.fields
        try:
            self.config = self._read_config()
        except ConfigError as e:
            raise ConfigError(f"{self.path}: {e}") from None
        freqs = next((t for t in self._reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None and not np.all(self._dequant(freqs) == 1.0):
            raise CheckpointError(f"{self.path}: unsupported rope_freqs tensor (llama3 rope scaling baked in by "
                                  f"llama.cpp); use the Hugging Face checkpoint")

    def _value(self, key: str, default=None):
        field = self._meta.get(key)
        if field is None:
            return default
        return field.contents()

    def _require(self, key: str):
        value = self._value(key)
        if value is None:
            raise CheckpointError(f"{self.path}: GGUF metadata is missing {key}")
        return value

    def _read_config(self) -> ModelConfig:
        arch = self._value("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise CheckpointError(f"{self.path}: unsupported GGUF architecture {arch!r} "
                                  f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        if int(self._value(f"{arch}.expert_count", 0) or 0) > 0:
            raise ConfigError(f"unsupported model: mixture-of-experts layers "
                              f"({arch}.expert_count={self._value(f'{arch}.expert_count')})")
        hidden = int(self._require(f"{arch}.embedding_length"))
        n_heads = int(self._require(f"{arch}.attention.head_count"))
        if "model.embed_tokens.weight" in self._tensors:
            vocab = self.shape("model.embed_tokens.weight")[0]
        else:
            tokens = self._meta.get("tokenizer.ggml.tokens")
            vocab = self._value(f"{arch}.vocab_size", len(tokens.data) if tokens is not None else None)
        if vocab is None:
            raise CheckpointError(f"{self.path}: no token_embd.weight tensor and no vocabulary size in metadata")
        eos = [self._value(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        bos = self._value("tokenizer.ggml.bos_token_id")
        return ModelConfig(
            arch=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._require(f"{arch}.feed_forward_length")),
            num_layers=int(self._require(f"{arch}.block_count")),
            num_heads=n_heads,
            num_kv_heads=int(self._value(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=int(self._value(f"{arch}.attention.key_length", hidden // n_heads)),
            rms_norm_eps=_float32_str(self._value(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=_float32_str(self._value(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(self._value(f"{arch}.context_length", 4096)),
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            rope_scaling=_rope_scaling(self._meta, arch),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=list(dict.fromkeys(int(e) for e in eos if e is not None)),
            source_dtype=self._main_type(),
        ).validate()

    def _main_type(self) -> str:
        """Most common matrix type: float32 | float16 | bfloat16 | q4_1, q8_0, ..."""
        types = [t.tensor_type.name for t in self._tensors.values() if len(t.shape) > 1]
        main = max(set(types), key=types.count) if types else "F32"
        return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(main, main.lower())

    def names(self) -> list[str]:
        """HF names of the tensors the reader maps, then the GGUF names of those it cannot (never usable)."""
        return list(self._tensors) + self._unmapped

    def origin(self, name: str) -> str:
        """The tensor's name in the GGUF file."""
        t = self._tensors.get(name)
        return t.name if t is not None else name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensor(name).shape.tolist()))

    def get(self, name: str) -> np.ndarray:
        w = self._dequant(self._tensor(name))
        if self.config.arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = self.config.num_heads if ".q_proj." in name else self.config.num_kv_heads
            w = unpermute_rows(w, heads)
        return np.ascontiguousarray(w, dtype=np.float32)

    def _dequant(self, t: ReaderTensor) -> np.ndarray:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise CheckpointError(f"{self.path}: tensor {t.name} has unsupported GGUF type {t.tensor_type.name}") from None
        return np.array(w, dtype=np.float32).reshape(shape)

    def _tensor(self, name: str) -> ReaderTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{name}: missing from checkpoint {self.path}") from None

"""Model configuration: ModelConfig (a plain dataclass), read from a Hugging Face config.json (here) or GGUF
metadata (checkpoint/gguf_reader.py); unsupported architectures and fields are refused in one line."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from xserv_aot.config import ConfigError

SUPPORTED_ARCHS = ("qwen3", "qwen2", "llama")
HF_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}


@dataclass
class ModelConfig:
    arch: str                      # qwen3 | qwen2 | llama
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None   # llama3: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    source_dtype: str = "float32"      # dtype of the checkpoint tensors (informational)

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def validate(self) -> "ModelConfig":
        if self.arch not in SUPPORTED_ARCHS:
            raise ConfigError(f"unsupported architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ("llama3", "default", None):
            raise ConfigError(f"unsupported rope_scaling type {self.rope_scaling.get('rope_type')!r} (supported: llama3)")
        return self


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in (x if isinstance(x, (list, tuple)) else [x])]


def model_config_from_hf(cfg: dict) -> ModelConfig:
    """Map a Hugging Face config.json dict onto ModelConfig, refusing what is unsupported with one line."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    arch = None
    for a in archs:
        if a in HF_ARCHITECTURES:
            arch = HF_ARCHITECTURES[a]
    if arch is None and model_type in SUPPORTED_ARCHS and not archs:
        arch = model_type
    if arch is None:
        what = ", ".join(archs) if archs else f"model_type {model_type!r}"
        raise ConfigError(f"unsupported architecture: {what} (supported: {', '.join(HF_ARCHITECTURES)})")
    if any(k in cfg and cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ConfigError("unsupported model: mixture-of-experts layers")
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise ConfigError(f"unsupported model: sliding window attention (sliding_window={cfg.get('sliding_window')})")
    if arch in ("llama", "qwen3") and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ConfigError(f"unsupported model: {arch} with attention_bias/mlp_bias")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported activation {cfg.get('hidden_act')!r} (supported: silu)")
    text = cfg.get("text_config")
    if text:
        raise ConfigError("unsupported model: multimodal config (text_config)")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // num_heads
    rope_scaling = cfg.get("rope_scaling")
    rope_theta = cfg.get("rope_theta")
    rope_params = cfg.get("rope_parameters")  # transformers >= 5 stores theta/scaling here
    if rope_params:
        rope_theta = rope_theta or rope_params.get("rope_theta")
        if rope_params.get("rope_type") not in (None, "default"):
            rope_scaling = rope_params
    if rope_scaling is not None:
        rope_scaling = dict(rope_scaling)
        rope_scaling["rope_type"] = rope_scaling.get("rope_type") or rope_scaling.get("type")
        if rope_scaling["rope_type"] == "default":
            rope_scaling = None
    try:
        return ModelConfig(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_list(cfg.get("eos_token_id")),
            source_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        ).validate()
    except KeyError as e:
        raise ConfigError(f"config.json is missing field {e.args[0]!r}") from None


def read_hf_config(model_dir: Path) -> ModelConfig:
    """model_dir: a Hugging Face model directory, or a config.json file itself."""
    model_dir = Path(model_dir)
    path = model_dir if model_dir.is_file() else model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json (expected a Hugging Face model directory or a .gguf file)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return model_config_from_hf(cfg)

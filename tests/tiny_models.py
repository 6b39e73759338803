"""Tiny random Hugging Face models (qwen3 / qwen2 / llama) saved with save_pretrained, for tests."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

ARCH_CLASSES = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def _classes(arch: str):
    import transformers

    prefix = ARCH_CLASSES[arch]
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.15) -> None:
    """Weights large enough that logits differ per token: linears/embeddings N(0, std), norms ~1 +- 0.2, biases N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=g) * 2 - 1))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def make_tiny_model(out_dir: Path, arch: str, *, sharded: bool = False, dtype: str = "float32", tie: bool = False,
                    seed: int = 0, **overrides) -> Path:
    """Save a tiny random `arch` model into out_dir (created) and return out_dir.

    overrides go to the transformers config, e.g. rope_scaling=LLAMA3_ROPE or num_hidden_layers=3.
    """
    config_cls, model_cls = _classes(arch)
    kwargs = {**TINY, "tie_word_embeddings": tie, **copy.deepcopy(overrides)}  # transformers edits rope dicts
    if arch == "qwen2":
        kwargs.setdefault("use_sliding_window", False)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_(model, seed)
    if tie:
        model.tie_weights()
    model = model.to(getattr(torch, dtype))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size="60KB" if sharded else "10GB")
    return out_dir


def load_hf_model(path: Path) -> torch.nn.Module:
    """The saved model, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32).eval()


E2E_BUILD = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[16, 64], max_seq_len=256, block_size=4,
                 dtype="float32", target="cpu")


def make_plan(root, num_blocks: int):
    """The e2e tiny Qwen3 (2 layers, vocab 151936) with the real Qwen3 tokenizer, compiled for the CPU into
    root/plan{num_blocks}; the model and tokenizer stay in root/hf. Skips when the tokenizer asset is missing."""
    import shutil

    from tests.conftest import ASSETS, ensure_qwen3_tokenizer
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    ensure_qwen3_tokenizer()
    hf = root / "hf"
    if not hf.exists():
        make_tiny_model(hf, "qwen3", seed=7, vocab_size=151936, num_hidden_layers=2, bos_token_id=151643,
                        eos_token_id=151645)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(ASSETS / "qwen3-tokenizer" / f, hf / f)
    out = root / f"plan{num_blocks}"
    compile_plan(hf, out, BuildConfig(**E2E_BUILD, num_blocks=num_blocks))
    return out

"""Rebuild a HF `tokenizers.Tokenizer` from the tokenizer metadata embedded in a GGUF file.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`, used by SmolLM2, Qwen, Llama 3)
are supported; sentencepiece ("llama") vocabularies are refused with a TokenizerError.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from xserv_aot.tokenizer import TokenizerError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token_type values

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_pre(pattern: str):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# tokenizer.ggml.pre -> (normalizer factory or None, pre-tokenizer factory); mirrors each model's own tokenizer.json
_PRE_TOKENIZERS = {
    "default": (None, _gpt2_pre),
    "gpt-2": (None, _gpt2_pre),
    "gpt2": (None, _gpt2_pre),
    "smollm": (None, lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])),
    "qwen2": (normalizers.NFC, lambda: _split_pre(_QWEN2_SPLIT)),
    "deepseek-r1-qwen": (normalizers.NFC, lambda: _split_pre(_QWEN2_SPLIT)),
    "llama-bpe": (None, lambda: _split_pre(_LLAMA3_SPLIT)),
    "llama3": (None, lambda: _split_pre(_LLAMA3_SPLIT)),
    "llama-v3": (None, lambda: _split_pre(_LLAMA3_SPLIT)),
}


# llama.cpp's LLAMA3 pre-tokenizer group: a pre-token that is itself in the vocabulary is one token (merges are not
# applied to it), and BOS is added unless tokenizer.ggml.add_bos_token says otherwise (llama-vocab.cpp).
_LLAMA3_GROUP = ("llama-bpe", "llama3", "llama-v3")


def read_gguf_tokenizer_fields(path: Path) -> dict[str, Any]:
    """All `tokenizer.*` metadata of a GGUF file as plain Python values."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"{path}: GGUF file not found")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is bad input
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TokenizerError(f"{path}: not a readable GGUF file ({detail})") from None
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def build_gguf_tokenizer(path: Path) -> tuple[Backend, dict[str, Any]]:
    """(backend tokenizer, tokenizer_config-style dict) for the GGUF at `path`."""
    path = Path(path)
    meta = read_gguf_tokenizer_fields(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise TokenizerError(f"{path}: GGUF has no tokenizer.ggml.model metadata")
    if kind != "gpt2":
        raise TokenizerError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2' byte-level BPE)")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise TokenizerError(f"{path}: GGUF lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        known = ", ".join(sorted(_PRE_TOKENIZERS))
        raise TokenizerError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported (known: {known})")

    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    llama3 = pre in _LLAMA3_GROUP
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=llama3))
    make_norm, make_pre = _PRE_TOKENIZERS[pre]
    if make_norm is not None:
        backend.normalizer = make_norm()
    backend.pre_tokenizer = make_pre()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == USER_DEFINED])

    def token_of(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise TokenizerError(f"{path}: tokenizer.ggml.{key} = {i} is outside the vocabulary of {len(tokens)}")
        return tokens[int(i)]

    config: dict[str, Any] = {
        "bos_token": token_of("bos_token_id"),
        "eos_token": token_of("eos_token_id"),
        "unk_token": token_of("unknown_token_id"),
        "pad_token": token_of("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", llama3)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
        "eos_token_ids": [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                          if k in meta],
    }
    return backend, config

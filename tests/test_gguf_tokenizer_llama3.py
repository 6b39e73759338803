"""GGUF vocabularies in llama.cpp's LLAMA3 pre-tokenizer group (llama-bpe, llama3, llama-v3): a pre-token that is
itself a vocabulary entry is one token even when the merges would split it (ignore_merges), and BOS is added
unless tokenizer.ggml.add_bos_token says otherwise; other byte-level vocabularies keep plain BPE and no BOS."""
from __future__ import annotations

import gguf
import pytest

from xserv_aot.tokenizer import Tokenizer


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the rest map to U+0100 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def write_vocab(path, pre: str, add_bos: bool | None):
    tokens = byte_alphabet() + ["ab", "abc", "<|bos|>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(["a b"])                                   # no merge makes "abc"
    w.add_bos_token_id(len(tokens) - 1)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


@pytest.mark.parametrize("pre", ["llama-bpe", "llama3", "llama-v3"])
def test_llama3_group_ignores_merges_and_adds_bos(tmp_path, pre):
    tokens = write_vocab(tmp_path / "v.gguf", pre, add_bos=None)
    tok = Tokenizer.from_gguf(tmp_path / "v.gguf")
    abc, ab, c, bos = tokens.index("abc"), tokens.index("ab"), tokens.index("c"), tokens.index("<|bos|>")
    assert tok.encode("abc", add_special_tokens=False) == [abc]
    assert tok.encode("abcc", add_special_tokens=False) == [ab, c, c]   # not in the vocabulary: merges apply
    assert tok.encode("abc") == [bos, abc]


def test_metadata_add_bos_wins(tmp_path):
    write_vocab(tmp_path / "v.gguf", "llama-bpe", add_bos=False)
    tok = Tokenizer.from_gguf(tmp_path / "v.gguf")
    assert tok.encode("abc") == tok.encode("abc", add_special_tokens=False)


@pytest.mark.parametrize("pre", ["gpt2", "qwen2", "smollm"])
def test_other_vocabularies_keep_merges_and_no_bos(tmp_path, pre):
    tokens = write_vocab(tmp_path / "v.gguf", pre, add_bos=None)
    tok = Tokenizer.from_gguf(tmp_path / "v.gguf")
    assert tok.encode("abc") == [tokens.index("ab"), tokens.index("c")]

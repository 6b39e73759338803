"""Tokens that hold part of a multi-byte character: logprobs carry their real bytes, completions' text_offset
matches the text, and text cut mid-character is held back instead of ending in U+FFFD. References: HF
transformers' byte-level alphabet and decode."""
from __future__ import annotations

import pytest

from tests.test_tokenizer import assets, qwen  # noqa: F401  (fixtures)
from xserv_aot.detokenizer import IncrementalDetokenizer
from xserv_aot.engine.api import TokenLogprob
from xserv_aot.server.responses import TokenText, chat_logprobs, completion_logprobs

TEXT = "Cửa Việt 😀 你好 ok 🇯🇵 x\ufffdy"


def hf_bytes(hf, tid: int) -> bytes:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    tok = hf.convert_ids_to_tokens(tid)
    if tid in hf.added_tokens_decoder:
        return tok.encode()
    return bytes(decoder[c] for c in tok)


def token_text(ours) -> TokenText:
    return TokenText(lambda t: ours.decode([t], skip_special_tokens=False), ours.token_bytes,
                     lambda ids: ours.decode(ids, skip_special_tokens=True))


def test_token_bytes_are_real(qwen):  # noqa: F811
    ours, hf = qwen
    ids = ours.encode(TEXT, add_special_tokens=False)
    partial = [t for t in ids if "\ufffd" in ours.decode([t]) and hf_bytes(hf, t) != "\ufffd".encode()]
    assert partial, "the sample must have tokens holding part of a character"
    for t in [*ids, *range(0, ours.vocab_size, 997), *hf.added_tokens_decoder]:
        assert ours.token_bytes(t) == hf_bytes(hf, t), t
    assert b"".join(ours.token_bytes(t) for t in ids) == TEXT.encode()
    lps = [TokenLogprob(t, -0.5, [(t, -0.5)]) for t in ids]
    content = chat_logprobs(lps, token_text(ours))["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == TEXT.encode()
    assert all(bytes(c["top_logprobs"][0]["bytes"]) == hf_bytes(hf, t) for c, t in zip(content, ids))


@pytest.mark.parametrize("split", [1, 5, 9])
def test_completion_text_offsets_match_the_text(qwen, split):  # noqa: F811
    ours, hf = qwen
    ids = ours.encode(TEXT, add_special_tokens=False)
    text = hf.decode(ids)
    assert text == TEXT
    lps = [TokenLogprob(t, -0.5, []) for t in ids]
    first = completion_logprobs(lps[:split], token_text(ours), [])              # two stream chunks
    second = completion_logprobs(lps[split:], token_text(ours), ids[:split])
    tokens, offsets = first["tokens"] + second["tokens"], first["text_offset"] + second["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(text)
    for t, label, off in zip(ids, tokens, offsets):
        if label.startswith("bytes:"):
            assert hf_bytes(hf, t).decode("utf-8", "ignore") != hf_bytes(hf, t).decode("utf-8", "replace")
        else:
            assert text[off:off + len(label)] == label, (label, off)
    whole = [i for i, lab in enumerate(tokens) if not lab.startswith("bytes:")]
    assert sum(len(tokens[i]) for i in whole) < len(text)                      # some tokens are partial


def test_text_cut_mid_character_is_held_back(qwen):  # noqa: F811
    ours, _ = qwen
    for sample in ("ok 😀", "ok 🇯🇵", "ok 𝔘", "ok 龘"):
        ids = ours.encode(sample, add_special_tokens=False)
        if ours.decode(ids[:-1]).endswith("\ufffd"):                           # its last character spans tokens
            break
    else:
        pytest.fail("no sample ends in a character split across tokens")
    whole = ours.decode(ids[:-1]).rstrip("\ufffd")
    genuine = ours.encode("a\ufffd", add_special_tokens=False)
    for cut, want in ((ids[:-1], whole), (ids, sample), (genuine, "a\ufffd")):
        d = IncrementalDetokenizer(ours)
        text = "".join(d.add(t) for t in cut) + d.flush()
        assert text == want


def test_ids_past_the_vocabulary_have_no_bytes(qwen):  # noqa: F811
    """Models pad the embedding past the tokenizer's vocabulary (Qwen3: 151936 rows, 151669 tokens)."""
    ours, _ = qwen
    beyond = ours.vocab_size + 5
    assert ours.decode([beyond]) == "" and ours.token_bytes(beyond) == b""
    lps = [TokenLogprob(beyond, -1.0, [(beyond, -1.0)])]
    assert chat_logprobs(lps, token_text(ours))["content"][0]["bytes"] == []
    assert completion_logprobs(lps, token_text(ours), [])["tokens"] == [""]

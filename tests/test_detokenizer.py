"""IncrementalDetokenizer: streamed deltas concatenate to the full decode and never split a character."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from xserv_aot.detokenizer import IncrementalDetokenizer
from xserv_aot.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "build" / "assets"
QWEN_DIR = ASSETS / "qwen3-tokenizer"
GGUF = ASSETS / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
FFFD = "\ufffd"

TEXT_POOLS = ["Hello world, ", "  spaced\tout\n", "你好世界，今天", "漢字テキスト", "😀👍🏽👨‍👩‍👧‍👦", "🇯🇵❤️",
              "é ñ ß ", "def f(x):\n    return x\n", "12345 ", "<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    if not (QWEN_DIR / "tokenizer.json").is_file() or not GGUF.is_file():
        try:
            r = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_assets.sh")], capture_output=True, text=True,
                               env=dict(os.environ, PYTHON=sys.executable), timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"fetch_assets.sh failed: {e}")
        if r.returncode != 0 or not GGUF.is_file():
            pytest.skip(f"fetch_assets.sh failed: {(r.stderr or r.stdout).strip()[-300:]}")
    return {"qwen": Tokenizer.from_dir(QWEN_DIR), "smol": Tokenizer.from_gguf(GGUF)}


@pytest.fixture
def rng() -> random.Random:
    seed = random.SystemRandom().randrange(2**32)
    print(f"random seed {seed}")
    return random.Random(seed)


def gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_ids(tok: Tokenizer) -> dict[int, int]:
    """Byte -> id of its single-byte token, for the bytes the vocabulary has (SmolLM2 lacks a few)."""
    ids = {b: tok.token_to_id(c) for b, c in gpt2_byte_chars().items()}
    ids = {b: i for b, i in ids.items() if i is not None}
    assert all(b in ids for b in range(0x80, 0xF1) if b not in (0xC0, 0xC1)), "UTF-8 bytes up to 4-byte leads F0"
    return ids


def split_char_ids(tok: Tokenizer, rng: random.Random) -> list[int]:
    """Valid text as ids, where some pieces are spelled byte by byte so multi-byte characters span tokens."""
    by_byte = byte_ids(tok)
    ids: list[int] = []
    for _ in range(rng.randint(3, 12)):
        piece = rng.choice(TEXT_POOLS)
        if rng.random() < 0.5 and all(b in by_byte for b in piece.encode("utf-8")):
            ids += [by_byte[b] for b in piece.encode("utf-8")]
        else:
            ids += tok.encode(piece, add_special_tokens=False)
    return ids


def stream(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    """Deltas, checking after every token that the emitted text is exactly the complete part of the decode."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas: list[str] = []
    for k, i in enumerate(ids, 1):
        deltas.append(detok.add(i))
        emitted, so_far = "".join(deltas), tok.decode(ids[:k], skip_special_tokens=skip)
        assert so_far.startswith(emitted), (ids[:k], emitted, so_far)
        if not so_far.endswith(FFFD):
            assert emitted == so_far, (ids[:k], emitted, so_far)
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("which", ["qwen", "smol"])
@pytest.mark.parametrize("skip", [True, False])
def test_split_characters_never_emit_replacement(tokenizers, which, skip, rng):
    tok = tokenizers[which]
    for _ in range(20):
        ids = split_char_ids(tok, rng)
        full = tok.decode(ids, skip_special_tokens=skip)
        assert FFFD not in full
        deltas = stream(tok, ids, skip)
        assert not any(FFFD in d for d in deltas)
        assert "".join(deltas) == full


@pytest.mark.parametrize("which", ["qwen", "smol"])
@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_concatenate_to_full_decode(tokenizers, which, skip, rng):
    tok = tokenizers[which]
    by_byte = list(byte_ids(tok).values())
    specials = sorted(tok.all_special_ids)
    for _ in range(20):
        ids = [rng.choice((rng.randrange(tok.vocab_size), rng.choice(by_byte), rng.choice(specials)))
               for _ in range(rng.randint(1, 40))]
        full = tok.decode(ids, skip_special_tokens=skip)
        deltas = stream(tok, ids, skip)
        assert "".join(deltas) == full
        if FFFD not in full:
            assert not any(FFFD in d for d in deltas)


@pytest.mark.parametrize("which", ["qwen", "smol"])
def test_incomplete_tail_is_held_then_flushed(tokenizers, which):
    tok = tokenizers[which]
    by_byte = byte_ids(tok)
    head = tok.encode("ok ", add_special_tokens=False)
    tail = [by_byte[b] for b in "你".encode("utf-8")[:2]]
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.add(i) for i in head)
    assert out == tok.decode(head)
    assert [detok.add(i) for i in tail] == ["", ""]
    rest = detok.flush()
    assert out + rest == tok.decode(head + tail)
    assert rest.endswith(FFFD)
    assert detok.flush() == ""

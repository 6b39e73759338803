"""Text-level helpers of the tokenizer: where special-token text sits inside rendered chat messages (so it can be
encoded as plain text), and byte-level BPE's byte alphabet (a token's real bytes)."""
from __future__ import annotations

import re

from xserv_aot.errors import XservError

REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")    # where messages carry reasoning text


class SpecialTextError(XservError, ValueError):
    """Chat content whose special-token text cannot be kept as text; one line."""


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet, inverted: printable Latin-1 bytes stand for themselves, the other bytes for
    U+0100 onwards in byte order (GPT-2's mapping, used by every byte-level tokenizer)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


BYTE_DECODER = _byte_decoder()


def message_strings(messages: list[dict]):
    """Every text a message carries into the template: content (or its text parts) and reasoning."""
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        parts = content if isinstance(content, list) else [content]
        for p in parts:
            text = p.get("text") if isinstance(p, dict) else p
            if isinstance(text, str) and text:
                yield text
        for k in REASONING_KEYS:
            if isinstance(m.get(k), str) and m[k]:
                yield m[k]


def special_pattern(specials: list[str]) -> re.Pattern | None:
    """One alternation of the special tokens' texts, longest first (None: there are none)."""
    specials = sorted(set(specials), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, specials))) if specials else None


def special_text_spans(text: str, messages: list[dict], pattern: re.Pattern | None) -> list[tuple[int, int]]:
    """Where the rendered text holds message strings that contain special-token text, in order."""
    if pattern is None:
        return []
    spans, pos = [], 0
    for i, s in enumerate(message_strings(messages)):
        hit = pattern.search(s)
        if hit is None:
            continue
        at = text.find(s, pos)
        if at < 0:
            raise SpecialTextError(f"chat message {i}: its content holds special-token text ({hit.group()!r}) that the "
                                   f"chat template rewrites, so it cannot be kept as plain text")
        spans.append((at, at + len(s)))
        pos = at + len(s)
    return spans

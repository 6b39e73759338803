"""Streaming detokenization: turn generated token ids into text deltas that never split a character.

Offsets into `ids` (invariant: prefix_offset <= read_offset <= len(ids)):
  ids[:read_offset]                  already emitted as text
  ids[prefix_offset:read_offset]     context window decoded again so that context-dependent decoding
                                     (byte-level spaces, sentencepiece leading space) matches a full decode
A delta is released only when the decoded window does not end in U+FFFD, i.e. no multi-byte character is
still waiting for its remaining bytes. `flush` releases the rest, except a character the ids end in the middle of.
"""
from __future__ import annotations

import codecs

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted_chars = 0

    def _pending(self) -> tuple[str, str]:
        """(decoded context window, decoded window + unreleased ids)."""
        window = self.ids[self._prefix_offset:self._read_offset]
        prefix = self._tokenizer.decode(window, skip_special_tokens=self._skip) if window else ""
        full = self._tokenizer.decode(self.ids[self._prefix_offset:], skip_special_tokens=self._skip)
        return prefix, full

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly "")."""
        self.ids.append(int(token_id))
        prefix, full = self._pending()
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT) or not full.startswith(prefix):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self._emitted_chars += len(full) - len(prefix)
        return full[len(prefix):]

    def flush(self) -> str:
        """Release everything not yet emitted, except a character whose bytes the ids end in the middle of (cut by
        max_tokens or EOS: never completed, so never shown as U+FFFD) when the tokenizer can tell (token_bytes)."""
        if self._read_offset == len(self.ids):
            return ""
        text = self._tokenizer.decode(self.ids, skip_special_tokens=self._skip)
        if text.endswith(REPLACEMENT) and self._ends_mid_character():
            text = text[:-1]
        self._prefix_offset = self._read_offset = len(self.ids)
        delta = text[self._emitted_chars:]
        self._emitted_chars = len(text)
        return delta

    def _ends_mid_character(self) -> bool:
        token_bytes = getattr(self._tokenizer, "token_bytes", None)
        return token_bytes is not None and ends_mid_character(token_bytes, self.ids[self._read_offset:])


def ends_mid_character(token_bytes, ids: list[int]) -> bool:
    """Whether the bytes of ids end inside a UTF-8 character (its remaining bytes would come from later tokens)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(b"".join(token_bytes(i) for i in ids), final=False)
    return bool(decoder.getstate()[0])

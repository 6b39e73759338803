"""The text side of one request: incremental detokenization and stop strings (held back while they may match).

One home for the rule that turns a token plus its id-level finish ("stop": EOS or a stop token id, "length",
or None) into a text delta and the final finish reason. The in-process engine and the API process of the engine
core process (which sees only ids from the core) both use it.
"""
from __future__ import annotations

import asyncio

from xserv_aot.engine.api import RequestOutput


class TextOutput:
    def __init__(self, detokenizer, stops: list[str], stop_ids: frozenset[int] | None = None):
        """stop_ids: the tokens (EOS, stop_token_ids) not detokenized when they end the request with "stop"; another
        token ending it so (a grammar's last) is text. None: every token ending it with "stop" is a stop token."""
        self.detokenizer = detokenizer
        self.stops = [s for s in stops if s]
        self.stop_ids = stop_ids
        self._held = ""                              # text that may be the start of a stop string

    def step(self, token: int, id_finish: str | None) -> tuple[str, str | None]:
        """(text delta, finish reason) for a new token. A stop token is not detokenized; a stop string ends the
        request at once and its text (and anything after it) is never returned."""
        if id_finish == "stop" and (self.stop_ids is None or token in self.stop_ids):
            return self.flush(), "stop"
        text, hit = self.feed(self.detokenizer.add(token) if self.detokenizer is not None else "")
        if hit:
            return text, "stop"
        if id_finish is not None:
            text += self.flush()
        return text, id_finish

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add detokenized text; return (text safe to emit, stop string hit). Stop text itself is never emitted."""
        buf = self._held + delta
        if not self.stops:
            self._held = ""
            return buf, False
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[:min(hits)], True
        hold = 0
        for k in range(min(len(buf), max(len(s) for s in self.stops) - 1), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.stops):
                hold = k
                break
        self._held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        """At finish (not by stop string): release held text plus whatever the detokenizer still buffers."""
        tail = self.detokenizer.flush() if self.detokenizer is not None else ""
        text, hit = self.feed(tail)
        if not hit:
            text += self._held
        self._held = ""
        return text


class RequestStream:
    """The API process's side of one request of the engine core process: its asyncio queue and its text."""

    def __init__(self, loop: asyncio.AbstractEventLoop, detokenizer, stops: list[str],
                 stop_ids: frozenset[int] | None = None):
        self.loop, self.queue = loop, asyncio.Queue()
        self.text = TextOutput(detokenizer, stops, stop_ids)
        self.done = False

    def process(self, w) -> tuple[RequestOutput, bool]:
        """The RequestOutput for one core output (messages.WireOutput); True when a stop string ended it here
        (the core still runs it)."""
        tokens, reason, text, stopped_here = w.new_token_ids, None, "", False
        for j, tok in enumerate(w.new_token_ids):
            last = j == len(w.new_token_ids) - 1
            delta, reason = self.text.step(tok, w.finish_reason if last and w.finish_reason in ("stop", "length")
                                           else None)
            text += delta
            if reason is not None:
                tokens, stopped_here = w.new_token_ids[:j + 1], not last or w.finish_reason is None
                break
        reason = reason or w.finish_reason
        dropped = len(w.new_token_ids) - len(tokens)
        lps = w.logprobs[:len(tokens)] if w.logprobs is not None else None
        self.done = reason is not None
        return RequestOutput(w.request_id, tokens, text, reason, lps, w.num_prompt_tokens,
                             w.num_generated_tokens - dropped, w.num_cached_tokens, w.error), stopped_here

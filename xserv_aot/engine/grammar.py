"""Structured decoding with llguidance: a GuidedDecoding spec -> a grammar, compiled once and cached, one
matcher per sequence that yields the allowed-token mask for the next step and consumes each sampled token.

JSON is generated compact (no free whitespace between tokens: a model cannot stall in endless newlines).
The mask is over the model's vocabulary V (logits width); ids the tokenizer does not know are never allowed.
Bitmask layout (llguidance's, and the device op's): int32 [ceil(V / 32)], bit j of word w allows id 32 w + j.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np

from xserv_aot.engine.api import GuidedDecoding, InvalidRequestError

JSON_OPTIONS = {"whitespace_flexible": False}
KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CACHED = 256


def grammar_text(g: GuidedDecoding) -> str:
    """The llguidance grammar for g (not yet checked against a tokenizer); InvalidRequestError on bad input."""
    import llguidance as llg
    from llguidance import LLMatcher

    if g.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if g.kind == "json":
        try:
            return LLMatcher.grammar_from_json_schema(g.spec, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise InvalidRequestError(_unusable(g, e)) from None
    if g.kind == "regex":
        return LLMatcher.grammar_from_regex(g.spec)
    if g.kind == "choice":
        choices = json.loads(g.spec)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if g.kind == "grammar":
        try:
            return llg.grammar_from("grammar", g.spec)
        except ValueError as e:
            raise InvalidRequestError(_unusable(g, e)) from None
    raise InvalidRequestError(f"unknown structured output kind {g.kind!r} (one of {', '.join(KINDS)})")


def check_syntax(g: GuidedDecoding) -> None:
    """InvalidRequestError when g cannot be compiled (checked without a tokenizer: the server does this)."""
    from llguidance import LLMatcher

    err = LLMatcher.validate_grammar(grammar_text(g))
    if err and not err.startswith("WARNING"):
        raise InvalidRequestError(_unusable(g, err))


def _unusable(g: GuidedDecoding, err) -> str:
    what = {"json": "JSON schema", "json_object": "JSON object constraint"}.get(g.kind, g.kind)
    return f"the {what} is not usable: {_line(err)}"


def _line(e, n: int = 300) -> str:
    text = " ".join(str(e).split())
    return text[:n]


class GrammarError(RuntimeError):
    """A sequence's matcher failed (parser limits, internal error): that request ends with an error."""


class GrammarCompiler:
    """Thread-safe: the server thread compiles (check_request), the engine thread makes matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self._ll_tokenizer = None
        self._cache: OrderedDict[GuidedDecoding, object] = OrderedDict()    # spec -> template LLMatcher
        self._lock = threading.Lock()

    def _llt(self):
        import llguidance as llg

        if self._ll_tokenizer is None:
            backend = getattr(self.tokenizer, "_backend", None)
            if backend is None:
                raise InvalidRequestError("structured outputs need the model's tokenizer")
            self._ll_tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                 eos_token=self.eos_token_ids or None)
        return self._ll_tokenizer

    def _template(self, g: GuidedDecoding):
        from llguidance import LLMatcher

        with self._lock:
            hit = self._cache.get(g)
            if hit is not None:
                self._cache.move_to_end(g)
                return hit
            m = LLMatcher(self._llt(), grammar_text(g), log_level=0)
            if m.is_error():
                raise InvalidRequestError(_unusable(g, m.get_error()))
            self._cache[g] = m
            if len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
            return m

    def check(self, g: GuidedDecoding) -> None:
        self._template(g)

    def matcher(self, g: GuidedDecoding) -> "Matcher":
        return Matcher(self._template(g).deep_copy(), self.vocab_size)


class Matcher:
    """One sequence's grammar state."""

    def __init__(self, m, vocab_size: int):
        self._m, self.vocab_size = m, vocab_size
        self.bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def fill(self, words: np.ndarray) -> None:
        """Write the next-token bitmask into words (int32 [ceil(V / 32)], contiguous); GrammarError when the
        matcher failed or allows nothing."""
        assert words.dtype == np.int32 and words.flags["C_CONTIGUOUS"] and words.size == self.bitmask.size
        self._m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if self._m.is_error() or not words.any():
            raise GrammarError(f"structured output failed: {_line(self._m.get_error() or 'no token allowed')}")

    def allowed(self) -> np.ndarray:
        """bool [V]: the ids the grammar allows next (EOS only where the grammar may end)."""
        self.fill(self.bitmask)
        return unpack_bitmask(self.bitmask, self.vocab_size)

    def consume(self, token_id: int) -> None:
        if not self._m.consume_token(int(token_id)):
            raise RuntimeError(f"grammar refused sampled token {token_id}: {_line(self._m.get_error())}")

    @property
    def is_stopped(self) -> bool:
        """Nothing can follow: the sequence is complete."""
        return self._m.is_stopped()


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


def stage_masks(out, words: int) -> None:
    """The grammar masks of the rows of out.batch (a SchedulerOutput's) sampled on the device this step, into the
    batch; nothing when no row has one. A failed matcher sets its sequence's error (postprocess ends it)."""
    rows = [i for i, seq in enumerate(out.seqs) if out.samples[i] and seq.matcher is not None
            and not seq.needs_host_sampling]
    if not rows:
        return
    b = out.batch
    b.bitmask_rows = [0] * b.num_seqs
    b.token_bitmask = np.full((b.num_seqs, words), -1, dtype=np.int32)
    for i in rows:
        try:
            out.seqs[i].matcher.fill(b.token_bitmask[i])
            b.bitmask_rows[i] = 1
        except GrammarError as e:
            out.seqs[i].error = str(e)


def allowed_ids(seq, vocab_size: int, eos_token_ids) -> np.ndarray | None:
    """bool [V] mask of the ids a host-sampled sequence may take next (grammar, min_tokens), None when all may.
    min_tokens masks EOS and stop_token_ids, unless the grammar can only end here."""
    p = seq.params
    allowed = seq.matcher.allowed() if seq.matcher is not None else None
    if seq.num_known_output_tokens < p.min_tokens:
        if allowed is None:
            allowed = np.ones(vocab_size, dtype=bool)
        banned = [t for t in (*eos_token_ids, *p.stop_token_ids) if t < len(allowed)]
        saved = allowed.copy()
        allowed[banned] = False
        if not allowed.any():
            allowed = saved
    return allowed

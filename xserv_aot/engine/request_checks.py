"""What the engine refuses before a request is queued (one line each): prompt ids, SamplingParams bounds (their
values live in engine/api.py), logit_bias, min_tokens, length limits, and grammars the tokenizer cannot compile.
Used by the in-process engine and by the API side of the engine core process."""
from __future__ import annotations

import numpy as np

from xserv_aot.config import BuildConfig
from xserv_aot.engine.api import (LOGIT_BIAS_RANGE, MAX_LOGPROBS, MAX_STOP, PENALTY_RANGE, REPETITION_PENALTY_RANGE,
                                  TEMPERATURE_RANGE, InvalidRequestError, RequestTooLongError, SamplingParams)
from xserv_aot.engine.grammar import GrammarCompiler


def check_guided(params: SamplingParams, grammars: GrammarCompiler) -> None:
    """InvalidRequestError when params.guided cannot be compiled for this tokenizer (compiled once, cached)."""
    if params.guided is not None:
        if grammars.tokenizer is None or not grammars.vocab_size:
            raise InvalidRequestError("structured outputs need the model's tokenizer")
        grammars.check(params.guided)


def check_request(prompt_ids: list[int], params: SamplingParams, build: BuildConfig, vocab_size: int | None,
                  can_detokenize: bool = True) -> None:
    """Raise InvalidRequestError / RequestTooLongError (one line) for a request the engine cannot serve."""
    def bad(msg):
        raise InvalidRequestError(msg)
    if not prompt_ids:
        bad("prompt is empty: at least one prompt token is required")
    if any(not isinstance(t, (int, np.integer)) or t < 0 or (vocab_size and t >= vocab_size) for t in prompt_ids):
        bad(f"prompt token ids must be integers in [0, {vocab_size})")
    p = params
    if not isinstance(p.max_tokens, int) or p.max_tokens < 1:
        bad(f"max_tokens must be an integer >= 1, got {p.max_tokens!r}")
    lo, hi = TEMPERATURE_RANGE
    if not lo <= p.temperature <= hi:
        bad(f"temperature must be in [{lo:g}, {hi:g}], got {p.temperature}")
    if not 0 < p.top_p <= 1:
        bad(f"top_p must be in (0, 1], got {p.top_p}")
    if not isinstance(p.top_k, int) or not 0 <= p.top_k < 2**31:
        bad(f"top_k must be an integer in [0, 2**31) (0 = off), got {p.top_k!r}")
    if not 0 <= p.min_p <= 1:
        bad(f"min_p must be in [0, 1], got {p.min_p}")
    lo, hi = REPETITION_PENALTY_RANGE
    if not lo <= p.repetition_penalty <= hi:
        bad(f"repetition_penalty must be in [{lo:g}, {hi:g}], got {p.repetition_penalty}")
    lo, hi = PENALTY_RANGE
    for name in ("presence_penalty", "frequency_penalty"):
        if not lo <= getattr(p, name) <= hi:
            bad(f"{name} must be in [{lo:g}, {hi:g}], got {getattr(p, name)}")
    if p.logprobs is not None and not (isinstance(p.logprobs, int) and 0 <= p.logprobs <= MAX_LOGPROBS):
        bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {p.logprobs!r}")
    if p.seed is not None and not isinstance(p.seed, (int, np.integer)):
        bad(f"seed must be an integer, got {p.seed!r}")
    if len(p.stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in p.stop):
        bad(f"stop must be at most {MAX_STOP} non-empty strings")
    if p.stop and not can_detokenize:
        bad("stop strings need a tokenizer, and this engine has none")
    if not isinstance(p.min_tokens, int) or not 0 <= p.min_tokens <= p.max_tokens:
        bad(f"min_tokens must be an integer in [0, max_tokens], got {p.min_tokens!r}")
    for t, v in p.logit_bias.items():
        if not isinstance(t, (int, np.integer)) or t < 0 or (vocab_size and t >= vocab_size):
            bad(f"logit_bias keys must be token ids in [0, {vocab_size}), got {t!r}")
        lo, hi = LOGIT_BIAS_RANGE
        if not lo <= v <= hi:
            bad(f"logit_bias values must be in [{lo:g}, {hi:g}], got {v!r}")
    n = len(prompt_ids)
    if n + p.max_tokens > build.max_seq_len:
        raise RequestTooLongError(f"prompt has {n} tokens and max_tokens is {p.max_tokens}: {n + p.max_tokens} "
                                  f"exceeds the model's max_seq_len {build.max_seq_len}")
    capacity = build.num_blocks * build.block_size
    if n > capacity:
        raise RequestTooLongError(f"prompt has {n} tokens but the KV cache holds at most {capacity} tokens")

"""OpenAI response bodies: errors, usage, logprobs, full responses and stream chunks (chat and legacy completions)."""
from __future__ import annotations

import math
from typing import Callable

from xserv_aot.engine.api import TokenLogprob

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 431: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "server_error", 504: "server_error"}


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0                   # JSON has no -inf


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprobs(lps: list[TokenLogprob], text_of: Callable[[int], str]) -> dict:
    def entry(tid: int, lp: float) -> dict:
        t = text_of(tid)
        return {"token": t, "logprob": _lp(lp), "bytes": list(t.encode("utf-8"))}
    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, l) for t, l in x.top]}
                        for x in lps]}


def completion_logprobs(lps: list[TokenLogprob], text_of: Callable[[int], str], offset: int) -> dict:
    tokens, offsets = [], []
    for x in lps:
        offsets.append(offset)
        tokens.append(text_of(x.token_id))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [_lp(x.logprob) for x in lps],
            "top_logprobs": [{text_of(t): _lp(l) for t, l in x.top} for x in lps], "text_offset": offsets}


def response(rid: str, created: int, model: str, kind: str, choices: list[dict], usage_: dict) -> dict:
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, "usage": usage_}


def chat_chunk(rid: str, created: int, model: str, delta: dict, logprobs: dict | None = None,
               finish_reason: str | None = None, with_usage: bool = False, index: int = 0) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def completion_chunk(rid: str, created: int, model: str, text: str, logprobs: dict | None = None,
                     finish_reason: str | None = None, with_usage: bool = False, index: int = 0) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, created: int, model: str, kind: str, usage_: dict) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}

"""OpenAI API request parsing/validation and response/chunk builders (chat and legacy completions).

Parsing turns a JSON body into a GenerateRequest or raises RequestError (status, one-line message, param);
unknown fields are ignored, fields that would change the meaning of a request and are unsupported are refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from xserv_aot.engine.api import SamplingParams, TokenLogprob

MAX_STOP = 4
MAX_LOGPROBS = 20
INT64 = 2 ** 63
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 431: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "server_error"}


class RequestError(ValueError):
    """A request the server refuses; becomes an OpenAI error body with this status."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


@dataclass
class GenerateRequest:
    kind: str                                   # "chat" | "completion"
    model: str | None
    stream: bool
    include_usage: bool
    max_tokens: int | None                      # None: up to the context limit
    params: SamplingParams
    messages: list[dict] | None = None          # chat
    chat_template_kwargs: dict = field(default_factory=dict)
    prompt: str | list[int] | None = None       # completions: text or token ids


def _present(body: dict, name: str) -> bool:
    return body.get(name) is not None


def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"'{name}' must be an integer, got {type(v).__name__}", param=name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise RequestError(f"'{name}' must be {bounds}, got {v}", param=name)
    return v


def _num(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(f"'{name}' must be a number, got {type(v).__name__}", param=name)
    v = float(v)
    ok = math.isfinite(v) and (lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or v <= hi)
    if not ok:
        lo_txt = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
        hi_txt = "" if hi is None else f"<= {hi}"
        raise RequestError(f"'{name}' must be finite and {' and '.join(t for t in (lo_txt, hi_txt) if t)}, "
                           f"got {body.get(name)}", param=name)
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be a boolean, got {type(v).__name__}", param=name)
    return v


def _refuse(body: dict, name: str, ok: Callable[[object], bool], why: str) -> None:
    if _present(body, name) and not ok(body[name]):
        raise RequestError(f"'{name}' {why}", param=name)


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f"'stop' has {len(stops)} entries; at most {MAX_STOP} are allowed", param="stop")
    return list(stops)


def _token_ids(v, name: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise RequestError(f"'{name}' must be a list of non-negative integer token ids", param=name)
    return v


def _common(body: dict) -> tuple[dict, SamplingParams]:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    _int(body, "n", 1, lo=1)
    _refuse(body, "n", lambda n: n == 1, "> 1 is not supported (one choice per request)")
    _refuse(body, "logit_bias", lambda b: not b, "is not supported")
    _refuse(body, "echo", lambda e: e is False, "is not supported")
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not stream):
        raise RequestError("'stream_options' must be an object and needs 'stream': true", param="stream_options")
    include_usage = _bool(opts or {}, "include_usage", False)
    top_k = _int(body, "top_k", 0, lo=-1)
    params = SamplingParams(
        temperature=_num(body, "temperature", 1.0, lo=0.0),
        top_p=_num(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=max(top_k, 0),
        min_p=_num(body, "min_p", 0.0, lo=0.0, hi=1.0),
        seed=_int(body, "seed", None, lo=-INT64, hi=INT64 - 1),
        presence_penalty=_num(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=_num(body, "repetition_penalty", 1.0, lo=0.0, lo_open=True),
        stop=_stop(body),
        stop_token_ids=_token_ids(body.get("stop_token_ids") or [], "stop_token_ids"),
        ignore_eos=_bool(body, "ignore_eos", False),
    )
    if params.seed is not None and params.seed < 0:
        params.seed += 2 ** 64                                   # same 64 bits, as an unsigned seed
    return dict(model=model, stream=stream, include_usage=include_usage), params


def _message(m, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise RequestError(f"messages[{i}].content: only text parts are supported", param="messages")
            parts.append(p["text"])
        content = "\n".join(parts)
    elif content is not None and not isinstance(content, str):
        raise RequestError(f"messages[{i}].content must be a string, a list of text parts or null",
                           param="messages")
    return {**m, "content": content}


def parse_chat_request(body: dict) -> GenerateRequest:
    common, params = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    _refuse(body, "tools", lambda t: not t, "are not supported")
    _refuse(body, "response_format", lambda f: isinstance(f, dict) and f.get("type") == "text",
            "other than {'type': 'text'} is not supported")
    if _bool(body, "logprobs", False):
        params.logprobs = _int(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
    elif _present(body, "top_logprobs"):
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    max_tokens = _int(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, lo=1)
    return GenerateRequest(kind="chat", max_tokens=max_tokens, params=params,
                           messages=[_message(m, i) for i, m in enumerate(messages)],
                           chat_template_kwargs=kwargs, **common)


def parse_completion_request(body: dict) -> GenerateRequest:
    common, params = _common(body)
    _int(body, "best_of", 1, lo=1)
    _refuse(body, "best_of", lambda n: n == 1, "> 1 is not supported")
    _refuse(body, "suffix", lambda s: not s, "is not supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                                        # a batch of one
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        raise RequestError("a list of prompts is not supported; send one prompt per request", param="prompt")
    if isinstance(prompt, list):
        prompt = _token_ids(prompt, "prompt")
    elif not isinstance(prompt, str):
        raise RequestError("'prompt' must be a string or a list of token ids", param="prompt")
    if not prompt:
        raise RequestError("'prompt' must not be empty", param="prompt")
    params.logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    return GenerateRequest(kind="completion", max_tokens=_int(body, "max_tokens", None, lo=1), params=params,
                           prompt=prompt, **common)


# ---- responses -------------------------------------------------------------------------------------------------

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


def chat_response(rid: str, created: int, model: str, message: dict, logprobs: dict | None,
                  finish_reason: str | None, usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "logprobs": logprobs,
                         "finish_reason": finish_reason}], "usage": usage_}


def chat_chunk(rid: str, created: int, model: str, delta: dict, logprobs: dict | None = None,
               finish_reason: str | None = None, with_usage: bool = False) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def completion_response(rid: str, created: int, model: str, text: str, logprobs: dict | None,
                        finish_reason: str | None, usage_: dict) -> dict:
    return {**completion_chunk(rid, created, model, text, logprobs, finish_reason), "usage": usage_}


def completion_chunk(rid: str, created: int, model: str, text: str, logprobs: dict | None = None,
                     finish_reason: str | None = None, with_usage: bool = False) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, created: int, model: str, kind: str, usage_: dict) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}

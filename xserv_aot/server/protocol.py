"""OpenAI API request parsing and validation (chat and legacy completions).

Parsing turns a JSON body into a GenerateRequest or raises RequestError (status, one-line message, param).
An unknown field is refused (400 naming it): a field that is accepted is implemented, or listed in IGNORED_FIELDS
(no effect on the output). The scalar-field tables below drive both the parser and the published OpenAPI schema
(openapi.py).
Messages: server/messages.py; tools: server/tools.py; structured outputs: server/structured.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from xserv_aot.engine.api import (GREEDY_BELOW, LOGIT_BIAS_RANGE, MAX_LOGPROBS, MAX_STOP, PENALTY_RANGE,
                                  REPETITION_PENALTY_RANGE, TEMPERATURE_RANGE, SamplingParams)
from xserv_aot.server.messages import parse_message, template_kwargs
from xserv_aot.server.request_error import RequestError
from xserv_aot.server.structured import parse_guided
from xserv_aot.server.tools import forced_grammar, parse_tools

INT64 = 2 ** 63
INT32_MAX = 2 ** 31 - 1
MAX_N = 16
MAX_PROMPTS = 64
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})    # accepted, no effect on the output


@dataclass(frozen=True)
class Scalar:
    type: str                                   # "number" | "integer" | "boolean"
    default: object = None
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False                       # lo itself is excluded
    doc: str = ""


SAMPLING_FIELDS = {
    "temperature": Scalar("number", 1.0, *TEMPERATURE_RANGE, doc=f"below {GREEDY_BELOW:g}: greedy"),
    "top_p": Scalar("number", 1.0, 0.0, 1.0, lo_open=True),
    "top_k": Scalar("integer", 0, -1, INT32_MAX, doc="0 or -1 = off"),
    "min_p": Scalar("number", 0.0, 0.0, 1.0),
    "seed": Scalar("integer", None, -INT64, INT64 - 1),
    "presence_penalty": Scalar("number", 0.0, *PENALTY_RANGE),
    "frequency_penalty": Scalar("number", 0.0, *PENALTY_RANGE),
    "repetition_penalty": Scalar("number", 1.0, *REPETITION_PENALTY_RANGE),
    "ignore_eos": Scalar("boolean", False),
}
COMMON_FIELDS = {
    "stream": Scalar("boolean", False),
    "n": Scalar("integer", 1, 1, MAX_N, doc="choices per prompt"),
    "max_tokens": Scalar("integer", None, 1, doc="default: up to the context length"),
    "min_tokens": Scalar("integer", 0, 0, doc="EOS and stop_token_ids are masked before this many tokens"),
}
CHAT_FIELDS = {
    "max_completion_tokens": Scalar("integer", None, 1, doc="alias of max_tokens; wins when both are set"),
    "logprobs": Scalar("boolean", False),
    "top_logprobs": Scalar("integer", None, 0, MAX_LOGPROBS, doc="needs logprobs: true"),
}
COMPLETION_FIELDS = {
    "logprobs": Scalar("integer", None, 0, MAX_LOGPROBS),
    "best_of": Scalar("integer", None, 1, MAX_N, doc=">= n; the n most likely of best_of samples (no stream)"),
    "echo": Scalar("boolean", False, doc="prepend the prompt to the text"),
}
OTHER_FIELDS = {"model", "stop", "stop_token_ids", "stream_options", "logit_bias", "structured_outputs",
                "guided_json", "guided_regex", "guided_choice", "guided_grammar", "response_format"}
CHAT_ONLY = {"messages", "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls"}
COMPLETION_ONLY = {"prompt"}


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
    prompts: list[str | list[int]] = field(default_factory=list)   # completions: texts or token ids
    n: int = 1                                  # choices per prompt
    best_of: int | None = None                  # samples per prompt when more than n (ranked by logprob)
    want_logprobs: bool = True                  # False: params.logprobs is only there to rank best_of samples
    tools: object = None                        # server.tools.ToolSpec
    echo: bool = False

    @property
    def n_samples(self) -> int:
        return max(self.n, self.best_of or 0)


def _num_text(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _bounds(s: Scalar) -> str:
    if s.lo is not None and s.lo == s.hi:
        return _num_text(s.lo)
    lo = "" if s.lo is None else (f"> {_num_text(s.lo)}" if s.lo_open else f">= {_num_text(s.lo)}")
    hi = "" if s.hi is None else f"<= {_num_text(s.hi)}"
    return " and ".join(t for t in (lo, hi) if t)


def _as_int(v) -> int | None:
    """JSON integers, including integral numbers like 5.0 (as JSON Schema counts them); None for anything else."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    return int(v) if isinstance(v, float) and v.is_integer() else None


def scalar(body: dict, name: str, s: Scalar):
    """body[name] checked against s; s.default when absent or null."""
    v = body.get(name)
    if v is None:
        return s.default
    if s.type == "boolean":
        if not isinstance(v, bool):
            raise RequestError(f"'{name}' must be a boolean, got {type(v).__name__}", param=name)
        return v
    if s.type == "integer":
        x = _as_int(v)
        if x is None:
            raise RequestError(f"'{name}' must be an integer, got {type(v).__name__}", param=name)
        ok = (s.lo is None or x >= s.lo) and (s.hi is None or x <= s.hi)
    else:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RequestError(f"'{name}' must be a number, got {type(v).__name__}", param=name)
        try:
            x = float(v)
        except OverflowError:                                   # an integer beyond the float range
            x = math.inf
        ok = math.isfinite(x) and (s.lo is None or (x > s.lo if s.lo_open else x >= s.lo)) \
            and (s.hi is None or x <= s.hi)
    if not ok:
        shown = v if isinstance(v, float) or abs(v) < 10 ** 30 else f"an integer of {len(str(abs(v)))} digits"
        raise RequestError(f"'{name}' must be {'finite and ' if s.type == 'number' else ''}{_bounds(s)}, "
                           f"got {shown}", param=name)
    return x


def _refuse(body: dict, name: str, ok: Callable[[object], bool], why: str) -> None:
    if body.get(name) is not None and not ok(body[name]):
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


def token_ids(v, name: str) -> list[int]:
    ids = [_as_int(t) for t in v] if isinstance(v, list) else None
    if ids is None or not all(t is not None and 0 <= t < INT64 for t in ids):
        raise RequestError(f"'{name}' must be a list of non-negative integer token ids", param=name)
    return ids


def _logit_bias(body: dict) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    bias, (lo, hi) = {}, LOGIT_BIAS_RANGE
    for k, b in (v.items() if isinstance(v, dict) else [(None, None)]):
        t = int(k) if isinstance(k, str) and k.isdigit() and len(k) < 12 else None
        if t is None or isinstance(b, bool) or not isinstance(b, (int, float)) or not lo <= b <= hi:
            raise RequestError(f"'logit_bias' must map token ids (as strings) to numbers in [{lo:g}, {hi:g}]",
                               param="logit_bias")
        bias[t] = float(b)
    return bias


def check_fields(body: dict, known) -> None:
    for name, value in body.items():
        if value is not None and name not in known and name not in IGNORED_FIELDS:     # null: not set
            raise RequestError(f"unknown field '{str(name)[:64]}' (see /openapi.json for the accepted fields)",
                               param=str(name)[:64], code="unknown_field")


def _common(body, fields: dict[str, Scalar], only: set[str], defaults: dict | None) -> tuple[dict, SamplingParams,
                                                                                            dict]:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    check_fields(body, {*SAMPLING_FIELDS, *COMMON_FIELDS, *fields, *OTHER_FIELDS, *only})
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    values = {name: scalar(body, name, s) for name, s in {**COMMON_FIELDS, **fields}.items()}
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not values["stream"]):
        raise RequestError("'stream_options' must be an object and needs 'stream': true", param="stream_options")
    include_usage = scalar(opts or {}, "include_usage", Scalar("boolean", False))
    p = {name: scalar(body, name, s) for name, s in SAMPLING_FIELDS.items()}
    for name, v in (defaults or {}).items():                   # the model's generation_config: requests win
        if name in p and body.get(name) is None:
            p[name] = v
    stop_ids = body.get("stop_token_ids")
    params = SamplingParams(**{**p, "top_k": max(p["top_k"], 0)}, stop=_stop(body),
                            stop_token_ids=[] if stop_ids is None else token_ids(stop_ids, "stop_token_ids"),
                            min_tokens=values["min_tokens"], logit_bias=_logit_bias(body),
                            guided=parse_guided(body))
    if params.seed is not None and params.seed < 0:
        params.seed += 2 ** 64                                   # same 64 bits, as an unsigned seed
    return dict(model=model, stream=values["stream"], include_usage=include_usage), params, values


def _samples(body: dict, values: dict, params: SamplingParams) -> dict:
    n, best_of = values["n"], values.get("best_of")
    if best_of is not None and best_of < n:
        raise RequestError(f"'best_of' ({best_of}) must be >= 'n' ({n})", param="best_of")
    if values["stream"] and best_of is not None and best_of > n:
        raise RequestError("'best_of' > 'n' cannot be streamed", param="best_of")
    want = True
    if best_of is not None and best_of > n and params.logprobs is None:
        params.logprobs, want = 0, False                             # needed to rank the samples
    return dict(n=n, best_of=best_of, want_logprobs=want)


def parse_chat_request(body, defaults: dict | None = None) -> GenerateRequest:
    """defaults: request field -> value for fields the body leaves out (the plan's generation_defaults)."""
    if isinstance(body, dict) and body.get("chat_template") is not None:
        raise RequestError("'chat_template' is not accepted: the server always uses the model's own chat template",
                           param="chat_template")
    common, params, values = _common(body, CHAT_FIELDS, CHAT_ONLY | {"chat_template"}, defaults)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    tools = parse_tools(body)
    forced = forced_grammar(tools) if tools is not None else None
    if forced is not None:
        if params.guided is not None:
            raise RequestError("'tool_choice' required or named cannot be combined with a structured output",
                               param="tool_choice")
        params.guided = forced
    if values["logprobs"]:
        params.logprobs = values["top_logprobs"] or 0
    elif values["top_logprobs"] is not None:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    max_tokens = values["max_completion_tokens"] or values["max_tokens"]
    return GenerateRequest(kind="chat", max_tokens=max_tokens, params=params,
                           messages=[parse_message(m, i) for i, m in enumerate(messages)],
                           chat_template_kwargs=template_kwargs(body), tools=tools,
                           **_samples(body, values, params), **common)


def _one_prompt(prompt):
    if isinstance(prompt, list):
        prompt = token_ids(prompt, "prompt")
    elif not isinstance(prompt, str):
        raise RequestError("'prompt' must be a string, a list of token ids, or a list of those", param="prompt")
    if not prompt:
        raise RequestError("'prompt' must not be empty", param="prompt")
    return prompt


def parse_completion_request(body, defaults: dict | None = None) -> GenerateRequest:
    common, params, values = _common(body, COMPLETION_FIELDS, COMPLETION_ONLY | {"suffix"}, defaults)
    _refuse(body, "suffix", lambda s: s == "", "is not supported")
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    prompts = [_one_prompt(p) for p in prompt] if batch else [_one_prompt(prompt)]
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS} are allowed",
                           param="prompt")
    params.logprobs = values["logprobs"]
    if values["echo"] and params.logprobs is not None:
        raise RequestError("'echo' with 'logprobs' (prompt logprobs) is not supported", param="echo")
    return GenerateRequest(kind="completion", max_tokens=values["max_tokens"], params=params, prompts=prompts,
                           echo=values["echo"], **_samples(body, values, params), **common)

"""The contract between the engine (CPU control loop) and its users (server, CLI generate/chat).

The engine thread runs steps (schedule, run, postprocess); `AsyncEngine` bridges it to asyncio. A request is
a list of prompt token ids plus SamplingParams; its outputs arrive as RequestOutput deltas, the last one carrying
finish_reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from xserv_aot.errors import XservError


# Bounds of SamplingParams: one home for the engine's checks (request_checks.check_request) and the server's schema.
TEMPERATURE_RANGE = (0.0, 2.0)
GREEDY_BELOW = 1e-5                     # temperatures under this sample greedily (float32 logits / t would overflow)
PENALTY_RANGE = (-2.0, 2.0)             # presence_penalty, frequency_penalty
REPETITION_PENALTY_RANGE = (0.01, 2.0)
MAX_LOGPROBS = 20
MAX_STOP = 4
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclass(frozen=True)
class GuidedDecoding:
    """A constraint on the output, as plain text (compiled by engine/grammar.py, cached per (kind, spec))."""
    kind: str                           # "json" (spec: JSON schema text) | "json_object" (spec "") | "regex" |
    spec: str                           # "choice" (spec: JSON list of strings) | "grammar" (Lark or GBNF text)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0            # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                      # 0 = off
    min_p: float = 0.0
    seed: int | None = None             # None: the engine draws one
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None         # None: none; k >= 0: the sampled token's logprob plus top-k
    stop: list[str] = field(default_factory=list)          # at most MAX_STOP; the stop text is not returned
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0                 # EOS and stop_token_ids are masked until this many tokens were generated
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit (-100..100)
    guided: GuidedDecoding | None = None                          # structured output constraint

    @property
    def needs_host_sampling(self) -> bool:
        """True when the device sampler (temperature/top-k/top-p/seed, grammar mask) cannot do this request alone."""
        return (self.min_p > 0 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0 or self.logprobs is not None or self.min_tokens > 0
                or bool(self.logit_bias))

    def sampled_on_host(self, device_masks: bool) -> bool:
        """device_masks: the plan applies grammar masks on the device (op apply_token_bitmask)."""
        return self.needs_host_sampling or (self.guided is not None and not device_masks)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)   # (token_id, logprob), most likely first


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]            # tokens generated since the previous output
    text: str                           # detokenized text delta (stop strings removed, never broken UTF-8)
    finish_reason: str | None = None    # None while running; "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0       # total so far
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache
    error: str | None = None            # set with finish_reason == "error"

    def extend(self, later: "RequestOutput") -> "RequestOutput":
        """This output followed by a later one of the same request, as one: tokens, text and logprobs appended,
        finish, error and counts from the later one (in place; returns self)."""
        self.new_token_ids = self.new_token_ids + later.new_token_ids
        self.text += later.text
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finish_reason, self.error = later.finish_reason, later.error
        self.num_prompt_tokens, self.num_generated_tokens = later.num_prompt_tokens, later.num_generated_tokens
        self.num_cached_tokens = later.num_cached_tokens
        return self


class QueueFullError(XservError, RuntimeError):
    """The waiting queue is at --max-waiting; the server answers 429."""


class EngineFailedError(XservError, RuntimeError):
    """The engine failed permanently (or is not running) and refuses new requests (server: 503)."""


class RequestTooLongError(XservError, ValueError):
    """prompt + max_tokens exceeds the plan's max_seq_len; the message states both numbers (server: 400)."""


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int           # prompt blocks looked up
    prefix_cache_hits: int              # of which found cached
    num_preemptions: int = 0
    healthy: bool = True                # False once the engine has failed permanently (it then refuses requests)
    consecutive_failures: int = 0       # failed steps since the last successful one
    num_step_failures: int = 0          # failed steps over the engine's lifetime
    last_error: str | None = None       # one-line error of the most recent failed step (kept after recovery)
    accepting: bool = True              # the engine loop is running and takes new requests


class AsyncEngineProtocol:
    """What the server and CLI use. Implemented by xserv_aot.engine.async_engine.AsyncEngine.

    async def generate(request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]
        raises QueueFullError / RequestTooLongError / EngineFailedError before yielding anything; the last output
        has finish_reason set.
        Cancelling the consuming task (client disconnect) aborts the request.
    def abort(request_id: str) -> None            frees the request's KV blocks within one step
    def stats() -> EngineStats
    def start() -> None / def shutdown() -> None  engine thread lifecycle
    attributes: tokenizer (xserv_aot.tokenizer.Tokenizer), max_seq_len: int, model_name: str,
                generation_defaults: dict (request field -> default, from the plan; optional)
    """


class InvalidRequestError(XservError, ValueError):
    """A request field out of range (prompt ids, sampling params); the message names the field (server: 400)."""

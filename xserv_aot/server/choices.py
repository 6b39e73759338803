"""A request's outputs -> OpenAI bodies: per-choice delta pieces (reasoning, content, tool calls, logprobs), the
full non-streaming body (collect) or server-sent events (events), for one or many engine requests (n, best_of,
prompt lists). Every stream that started ends with a final chunk or an error event, then `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from xserv_aot.engine.api import RequestOutput
from xserv_aot.server import responses as R
from xserv_aot.server.errors import GENERATION_FAILED, RequestTimeout, timeout_body
from xserv_aot.server.protocol import GenerateRequest
from xserv_aot.server.reasoning import ReasoningParser
from xserv_aot.server.streaming import Generation, sse
from xserv_aot.server.tools import StreamingToolParser

log = logging.getLogger(__name__)


@dataclass
class Reply:
    """How one request's outputs become OpenAI bodies."""
    req: GenerateRequest
    rid: str
    created: int
    model: str
    n_prompt: int                                    # prompt tokens, summed over the request's prompts
    reasoning: bool                                  # split <think> blocks into reasoning_content (chat)
    opens: bool                                      # the prompt already opened a <think> block
    token_text: Callable[[int], str]
    tool_parser: str = "none"                        # parser for tool_choice auto (server/tools.py)
    echo: list[str] = field(default_factory=list)    # completions with echo: the prompt text of each choice

    @property
    def ids(self) -> dict:
        return dict(rid=self.rid, created=self.created, model=self.model)

    def usage(self, finals: dict[int, RequestOutput]) -> dict:
        """OpenAI's sums: every prompt once, every sample's completion tokens (best_of candidates included)."""
        k = self.req.n_samples
        return R.usage(self.n_prompt, sum(f.num_generated_tokens for f in finals.values()),
                       sum(f.num_cached_tokens for i, f in finals.items() if i % k == 0))


class Choice:
    """One choice's outputs -> delta pieces (reasoning, content, tool calls, logprobs), used by streaming and
    non-streaming alike so both always agree."""

    def __init__(self, rp: Reply, index: int):
        req, chat = rp.req, rp.req.kind == "chat"
        self.rp, self.index = rp, index
        self.reasoning = ReasoningParser(rp.opens) if chat and rp.reasoning else None
        spec = req.tools
        self.tools = (StreamingToolParser(spec, rp.tool_parser if spec.choice != "none" else "none")
                      if chat and spec is not None else None)
        self.want_lps = req.params.logprobs is not None and req.want_logprobs
        self.pending: list = []
        self.lps: list = []
        self.num_calls = 0
        self.offset = 0
        self.echo = rp.echo[index] if rp.echo else ""

    def step(self, out: RequestOutput) -> dict | None:
        """The delta this output adds, or None when it adds nothing: {"reasoning_content"?, "content"?,
        "tool_calls"?, "logprobs"?, "finish_reason"}."""
        done = out.finish_reason is not None
        self.pending.extend(out.logprobs or [])
        self.lps.extend(out.logprobs or [])
        text, self.echo = self.echo + out.text, ""
        r, c = self.reasoning.feed(text) if self.reasoning else ("", text)
        if self.reasoning and done:
            r2, c2 = self.reasoning.flush()
            r, c = r + r2, c + c2
        calls = []
        if self.tools:
            c, calls = self.tools.feed(c)
            if done:
                c2, k2 = self.tools.flush()
                c, calls = c + c2, calls + k2
        if not (r or c or calls or done):
            return None
        piece = {k: v for k, v in (("reasoning_content", r), ("content", c)) if v}
        if calls:
            piece["tool_calls"] = [{"index": self.num_calls + i, **call.to_dict()} for i, call in enumerate(calls)]
            self.num_calls += len(calls)
        if self.want_lps:
            piece["logprobs"] = (R.chat_logprobs(self.pending, self.rp.token_text) if self.rp.req.kind == "chat"
                                 else R.completion_logprobs(self.pending, self.rp.token_text, self.offset))
        self.offset += len(c)
        self.pending = []
        reason = out.finish_reason
        piece["finish_reason"] = "tool_calls" if reason == "stop" and self.num_calls else reason
        return piece


def _message(pieces: list[dict], reasoning: bool) -> dict:
    content = "".join(p.get("content", "") for p in pieces)
    calls = [{k: v for k, v in c.items() if k != "index"} for p in pieces for c in p.get("tool_calls", [])]
    message = {"content": content.strip() if calls else content}
    if calls:
        message["content"] = message["content"] or None
        message["tool_calls"] = calls
    if reasoning:
        r = "".join(p.get("reasoning_content", "") for p in pieces)
        message["reasoning_content"] = r or None
        if not message["content"] and r:
            message["content"] = None
    return message


async def collect_one(gen: Generation, ch: Choice, out: RequestOutput) -> tuple[RequestOutput, dict]:
    """(final output, choice body) for one engine request; raises on an engine error."""
    pieces = []
    while True:
        piece = ch.step(out)
        if piece is not None:
            pieces.append(piece)
        if out.finish_reason is not None:
            break
        out = await gen.next()
    if out.finish_reason == "error":
        raise RuntimeError(f"engine error for {gen.rid}: {out.error}")
    reason = pieces[-1]["finish_reason"]
    rp = ch.rp
    if rp.req.kind == "completion":
        lp = (R.completion_logprobs(ch.lps, rp.token_text, 0) if ch.want_lps else None)
        body = {"text": "".join(p.get("content", "") for p in pieces), "logprobs": lp}
    else:
        lp = R.chat_logprobs(ch.lps, rp.token_text) if ch.want_lps else None
        body = {"message": {"role": "assistant", **_message(pieces, ch.reasoning is not None)}, "logprobs": lp}
    return out, {"index": ch.index, **body, "finish_reason": reason, "_score": sum(x.logprob for x in ch.lps)}


async def collect(gens: list[Generation], rp: Reply, firsts: list[RequestOutput]) -> dict:
    """The whole non-streaming response body: best_of candidates ranked by cumulative logprob, n kept per prompt."""
    req = rp.req
    results = await asyncio.gather(*(collect_one(g, Choice(rp, i), f) for i, (g, f) in
                                     enumerate(zip(gens, firsts))))
    finals = {i: f for i, (f, _) in enumerate(results)}
    k, n, choices = req.n_samples, req.n, []
    for p in range(len(gens) // k):
        group = [c for _, c in results[p * k:(p + 1) * k]]
        if k > n:
            group = sorted(group, key=lambda c: -c["_score"])[:n]
        for j, c in enumerate(group):
            c["index"] = p * n + j
            choices.append(c)
    for c in choices:
        del c["_score"]
    return R.response(**rp.ids, kind=req.kind, choices=choices, usage_=rp.usage(finals))


async def _merged(gens: list[Generation], firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, object]]:
    """(choice index, output or exception) from every generation as they arrive, until each one finished."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation, out: RequestOutput):
        try:
            while True:
                await q.put((i, out))
                if out.finish_reason is not None:
                    return
                out = await gen.next()
        except Exception as e:                       # noqa: BLE001 - handed to the consumer
            await q.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, g, f)) for i, (g, f) in enumerate(zip(gens, firsts))]
    try:
        left = len(gens)
        while left:
            i, item = await q.get()
            if isinstance(item, BaseException) or item.finish_reason is not None:
                left -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def events(gens: list[Generation], rp: Reply, firsts: list[RequestOutput]) -> AsyncIterator[bytes]:
    """SSE chunks from the first outputs on; engine errors and timeouts become an error event before [DONE]."""
    req = rp.req
    chat, with_usage = req.kind == "chat", req.include_usage
    choices = [Choice(rp, i) for i in range(len(gens))]
    finals: dict[int, RequestOutput] = {}
    if chat:
        for i in range(len(gens)):
            yield sse(R.chat_chunk(**rp.ids, index=i, delta={"role": "assistant", "content": ""},
                                   with_usage=with_usage))
    try:
        async for i, out in _merged(gens, firsts):
            if isinstance(out, BaseException):
                raise out
            if out.finish_reason == "error":
                log.error("engine error for %s: %s", gens[i].rid, out.error)
                yield sse(R.error_body(GENERATION_FAILED, 500))
                break
            piece = choices[i].step(out)
            if out.finish_reason is not None:
                finals[i] = out
            if piece is None:
                continue
            lp, reason = piece.pop("logprobs", None), piece.pop("finish_reason")
            if chat:
                calls = piece.pop("tool_calls", [])
                if calls:                                # OpenAI's shape: id + name first, then the arguments
                    heads = [{**c, "function": {"name": c["function"]["name"], "arguments": ""}} for c in calls]
                    yield sse(R.chat_chunk(**rp.ids, index=i, delta={**piece, "tool_calls": heads},
                                           with_usage=with_usage))
                    piece = {"tool_calls": [{"index": c["index"], "function": {"arguments": c["function"][
                        "arguments"]}} for c in calls]}
                yield sse(R.chat_chunk(**rp.ids, index=i, delta=piece, logprobs=lp, finish_reason=reason,
                                       with_usage=with_usage))
            else:
                yield sse(R.completion_chunk(**rp.ids, index=i, text=piece.get("content", ""), logprobs=lp,
                                             finish_reason=reason, with_usage=with_usage))
        else:
            if with_usage:
                yield sse(R.usage_chunk(**rp.ids, kind=req.kind, usage_=rp.usage(finals)))
    except RequestTimeout as e:
        log.warning("request %s timed out mid-stream", rp.rid)
        yield sse(timeout_body(e))
    except Exception:
        log.exception("generation %s failed mid-stream", rp.rid)
        yield sse(R.error_body(GENERATION_FAILED, 500))
    yield sse("[DONE]")

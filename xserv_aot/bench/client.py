"""One streaming request to an OpenAI-compatible server, timed: when it was sent, each chunk that carried text,
when the stream ended, and the server's usage counts (stream_options.include_usage).

The transport is aiohttp: at 15 - 20k streamed tokens a second one client process must keep up with the server
(httpx's line iterator cost ~60 us a chunk and left the client a second behind the server at 256 streams on the
H200: docs/benchmarks/2026-12-01-session8-h200.md)."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from xserv_aot.bench.datasets import SampleRequest

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class RequestResult:
    prompt_len: int                      # tokens, counted on the client
    output_len: int                      # tokens asked for (max_tokens)
    success: bool = False
    error: str = ""
    start: float = 0.0                   # perf_counter when sent
    ttft: float = 0.0                    # seconds to the first chunk with text
    latency: float = 0.0                 # seconds to the end of the stream
    itl: list[float] = field(default_factory=list)   # gaps between successive text chunks
    text: str = ""
    prompt_tokens: int | None = None     # the server's usage counts, when it sends them
    completion_tokens: int | None = None
    finish_reason: str | None = None


def request_body(endpoint: str, model: str, req: SampleRequest, *, ignore_eos: bool, temperature: float) -> dict:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "temperature": temperature, "ignore_eos": ignore_eos}
    if endpoint == "/v1/chat/completions":
        body.update(messages=[{"role": "user", "content": req.prompt}], max_completion_tokens=req.expected_output_len)
    else:
        body.update(prompt=req.prompt, max_tokens=req.expected_output_len)
    return body


def _chunk_text(chunk: dict) -> str:
    parts = []
    for c in chunk.get("choices") or []:
        if "text" in c:
            parts.append(c.get("text") or "")
        delta = c.get("delta") or {}
        parts.append((delta.get("content") or "") + (delta.get("reasoning_content") or ""))
    return "".join(parts)


def _error_text(status: int, raw: bytes) -> str:
    try:
        msg = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = raw.decode(errors="replace")
    return " ".join(f"HTTP {status}: {msg}".split())[:300]


async def send(session: aiohttp.ClientSession, url: str, body: dict, req: SampleRequest, headers: dict
               ) -> RequestResult:
    res = RequestResult(prompt_len=req.prompt_len, output_len=req.expected_output_len)
    parts: list[str] = []
    res.start = last = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as r:
            if r.status != 200:
                res.error = _error_text(r.status, await r.read())
                return res
            async for raw in r.content:                       # one SSE line (the reader splits on b"\n")
                if not raw.startswith(b"data:"):
                    continue                                  # blank separators, ": keep-alive" comments
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = " ".join(str(chunk["error"].get("message", chunk["error"])).split())[:300]
                    return res
                now = time.perf_counter()
                if text := _chunk_text(chunk):
                    if not parts:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
                    parts.append(text)
                for c in chunk.get("choices") or []:
                    res.finish_reason = c.get("finish_reason") or res.finish_reason
                if usage := chunk.get("usage"):
                    res.prompt_tokens, res.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        res.latency = time.perf_counter() - res.start
        res.text = "".join(parts)
        res.success = bool(parts)
        if not res.success:
            res.error = "the stream ended without any text"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        res.error = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    return res

"""A deterministic stand-in for the engine (AsyncEngineProtocol) plus a loopback uvicorn harness for server tests.

FakeTokenizer: one token per character (id = code point + 3; 1 = BOS, 2 = EOS).
FakeEngine: a tiny hash-based "language model" over a-z and space. A prompt containing `say:TEXT` (to the end of
its line; a literal backslash-n stands for a newline) makes the model emit TEXT then EOS almost surely;
`boom:raise` makes generate raise, `boom:error` ends the request with finish_reason "error" after two tokens
(with a secret in RequestOutput.error that must not reach the client). Honours max_tokens, stop strings (held back
while they may still match), stop_token_ids, ignore_eos, seeds, top-k/top-p, logprobs, abort, max_waiting and
max_seq_len.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time

import numpy as np

from xserv_aot.engine.api import (EngineStats, QueueFullError, RequestOutput, RequestTooLongError, SamplingParams,
                                  TokenLogprob)

BOS, EOS, OFFSET = 1, 2, 3
ALPHABET = "abcdefghijklmnopqrstuvwxyz "
PREFIX_BLOCK = 4


class FakeTokenizer:
    vocab_size = OFFSET + 0x110000
    eos_token_ids = [EOS]

    def __init__(self, thinking: bool = False, think_in_prompt: bool = False):
        self.thinking, self.think_in_prompt = thinking, think_in_prompt
        self.chat_template = "{{ messages }}" + (" <think> </think>" if thinking else "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [ord(c) + OFFSET for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i - OFFSET) if i >= OFFSET else ("" if skip_special_tokens else self.id_to_token(i))
                       for i in ids)

    def id_to_token(self, i: int) -> str:
        return {BOS: "<s>", EOS: "</s>"}.get(i) or chr(i - OFFSET)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, enable_thinking: bool = True,
                            **_) -> str:
        out = []
        for m in messages:
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"unknown role {m['role']!r}")
            out.append(f"<|{m['role']}|>{m.get('content') or ''}\n")
        if add_generation_prompt:
            out.append("<|assistant|>")
            if self.thinking and not enable_thinking:
                out.append("<think>\n\n</think>\n\n")
            elif self.thinking and self.think_in_prompt:
                out.append("<think>\n")
        return "".join(out)

    def encode_chat(self, messages, add_generation_prompt: bool = True, **kwargs) -> list[int]:
        return [BOS] + self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), False)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


class FakeEngine:
    def __init__(self, tokenizer: FakeTokenizer | None = None, *, max_seq_len: int = 256, max_running: int = 4,
                 max_waiting: int = 16, step_s: float = 0.001, model_name: str = "fake-model"):
        self.tokenizer = tokenizer or FakeTokenizer()
        self.max_seq_len, self.model_name, self.step_s = max_seq_len, model_name, step_s
        self.max_running, self.max_waiting = max_running, max_waiting
        self.healthy, self.started = True, False
        self.aborted: list[str] = []                 # request ids, in abort order
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self._running: set[str] = set()
        self._waiting: list[str] = []
        self._cached: set[tuple[int, ...]] = set()
        self._queries = self._hits = 0

    def start(self) -> None:
        self.started = True

    def shutdown(self) -> None:
        self.started = False

    def stats(self) -> EngineStats:
        used = sum(-(-len(self.requests[r][0]) // PREFIX_BLOCK) for r in self._running)
        return EngineStats(num_running=len(self._running), num_waiting=len(self._waiting), kv_blocks_used=used,
                           kv_blocks_total=64, prefix_cache_queries=self._queries, prefix_cache_hits=self._hits,
                           healthy=self.healthy)

    def abort(self, request_id: str) -> None:
        if request_id not in self.aborted:
            self.aborted.append(request_id)

    def _logits(self, context: list[int], script: str, n_out: int, params: SamplingParams) -> tuple[list, np.ndarray]:
        ids = [ord(c) + OFFSET for c in ALPHABET] + [EOS]
        seed = [int(t) for t in context[-3:]] + [len(context) % 5]
        logits = np.random.default_rng(seed).normal(size=len(ids)) * 2.0
        logits[-1] -= 4.0
        if script:
            want = ord(script[n_out]) + OFFSET if n_out < len(script) else EOS
            if want not in ids:
                ids.append(want)
                logits = np.append(logits, 0.0)
            logits[ids.index(want)] += 40.0
        if params.ignore_eos:
            logits[ids.index(EOS)] = -np.inf
        return ids, logits

    def _sample(self, ids: list, logits: np.ndarray, params: SamplingParams, rng: random.Random) -> int:
        if params.temperature == 0:
            return ids[int(np.argmax(logits))]
        p = np.exp(_log_softmax(logits / params.temperature))
        order = np.argsort(-p, kind="stable")
        if params.top_k > 0:
            p[order[params.top_k:]] = 0
        if params.top_p < 1:
            keep = np.cumsum(p[order]) - p[order] < params.top_p
            p[order[~keep]] = 0
        p /= p.sum()
        return ids[int(np.searchsorted(np.cumsum(p), rng.random() * (1 - 1e-12)))]

    def _cached_tokens(self, prompt: list[int]) -> int:
        n, blocks = 0, len(prompt) // PREFIX_BLOCK
        for b in range(1, blocks + 1):
            key = tuple(prompt[:b * PREFIX_BLOCK])
            self._queries += 1
            if key in self._cached and n == (b - 1) * PREFIX_BLOCK:
                self._hits += 1
                n = b * PREFIX_BLOCK
            self._cached.add(key)
        return min(n, len(prompt) - 1)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams):
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise RequestTooLongError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                                      f"exceeds max_seq_len {self.max_seq_len}")
        if len(self._running) >= self.max_running and len(self._waiting) >= self.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.max_waiting})")
        prompt_text = self.tokenizer.decode(prompt_ids)
        if "boom:raise" in prompt_text:
            raise RuntimeError("secret engine detail: /internal/path")
        script = prompt_text.rsplit("say:", 1)[1].split("\n", 1)[0] if "say:" in prompt_text else ""
        script = script.replace("\\n", "\n")
        self.requests[request_id] = (list(prompt_ids), params)
        self._waiting.append(request_id)
        finished = False
        try:
            while len(self._running) >= self.max_running:
                await asyncio.sleep(self.step_s)
            self._waiting.remove(request_id)
            self._running.add(request_id)
            cached = self._cached_tokens(list(prompt_ids))
            rng = random.Random(params.seed if params.seed is not None else random.getrandbits(64))
            out_ids, text, sent, hold = [], "", 0, max((len(s) for s in params.stop), default=1) - 1
            while True:
                await asyncio.sleep(self.step_s)
                if request_id in self.aborted:
                    finished = True
                    self._running.discard(request_id)
                    yield RequestOutput(request_id, [], "", "abort", None, len(prompt_ids), len(out_ids), cached)
                    return
                ids, logits = self._logits(list(prompt_ids) + out_ids, script, len(out_ids), params)
                tok = self._sample(ids, logits, params, rng)
                out_ids.append(tok)
                lps = None
                if params.logprobs is not None:
                    lp = _log_softmax(logits)
                    top = sorted(zip(ids, lp.tolist()), key=lambda x: -x[1])[:params.logprobs]
                    lps = [TokenLogprob(tok, float(lp[ids.index(tok)]), top)]
                boom = "boom:error" in prompt_text
                reason = "error" if boom and len(out_ids) >= 2 else None
                eos = tok == EOS and not (params.ignore_eos or boom)
                if reason is None and (eos or tok in params.stop_token_ids):
                    reason = "stop"
                elif reason is None:
                    text += self.tokenizer.decode([tok])
                hits = [i for i in (text.find(s) for s in params.stop) if i >= 0]
                if hits and reason is None:
                    text, reason = text[:min(hits)], "stop"
                if reason is None and len(out_ids) >= params.max_tokens:
                    reason = "length"
                upto = len(text) if reason else max(sent, len(text) - hold)
                delta, sent = text[sent:upto], upto
                finished = reason is not None
                if finished:
                    self._running.discard(request_id)          # like the real engine: freed before the last output
                yield RequestOutput(request_id, [tok], delta, reason, lps, len(prompt_ids), len(out_ids), cached,
                                    error="secret engine detail" if reason == "error" else None)
                if finished:
                    return
        finally:
            if request_id in self._waiting:
                self._waiting.remove(request_id)
            self._running.discard(request_id)
            if not finished:
                self.abort(request_id)


def scrape(base_url: str, headers: dict | None = None) -> dict[tuple[str, frozenset], float]:
    """GET /metrics -> {(sample name, frozenset(labels.items())): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    r = httpx.get(base_url + "/metrics", headers=headers, timeout=10)
    r.raise_for_status()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


class LiveServer:
    """uvicorn on 127.0.0.1 (ephemeral port) in a background thread; `with LiveServer(app) as base_url:`.
    begin_shutdown() does what SIGTERM does to `xserv-aot serve` (drain for shutdown_grace seconds, then stop)."""

    def __init__(self, app, start_timeout: float = 10.0, shutdown_grace: float = 5.0, **config):
        from xserv_aot.server.run import DrainingServer, server_config
        self.config = server_config(app, "127.0.0.1", 0, log_level="warning", access_log=False,
                                    **{"timeout_graceful_shutdown": 5, **config})
        self.server = DrainingServer(self.config, shutdown_grace=shutdown_grace)
        self.start_timeout = start_timeout

    def __enter__(self) -> str:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)   # proto set: asyncio
        # then gives accepted connections TCP_NODELAY, as with uvicorn's own listener (no 40 ms Nagle stalls)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def begin_shutdown(self) -> None:
        self.server.request_shutdown()

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        with contextlib.suppress(OSError):
            self.sock.close()


def tiny_plan(tmp_path_factory, num_blocks: int = 256):
    """The e2e tiny Qwen3 plan (real Qwen3 tokenizer, max_seq_len 256), compiled once per test session and pool
    size (the same directory tests/test_storm.py uses)."""
    from tests.tiny_models import make_plan
    root = tmp_path_factory.getbasetemp() / "tiny-qwen3"
    out = root / f"plan{num_blocks}"
    if not (out / "manifest.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        make_plan(root, num_blocks)
    return out

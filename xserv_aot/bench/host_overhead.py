"""Host overhead per engine step, with InstantRunner (no model): the engine alone, and engine + HTTP server with
`batch` streaming clients (the server in a child process, the clients here).

A tiny Qwen3-shaped config (vocab 512) with max_num_seqs 256 and decode buckets 1..256 is compiled for the CPU with
dummy weights and a word-level tokenizer (w0 .. w510); the model never runs. Each client sends a `prompt_len`-token
prompt and streams `max_tokens` tokens (ignore_eos). Host ms per step: the gaps between successive runner calls
that both ran the full batch (steady-state decode), so it holds schedule + stage + postprocess, and, when served,
the engine thread's share of the GIL next to the HTTP side. stream_tpot_ms: the clients' median time per output
token, i.e. how fast the server delivers the tokens (with an instant runner the engine runs ahead of the streams).
"""
from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import shutil
import socket
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from xserv_aot.bench.client import request_body, send
from xserv_aot.bench.datasets import SampleRequest
from xserv_aot.bench.instant_runner import InstantRunner, StepLog

VOCAB = 512
EOS = 511
TINY_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "eos_token_id": EOS, "tie_word_embeddings": False}
BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def make_tiny_plan(root: Path, max_seq_len: int = 128, tokenizer_dir: Path | None = None,
                   vocab_size: int = VOCAB) -> Path:
    """The tiny plan with its word-level tokenizer, or with the tokenizer files of tokenizer_dir (vocab_size then
    covers that tokenizer's ids; its eos is the config's eos_token_id vocab_size - 1 unless the tokenizer says)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan

    src, out = Path(root) / "config.json", Path(root) / "plan"
    src.write_text(json.dumps({**TINY_CONFIG, "vocab_size": vocab_size, "eos_token_id": vocab_size - 1,
                               "max_position_embeddings": max(512, max_seq_len)}))
    blocks = BUCKETS[-1] * (max_seq_len // 16 + 1)
    build = BuildConfig(max_num_seqs=BUCKETS[-1], decode_buckets=BUCKETS, prefill_buckets=[256, 512],
                        max_seq_len=max_seq_len, block_size=16, num_blocks=blocks, dtype="float32", target="cpu")
    compile_plan(src, out, build, dummy_weights=True, force=True)
    if tokenizer_dir is not None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(tokenizer_dir) / f, out / f)
        return out
    vocab = {f"w{i}": i for i in range(EOS)} | {"<eos>": EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))                 # the plan is the benchmark's own: a tokenizer for serving
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return out


def steady_state(times: np.ndarray, sizes: np.ndarray, batch: int) -> dict:
    """Gaps between consecutive steps that both ran `batch` sequences: median (ms and steps/s) and p90."""
    full = (sizes[:-1] == batch) & (sizes[1:] == batch)
    gaps = np.diff(times)[full]
    if gaps.size == 0:
        return {"batch": batch, "steps": 0, "host_ms_per_step": float("nan"), "p90_ms": float("nan"),
                "steps_per_s": 0.0}
    return {"batch": batch, "steps": int(gaps.size), "host_ms_per_step": float(np.median(gaps) * 1e3),
            "p90_ms": float(np.percentile(gaps, 90) * 1e3), "steps_per_s": float(1.0 / np.median(gaps))}


def prompt(prompt_len: int, k: int) -> str:
    return " ".join(f"w{(k * 7 + j) % EOS}" for j in range(prompt_len))


def engine_only(plan_dir: Path, batch: int, max_tokens: int, prompt_len: int) -> dict:
    from xserv_aot.engine.api import SamplingParams
    from xserv_aot.engine.llm_engine import LLMEngine
    from xserv_aot.plan.manifest import Plan
    from xserv_aot.tokenizer import Tokenizer

    plan = Plan.load(plan_dir)
    tok = Tokenizer.from_dir(plan.dir)
    with tempfile.TemporaryDirectory() as d:
        log = StepLog.create(Path(d) / "steps")
        engine = LLMEngine(InstantRunner(plan, step_log=Path(d) / "steps"), tok)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for k in range(batch):
            engine.add_request(f"r{k}", tok.encode(prompt(prompt_len, k)), params)
        while engine.has_unfinished():
            engine.step()
        return steady_state(*log.steps(), batch)


def _serve_child(plan_dir: str, step_log: str, port: int) -> None:
    from xserv_aot.serve import build_engine
    from xserv_aot.server.run import run_server

    engine = build_engine(plan_dir, backend="cpu", model_name="tiny", max_waiting=4096,
                          runner_factory=functools.partial(InstantRunner, step_log=step_log, hold_first_step=True))
    run_server(engine, port=port, log_level="warning", max_in_flight=4096, shutdown_grace=1.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _admitted(client: aiohttp.ClientSession, url: str) -> int:
    """Requests the engine holds (running + waiting, including those not yet picked up), from /metrics."""
    async with client.get(url + "/metrics") as r:
        lines = (await r.text()).splitlines()
    return sum(int(float(line.split()[-1])) for line in lines
               if line.startswith(("xserv_num_requests_running ", "xserv_num_requests_waiting ")))


async def _clients(url: str, batch: int, max_tokens: int, prompt_len: int, log: StepLog) -> list:
    """All streams start; the held runner is released once the engine holds every request."""
    connector = aiohttp.TCPConnector(limit=batch + 1)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600.0, connect=30.0)
                                     ) as client:
        reqs = [SampleRequest(prompt(prompt_len, k), prompt_len, max_tokens) for k in range(batch)]
        bodies = [request_body("/v1/completions", "tiny", r, ignore_eos=True, temperature=0.0) for r in reqs]
        tasks = [asyncio.create_task(send(client, url + "/v1/completions", b, r, {})) for b, r in zip(bodies, reqs)]
        while not (log.held and await _admitted(client, url) >= batch):
            await asyncio.sleep(0.005)
        log.release()
        return await asyncio.gather(*tasks)


def wait_healthy(url: str, process, timeout: float, poll: float = 0.1) -> bool:
    """Poll url/health until it answers 200 (True), or the server process dies or `timeout` s pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or not process.is_alive():
            return False
        time.sleep(poll)


def served(plan_dir: Path, batch: int, max_tokens: int, prompt_len: int, start_timeout: float = 120.0) -> dict:
    with tempfile.TemporaryDirectory() as d:
        log_path = Path(d) / "steps"
        log = StepLog.create(log_path)
        port = _free_port()
        child = multiprocessing.get_context("spawn").Process(target=_serve_child,
                                                             args=(str(plan_dir), str(log_path), port), daemon=True)
        child.start()
        url = f"http://127.0.0.1:{port}"
        try:
            if not wait_healthy(url, child, start_timeout):
                raise RuntimeError("the benchmark server did not start")
            results = asyncio.run(_clients(url, batch, max_tokens, prompt_len, log))
        finally:
            child.terminate()
            child.join(30)
        bad = [r.error for r in results if not r.success or r.completion_tokens != max_tokens]
        if bad:
            raise RuntimeError(f"{len(bad)} of {batch} streams failed or came back short: {bad[0]!r}")
        tpots = [(r.latency - r.ttft) / (max_tokens - 1) for r in results]
        return {**steady_state(*log.steps(), batch), "stream_tpot_ms": float(np.median(tpots) * 1e3)}

"""`xserv-aot bench-serve` (or `python -m xserv_aot.bench.serve`): load an OpenAI-compatible server with seeded
synthetic prompts and report throughput and latency. Flag names follow vLLM's `vllm bench serve`."""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from xserv_aot.bench import datasets
from xserv_aot.bench.client import ENDPOINTS, RequestResult, request_body, send
from xserv_aot.bench.metrics import compute_metrics, parse_goodput
from xserv_aot.bench.report import print_report, save_result
from xserv_aot.bench.tokens import make_counter


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="xserv-aot bench-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    p.add_argument("--model", help="model name sent in requests (default: the first of GET /v1/models)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer.json directory or plan directory (default: the "
                   "server's /tokenize if it has one, else one word = one token)")
    p.add_argument("--dataset-name", default="random", choices=("random", "sharegpt-synthetic"))
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--sharegpt-max-len", type=int, default=2048, help="sharegpt-synthetic: input + output cap")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight at once (default: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so output lengths are exact (default: on)")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 (keys ttft tpot e2el)")
    p.add_argument("--save-result", type=Path, metavar="FILE.json", help="write config, metrics, per-request data")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def check_args(a: argparse.Namespace) -> None:
    a.base_url = (a.base_url or f"http://{a.host}:{a.port}").rstrip("/")
    if not a.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {a.base_url!r}")
    for name in ("num_prompts", "max_concurrency"):
        v = getattr(a, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if not a.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {a.request_rate}")
    if not a.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {a.burstiness}")
    if a.tokenizer is not None and not a.tokenizer.exists():
        raise ValueError(f"--tokenizer {a.tokenizer}: no such file or directory")
    if a.save_result is not None and not a.save_result.resolve().parent.is_dir():
        raise ValueError(f"--save-result {a.save_result}: its directory does not exist")
    a.goodput_slos = parse_goodput(a.goodput)


def headers() -> dict:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def served_model(base_url: str, hdrs: dict) -> str:
    try:
        r = httpx.get(base_url + "/v1/models", headers=hdrs, timeout=30.0)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{base_url}/v1/models: cannot read the model name ({type(e).__name__}); pass --model") from None


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds to wait before each request: gamma(shape k, scale 1/(rate k)), i.e. Poisson for k = 1."""
    if math.isinf(rate):
        return np.zeros(n)
    return np.random.default_rng([seed, 2]).gamma(burstiness, 1.0 / (rate * burstiness), n)


async def run_requests(a, requests: list[datasets.SampleRequest], hdrs: dict, progress=None
                       ) -> tuple[list[RequestResult], float]:
    url = a.base_url + a.endpoint
    limit = a.max_concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    connector = aiohttp.TCPConnector(limit=limit)
    timeout = aiohttp.ClientTimeout(total=6 * 3600.0, connect=30.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20) as client:
        async def one(req):
            async with sem:
                body = request_body(a.endpoint, a.model, req, ignore_eos=a.ignore_eos, temperature=a.temperature)
                res = await send(client, url, body, req, hdrs)
            if progress is not None:
                progress()
            return res

        first = await one(requests[0])           # a test request, as vLLM does: fail fast on a bad setup
        if not first.success:
            raise ValueError(f"the test request to {url} failed: {first.error}")
        tasks = []
        t0 = time.perf_counter()
        for req, gap in zip(requests, arrival_gaps(len(requests), a.request_rate, a.burstiness, a.seed)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def run(a: argparse.Namespace) -> dict:
    lengths = datasets.parse_dataset_lengths(a.dataset_name, a.num_prompts, a.seed, input_len=a.random_input_len,
                                             output_len=a.random_output_len, range_ratio=a.random_range_ratio,
                                             sharegpt_max_len=a.sharegpt_max_len)
    hdrs = headers()
    a.model = a.model or served_model(a.base_url, hdrs)
    counter = make_counter(a.tokenizer, a.base_url, a.model, hdrs)
    requests = datasets.PromptBuilder(counter, a.seed).build(lengths)
    from rich.progress import Progress
    with Progress(disable=a.disable_tqdm, transient=True) as bar:
        task = bar.add_task("requests", total=len(requests) + 1)
        results, duration = asyncio.run(run_requests(a, requests, hdrs, lambda: bar.advance(task)))
    metrics = compute_metrics(results, duration, counter if counter.exact else None, a.goodput_slos)
    asked = [r.output_len for r in results if r.success]                  # output_lens is over the same requests
    short = sum(n != want for n, want in zip(metrics["output_lens"], asked))
    metrics["ignore_eos_violations"] = short if a.ignore_eos else None
    metrics["token_counter"] = counter.source
    return metrics


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        check_args(a)
        metrics = run(a)
    except (ValueError, OSError) as e:
        sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        return 1
    print_report(a, metrics)
    if a.save_result is not None:
        save_result(a, metrics, a.save_result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

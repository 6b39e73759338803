#!/usr/bin/env python3
"""Hostile-client check against a live server (loopback only): while one client streams a normal completion,
`--clients` clients keep sending ~1 MB text prompts; reports the normal stream's inter-token latency (p50, p99),
/health latency (p50, max) and the statuses the big prompts got. Bounded in time and count; stops by itself.

  python3 scripts/hostile_prompts.py --base-url http://127.0.0.1:8000 [--clients 6 --mb 1 --out result.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import numpy as np


async def normal_stream(client: httpx.AsyncClient, model: str, tokens: int) -> list[float]:
    body = {"model": model, "prompt": "The history of the city", "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    stamps = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return list(np.diff(stamps) * 1e3)


async def big_prompts(client: httpx.AsyncClient, model: str, mb: float, until: float, statuses: list) -> None:
    text = ("lorem ipsum dolor sit amet " * int(mb * 2**20 / 27))
    while time.perf_counter() < until:
        try:
            r = await client.post("/v1/completions", json={"model": model, "prompt": text, "max_tokens": 4})
            statuses.append(r.status_code)
        except httpx.HTTPError as e:
            statuses.append(type(e).__name__)


async def health(client: httpx.AsyncClient, until: float, lat: list) -> None:
    while time.perf_counter() < until:
        t0 = time.perf_counter()
        try:
            await client.get("/health")
        except httpx.HTTPError:
            pass
        lat.append((time.perf_counter() - t0) * 1e3)
        await asyncio.sleep(0.1)


async def main_async(args) -> dict:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=120) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        baseline = await normal_stream(client, model, args.tokens)
        until = time.perf_counter() + args.seconds
        statuses, lat = [], []
        tasks = [asyncio.create_task(big_prompts(client, model, args.mb, until, statuses)) for _ in range(args.clients)]
        tasks.append(asyncio.create_task(health(client, until, lat)))
        await asyncio.sleep(1.0)                                   # the big prompts are in flight
        itl = await normal_stream(client, model, args.tokens)
        await asyncio.gather(*tasks)
    pct = lambda xs, q: float(np.percentile(xs, q)) if len(xs) else float("nan")
    return {"clients": args.clients, "prompt_mb": args.mb, "normal_itl_ms_alone": {"p50": pct(baseline, 50),
            "p99": pct(baseline, 99)}, "normal_itl_ms_under_attack": {"p50": pct(itl, 50), "p99": pct(itl, 99)},
            "health_ms": {"p50": pct(lat, 50), "max": max(lat) if lat else None, "n": len(lat)},
            "big_prompt_statuses": {str(s): statuses.count(s) for s in set(statuses)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--mb", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    res = asyncio.run(main_async(args))
    print(json.dumps(res, indent=1))
    if args.out:
        open(args.out, "w").write(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

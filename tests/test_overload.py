"""Overload on a live server over a real engine (tiny Qwen3, NumPy, loopback): a burst of 10x the waiting-queue bound.

Every request is answered promptly (no hang: each has a client timeout, the burst a wall-clock bound); refusals are
429 with Retry-After in the OpenAI error shape and come back at once; every admitted request, streamed or not,
returns exactly what the same greedy request returns alone; afterwards nothing is left queued or holding KV blocks.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fake_engine import LiveServer, scrape, tiny_plan
from tests.test_serve_e2e import prompts
from xserv_aot.engine.api import SamplingParams
from xserv_aot.serve import build_engine
from xserv_aot.server import create_app

MAX_WAITING = 4
BURST = 10 * MAX_WAITING
MAX_TOKENS = 12
COMP = "/v1/completions"


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return tiny_plan(tmp_path_factory)


def alone_texts(plan, texts: list[str]) -> dict[str, str]:
    """Greedy output of each prompt run by itself on a fresh engine (one request at a time)."""
    eng = build_engine(plan, backend="cpu").engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return {t: eng.tokenizer.decode(eng.generate([eng.tokenizer.encode(t)], params)[0].new_token_ids)
            for t in texts}


def one_request(url: str, text: str, stream: bool, start: threading.Barrier) -> dict:
    body = {"model": "tiny", "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    start.wait()
    t0 = time.monotonic()
    with httpx.Client(timeout=60) as client:
        r = client.post(url + COMP, json=body)
    out = {"status": r.status_code, "headers": r.headers, "seconds": time.monotonic() - t0, "text": None,
           "body": r.text}
    if r.status_code == 200 and stream:
        blocks = [b for b in r.text.split("\n\n") if b]
        assert blocks[-1] == "data: [DONE]", r.text[-300:]
        chunks = [json.loads(b[6:]) for b in blocks[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        out["text"] = "".join(c["choices"][0]["text"] for c in chunks)
    elif r.status_code == 200:
        assert r.json()["choices"][0]["finish_reason"] == "length"
        out["text"] = r.json()["choices"][0]["text"]
    return out


def test_burst_of_10x_the_queue(plan):
    texts = prompts(8)
    ae = build_engine(plan, backend="cpu", model_name="tiny", max_waiting=MAX_WAITING, engine_process=True)
    with LiveServer(create_app(ae, model_name="tiny", manage_engine=True)) as url:
        start = threading.Barrier(BURST)
        t0 = time.monotonic()
        with ThreadPoolExecutor(BURST) as pool:
            results = list(pool.map(lambda i: one_request(url, texts[i % len(texts)], i % 2 == 1, start),
                                    range(BURST)))
        wall = time.monotonic() - t0
        ok = [(i, r) for i, r in enumerate(results) if r["status"] == 200]
        refused = [r for r in results if r["status"] == 429]
        assert len(ok) + len(refused) == BURST, [r["status"] for r in results]
        assert len(ok) >= MAX_WAITING and refused, (len(ok), len(refused))
        assert wall < 60
        for r in refused:
            err = json.loads(r["body"])["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and err["message"]
            assert int(r["headers"]["retry-after"]) >= 1
        slowest_refusal = max(r["seconds"] for r in refused)
        assert slowest_refusal < 5.0, slowest_refusal                  # refused at once, not after queueing
        want = alone_texts(plan, texts)
        for i, r in ok:
            assert r["text"] == want[texts[i % len(texts)]], (i, r["text"])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (ae.stats().num_running or ae.stats().num_waiting
                                               or ae.stats().kv_blocks_used):
            time.sleep(0.02)
        st = ae.stats()
        assert (st.num_running, st.num_waiting, st.kv_blocks_used) == (0, 0, 0), st
        def counted(status: str) -> float:                # the counter moves just after the last byte is sent
            return scrape(url).get(("xserv_http_requests_total", frozenset({("endpoint", COMP), ("status", status)})),
                                   0)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (counted("429"), counted("200")) != (len(refused), len(ok)):
            time.sleep(0.02)
        assert (counted("429"), counted("200")) == (len(refused), len(ok))
        again = one_request(url, texts[0], False, threading.Barrier(1))             # capacity is back
        assert again["status"] == 200 and again["text"] == want[texts[0]]

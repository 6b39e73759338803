"""--request-timeout: a request still running (or still queued) after the timeout ends with 504 (or, mid-stream, an
error event + [DONE]); its engine request is aborted and its KV blocks are freed. An engine that never answers
cannot hold a connection open past the timeout.
"""
from __future__ import annotations

import asyncio
import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fake_engine import FakeEngine, LiveServer, scrape, tiny_plan
from xserv_aot.serve import build_engine
from xserv_aot.server import create_app

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
TIMEOUT_S = 0.6


class SlowRunner:
    """A real runner that takes at least `delay` seconds per step, so a long request reliably outlives the timeout."""

    def __init__(self, inner, delay: float):
        self.inner, self.plan, self.delay = inner, inner.plan, delay

    def run(self, batch):
        time.sleep(self.delay)
        return self.inner.run(batch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ae = build_engine(tiny_plan(tmp_path_factory), backend="cpu", model_name="tiny", engine_process=True,
                      runner_wrapper=functools.partial(SlowRunner, delay=0.01))
    with LiveServer(create_app(ae, model_name="tiny", manage_engine=True, request_timeout=TIMEOUT_S)) as url:
        yield ae, url


def settled(ae, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = ae.stats()
        if (st.num_running, st.num_waiting, st.kv_blocks_used) == (0, 0, 0):
            break
        time.sleep(0.02)
    return ae.stats()


LONG = {"model": "tiny", "prompt": "harbor quartz", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


def test_non_streaming_timeout_is_504_and_frees_blocks(served):
    ae, url = served
    before = scrape(url).get(("xserv_request_timeouts_total", frozenset()), 0)
    t0 = time.monotonic()
    r = httpx.post(url + COMP, json=LONG, timeout=30)
    elapsed = time.monotonic() - t0
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "request_timeout" and f"{TIMEOUT_S:g} s" in err["message"]
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 5
    st = settled(ae)
    assert (st.num_running, st.num_waiting, st.kv_blocks_used) == (0, 0, 0), st
    assert ae.debug_state()["seqs"] == 0
    assert scrape(url)[("xserv_request_timeouts_total", frozenset())] == before + 1


def test_streaming_timeout_ends_with_error_event_and_done(served):
    ae, url = served
    with httpx.stream("POST", url + CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                                                "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        text = r.read().decode()
    events = [b[6:] for b in text.split("\n\n") if b]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "request_timeout" and err["type"] == "server_error"
    chunks = [json.loads(e) for e in events[:-2]]
    assert len(chunks) > 2 and all(c["choices"][0]["finish_reason"] is None for c in chunks)
    st = settled(ae)
    assert (st.num_running, st.num_waiting, st.kv_blocks_used) == (0, 0, 0), st


def test_short_requests_are_unaffected(served):
    _, url = served
    r = httpx.post(url + COMP, json={**LONG, "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_queued_requests_time_out_too():
    eng = FakeEngine(max_running=1, step_s=0.01)
    with LiveServer(create_app(eng, model_name="m", request_timeout=0.4)) as url:
        body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
        with httpx.Client(timeout=30) as a, httpx.Client(timeout=30) as b:
            with ThreadPoolExecutor(2) as pool:
                ra, rb = pool.map(lambda c: c.post(url + COMP, json=body), (a, b))
        assert ra.status_code == rb.status_code == 504
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (len(eng.aborted) < 2 or eng._running or eng._waiting):
            time.sleep(0.01)
        assert len(eng.aborted) == 2 and not eng._running and not eng._waiting


class HungEngine(FakeEngine):
    """Accepts requests and never produces an output (a wedged engine thread)."""

    async def generate(self, request_id, prompt_ids, params):
        self.requests[request_id] = (list(prompt_ids), params)
        try:
            await asyncio.Event().wait()
        finally:
            self.abort(request_id)
        yield


@pytest.mark.parametrize("stream", [False, True])
def test_a_hung_engine_cannot_hold_connections(stream):
    eng = HungEngine()
    with LiveServer(create_app(eng, model_name="m", request_timeout=0.3)) as url:
        t0 = time.monotonic()
        r = httpx.post(url + COMP, json={"prompt": "x", "max_tokens": 5, "stream": stream}, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        assert time.monotonic() - t0 < 5 and eng.aborted == list(eng.requests)


def test_request_timeout_must_be_positive():
    with pytest.raises(ValueError, match="request_timeout"):
        create_app(FakeEngine(), model_name="m", request_timeout=0)

"""Engine faults as the server reports them: /health tells the truth (503 with a reason when the engine has failed,
"degraded" after recent step failures), requests during a failure get a generic 500/503 (or an error event + [DONE]
mid-stream) with no engine detail or traceback, and no connection is left hanging.
"""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.fake_engine import FakeEngine, LiveServer, tiny_plan
from xserv_aot.engine.api import EngineFailedError, EngineStats, RequestOutput
from xserv_aot.serve import build_engine
from xserv_aot.server import create_app

COMP = "/v1/completions"
SECRET = "secret engine detail /internal/path"


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert SECRET not in r.text and "Traceback" not in r.text and "injected" not in r.text
    return r.json()["error"]


def events_of(r: httpx.Response) -> list:
    assert r.status_code == 200 and SECRET not in r.text and "Traceback" not in r.text
    blocks = [b[6:] for b in r.text.split("\n\n") if b]
    assert blocks[-1] == "[DONE]", r.text[-300:]
    return [json.loads(b) for b in blocks[:-1]]


class BrokenEngine(FakeEngine):
    """generate() fails in the way `mode` says, with SECRET in the exception text."""

    def __init__(self, mode: str, **kw):
        super().__init__(**kw)
        self.mode = mode

    async def generate(self, request_id, prompt_ids, params):
        self.requests[request_id] = (list(prompt_ids), params)
        if self.mode == "failed":
            raise EngineFailedError(SECRET)
        for i in range(3):
            yield self._out(request_id, i)
        if self.mode == "raise":
            raise RuntimeError(SECRET)
        # mode "truncated": the stream just stops, with no finish_reason

    @staticmethod
    def _out(rid, i):
        return RequestOutput(rid, [100 + i], "ab"[i % 2], None, None, 3, i + 1, 0)


@pytest.mark.parametrize("mode,status", [("failed", 503), ("raise", 500), ("truncated", 500)])
def test_engine_failures_are_generic(mode, status):
    eng = BrokenEngine(mode)
    with LiveServer(create_app(eng, model_name="m")) as url:
        body = {"prompt": "x", "max_tokens": 8}
        err = error_of(httpx.post(url + COMP, json=body, timeout=20), status)
        assert err["type"] == "server_error" and err["message"] in ("internal error while generating",
                                                                    "the inference engine is not available")
        r = httpx.post(url + COMP, json={**body, "stream": True}, timeout=20)
        if mode == "failed":                                   # refused before the stream starts
            assert error_of(r, 503)["code"] == "engine_unavailable"
        else:
            chunks = events_of(r)
            assert chunks[-1]["error"]["message"] == "internal error while generating"
            assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["a", "b", "a"]
        assert len(eng.requests) == 2
        if mode != "failed":                                   # the server tells the engine to drop them
            deadline = time.monotonic() + 5                    # (the stream's close runs after [DONE] is sent)
            while time.monotonic() < deadline and len(eng.aborted) < 2:
                time.sleep(0.01)
            assert eng.aborted == list(eng.requests)


def stats(**kw) -> EngineStats:
    return EngineStats(**{**dict(num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_total=8,
                                 prefix_cache_queries=0, prefix_cache_hits=0), **kw})


def test_health_tells_the_truth():
    eng = FakeEngine()
    with LiveServer(create_app(eng, model_name="m")) as url:
        def health():
            return httpx.get(url + "/health", timeout=20)
        assert health().json() == {"status": "ok"}
        eng.stats = lambda: stats(consecutive_failures=2, num_step_failures=2, last_error=SECRET)
        r = health()
        assert r.status_code == 200 and r.json() == {"status": "degraded", "consecutive_step_failures": 2}
        eng.stats = lambda: stats(healthy=False, last_error=SECRET)
        err = error_of(health(), 503)
        assert err["code"] == "engine_unhealthy" and "failed" in err["message"]
        eng.stats = lambda: 1 / 0
        assert error_of(health(), 503)["code"] == "engine_unhealthy"


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return tiny_plan(tmp_path_factory)


def test_engine_stopped_under_the_server(plan):
    """The engine core process stops while a stream is open: the stream ends (no hang), new requests get 503 at once."""
    ae = build_engine(plan, backend="cpu", model_name="tiny", engine_process=True)
    with LiveServer(create_app(ae, model_name="tiny", manage_engine=True)) as url:
        body = {"model": "tiny", "prompt": "orbit signal", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", url + COMP, json={**body, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            ae.shutdown()
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
        t0 = time.monotonic()
        err = error_of(httpx.post(url + COMP, json=body, timeout=30), 503)
        assert err["code"] == "engine_unavailable" and time.monotonic() - t0 < 5

"""Graceful shutdown: admission stops (503, /health says draining), requests in flight get the grace period, the rest
end with a final chunk (finish_reason "abort") and [DONE], and `xserv-aot serve` exits 0 on SIGTERM.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.fake_engine import FakeEngine, LiveServer, tiny_plan, wait_until
from xserv_aot.server import create_app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMP = "/v1/completions"


class Stream(threading.Thread):
    """Reads one SSE completion stream in the background; `events` fills as chunks arrive."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list = []
        self.status = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None

    def run(self):
        try:
            with httpx.stream("POST", self.url + COMP, json={**self.body, "stream": True}, timeout=60) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
        except BaseException as e:                  # noqa: BLE001 - reported by the test
            self.error = e
        self.ended_at = time.monotonic()

    def wait_for_chunks(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events) < n:
            assert time.monotonic() < deadline and self.is_alive(), (self.status, self.error, self.events[-2:])
            time.sleep(0.01)

    def finish(self, timeout: float = 30.0) -> tuple[str, str]:
        """(finish_reason of the final chunk, the streamed text); asserts the stream ended with [DONE]."""
        self.join(timeout)
        assert not self.is_alive() and self.error is None and self.status == 200, (self.status, self.error)
        assert self.events[-1] == "[DONE]", self.events[-3:]
        chunks = self.events[:-1]
        assert all("error" not in c for c in chunks), chunks[-2:]
        finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and chunks[-1]["choices"][0]["finish_reason"] == finals[0], chunks[-3:]
        return finals[0], "".join(c["choices"][0]["text"] for c in chunks)


def assert_draining(url: str) -> None:
    h = httpx.get(url + "/health", timeout=10)
    assert h.status_code == 503 and h.json()["error"]["code"] == "draining", h.text
    r = httpx.post(url + COMP, json={"prompt": "new", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text


def test_drain_lets_short_requests_finish_and_aborts_the_rest():
    eng = FakeEngine(step_s=0.01, max_seq_len=4096)
    grace = 2.0
    srv = LiveServer(create_app(eng, model_name="m"), shutdown_grace=grace)
    with srv as url:
        long = Stream(url, {"prompt": "long", "max_tokens": 2000, "ignore_eos": True})
        short = Stream(url, {"prompt": "short", "max_tokens": 30, "ignore_eos": True})
        result = {}
        blocking = threading.Thread(target=lambda: result.update(r=httpx.post(
            url + COMP, json={"prompt": "blocking", "max_tokens": 2000, "ignore_eos": True}, timeout=60)))
        for t in (long, short, blocking):
            t.start()
        long.wait_for_chunks(3)
        short.wait_for_chunks(3)
        assert wait_until(lambda: len(eng.requests) == 3)
        t0 = time.monotonic()
        srv.begin_shutdown()
        assert wait_until(lambda: httpx.get(url + "/health", timeout=10).status_code == 503)
        assert_draining(url)
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
        reason, text = short.finish()
        assert reason == "length" and len(text) == 30         # not aborted: it finished inside the grace
        reason, text = long.finish()
        assert reason == "abort" and 0 < len(text) < 2000
        assert long.ended_at - t0 >= grace * 0.9
        blocking.join(30)
        body = result["r"].json()
        assert result["r"].status_code == 200 and body["choices"][0]["finish_reason"] == "abort"
        assert len(eng.requests) == 3 and len(eng.aborted) == 2   # the 503 never reached the engine
        srv.thread.join(15)
        assert not srv.thread.is_alive()


def test_drain_with_nothing_in_flight_stops_at_once():
    eng = FakeEngine()
    srv = LiveServer(create_app(eng, model_name="m", manage_engine=True), shutdown_grace=600)
    with srv as url:
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        srv.begin_shutdown()
        srv.thread.join(120)                                      # far less than the 600 s grace
        assert not srv.thread.is_alive()
    assert not eng.started                                        # the lifespan shut the engine down


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """The tiny Qwen3 with a 4096-token context: a 2000-token stream outlasts the grace period on any machine."""
    from tests.tiny_models import E2E_BUILD as BUILD
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    hf = tiny_plan(tmp_path_factory).parent / "hf"
    long_hf = tmp_path_factory.mktemp("long-context-hf")
    for f in hf.iterdir():                                        # same weights, a longer position range
        if f.name != "config.json":
            (long_hf / f.name).symlink_to(f)
    config = json.loads((hf / "config.json").read_text())
    (long_hf / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    out = long_hf.parent / "plan-long-context"
    compile_plan(long_hf, out, BuildConfig(**{**BUILD, "max_seq_len": 4096}, num_blocks=1040))
    return out


@contextlib.contextmanager
def serve_process(plan, port: int, grace: float, tmp_path, *args: str):
    """`xserv-aot serve PLAN` on the CPU, its output in tmp_path/serve.log; killed at exit if still running."""
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "xserv_aot.cli", "serve", str(plan), "--backend", "cpu",
                                 "--port", str(port), "--shutdown-grace", str(grace), "--model-name", "tiny", *args],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def serve_log(tmp_path) -> str:
    return (tmp_path / "serve.log").read_text(errors="replace")


def wait_healthy(url: str, proc) -> None:
    """Until the server process answers /health 200 (it must not exit meanwhile)."""
    def up():
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False
    assert wait_until(lambda: up() or proc.poll() is not None, timeout=90) and proc.poll() is None


@pytest.mark.parametrize("process_flag", ["--engine-process", "--no-engine-process"])
def test_sigterm_mid_stream_ends_streams_and_exits_0(plan, tmp_path, process_flag):
    """Waits on events only: the drain is seen (503) inside a grace far longer than the test, then a second SIGTERM
    ends the grace, the stream ends with "abort" and the process exits 0."""
    port, grace = free_port(), 600.0
    url = f"http://127.0.0.1:{port}"
    with serve_process(plan, port, grace, tmp_path, process_flag) as proc:
        wait_healthy(url, proc)
        long = Stream(url, {"model": "tiny", "prompt": "river violet engine", "max_tokens": 2000, "temperature": 0,
                            "ignore_eos": True})
        long.start()
        long.wait_for_chunks(4)
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: httpx.get(url + "/health", timeout=5).status_code == 503, timeout=120)
        assert_draining(url)
        assert long.is_alive()                                    # in flight, inside its grace
        proc.send_signal(signal.SIGTERM)                          # the second one ends the grace
        reason, text = long.finish(timeout=120)
        assert reason == "abort" and text
        assert proc.wait(timeout=60) == 0
    assert "Traceback" not in serve_log(tmp_path), serve_log(tmp_path)[-3000:]


def test_second_shutdown_request_skips_the_grace():
    eng = FakeEngine(step_s=0.01, max_seq_len=200_000)
    srv = LiveServer(create_app(eng, model_name="m"), shutdown_grace=600)
    with srv as url:
        long = Stream(url, {"prompt": "long", "max_tokens": 100000, "ignore_eos": True})
        long.start()
        long.wait_for_chunks(3)
        srv.begin_shutdown()
        assert wait_until(lambda: httpx.get(url + "/health", timeout=10).status_code == 503)
        srv.begin_shutdown()                                      # like a second Ctrl-C
        reason, _ = long.finish(timeout=120)
        assert reason == "abort"                                  # ended long before the 600 s grace
        srv.thread.join(15)
        assert not srv.thread.is_alive()

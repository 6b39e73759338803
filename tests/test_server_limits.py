"""Hostile clients on loopback: idle sockets, slow headers, slow bodies, too many requests in flight, slow uploads at
SIGTERM. Every wait is on an event (a socket closing, a counter moving) with a generous bound, never a timing."""
from __future__ import annotations

import contextlib
import json
import logging
import socket

import httpx
import pytest

from tests.fake_engine import FakeEngine, LiveServer, wait_until
from tests.test_shutdown import Stream
from xserv_aot.server import create_app

COMP = "/v1/completions"


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    return s


def read_response(s: socket.socket) -> bytes:
    """Everything until the server closes the connection (b"" when it closed without answering)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def body_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_idle_connections_do_not_block_requests():
    """More idle sockets than the old connection limit (512): /health and generation still answer."""
    with LiveServer(create_app(FakeEngine(), model_name="m"), header_timeout=60) as url:
        with contextlib.ExitStack() as stack:
            for _ in range(530):
                stack.enter_context(connect(url))
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            r = httpx.post(url + COMP, json={"prompt": "say:ok", "max_tokens": 5}, timeout=30)
            assert r.status_code == 200, r.text


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"],
                         ids=["idle", "partial-head"])
def test_connections_without_a_request_head_are_closed(sent):
    with LiveServer(create_app(FakeEngine(), model_name="m"), header_timeout=0.3) as url:
        with connect(url) as s:
            s.sendall(sent)
            assert read_response(s) == b""                # closed by the server, not by our 30 s socket timeout


def test_keep_alive_connection_then_a_slow_head_is_closed():
    with LiveServer(create_app(FakeEngine(), model_name="m"), header_timeout=0.3, timeout_keep_alive=60) as url:
        with connect(url) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while b'"status"' not in got:
                got += s.recv(65536)
            s.sendall(b"GET /health HTTP/1.1\r\n")      # the next head never completes
            assert read_response(s) == b""


def test_slow_body_gets_408():
    with LiveServer(create_app(FakeEngine(), model_name="m", body_timeout=0.3), header_timeout=60) as url:
        with connect(url) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            status, body = body_json(read_response(s))
        assert status == 408 and body["error"]["code"] == "request_timeout"
        assert httpx.get(url + "/health", timeout=30).status_code == 200


def test_requests_in_flight_are_bounded_health_is_not():
    eng = FakeEngine(step_s=0.01, max_seq_len=4096)
    with LiveServer(create_app(eng, model_name="m", max_in_flight=2)) as url:
        streams = [Stream(url, {"prompt": f"long {i}", "max_tokens": 3000, "ignore_eos": True}) for i in range(2)]
        for s in streams:
            s.start()
        for s in streams:
            s.wait_for_chunks(2)
        r = httpx.post(url + COMP, json={"prompt": "third", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy" and r.headers["retry-after"]
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        for rid in list(eng.requests):
            eng.abort(rid)
        for s in streams:
            s.join(30)
        assert wait_until(lambda: httpx.post(url + COMP, json={"prompt": "say:x", "max_tokens": 2},
                                             timeout=30).status_code == 200)


def test_sigterm_ends_slow_uploads_with_503_and_no_traceback(caplog):
    caplog.set_level(logging.INFO)
    app = create_app(FakeEngine(), model_name="m")
    srv = LiveServer(app, shutdown_grace=60, header_timeout=60)
    with srv as url:
        uploads = [connect(url) for _ in range(5)]
        for s in uploads:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
        gate = app.middleware_stack
        while not hasattr(gate, "in_flight"):
            gate = gate.app
        assert wait_until(lambda: gate.in_flight == 5, timeout=30)
        srv.begin_shutdown()
        for s in uploads:
            status, body = body_json(read_response(s))
            assert status == 503 and body["error"]["code"] == "server_shutting_down"
            s.close()
        srv.thread.join(30)                                 # the 60 s grace is not waited for: nothing is in flight
        assert not srv.thread.is_alive()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


class CountingTokenizer:
    """FakeTokenizer that records the length of every text it is asked to tokenize."""

    def __init__(self, inner):
        self.inner, self.sizes = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text, *a, **kw):
        self.sizes.append(len(text))
        return self.inner.encode(text, *a, **kw)

    def encode_chat(self, messages, *a, **kw):
        self.sizes.append(sum(len(m.get("content") or "") for m in messages))
        return self.inner.encode_chat(messages, *a, **kw)


def test_big_prompts_are_refused_before_tokenizing_while_a_stream_runs():
    from tests.fake_engine import FakeTokenizer
    from xserv_aot.server.app import MAX_PROMPT_BYTES_PER_TOKEN
    tok = CountingTokenizer(FakeTokenizer())
    eng = FakeEngine(tok, step_s=0.01, max_seq_len=1024)
    limit = 1024 * MAX_PROMPT_BYTES_PER_TOKEN
    with LiveServer(create_app(eng, model_name="m", max_request_bytes=4_000_000)) as url:
        stream = Stream(url, {"prompt": "long", "max_tokens": 600, "ignore_eos": True})
        stream.start()
        stream.wait_for_chunks(2)
        big = "a" * 1_000_000
        for body, path in [({"prompt": big, "max_tokens": 1}, COMP),
                           ({"messages": [{"role": "user", "content": big}]}, "/v1/chat/completions"),
                           ({"prompt": list(range(3, 2000)), "max_tokens": 1}, COMP)]:
            r = httpx.post(url + path, json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert max(tok.sizes) <= limit                     # the big texts never reached the tokenizer
        ok = httpx.post(url + COMP, json={"prompt": "b" * (limit - 100), "max_tokens": 1}, timeout=60)
        assert ok.status_code == 400 and "maximum context length" in ok.text   # tokenized, then too many tokens
        assert max(tok.sizes) == limit - 100
        reason, text = stream.finish()
        assert reason == "length" and len(text) == 600


def test_queued_stream_gets_headers_at_once_and_keep_alives():
    eng = FakeEngine(step_s=0.01, max_seq_len=4096, max_running=1)
    with LiveServer(create_app(eng, model_name="m", sse_keepalive=0.05)) as url:
        running = Stream(url, {"prompt": "first", "max_tokens": 3000, "ignore_eos": True})
        running.start()
        running.wait_for_chunks(2)
        lines = []
        with httpx.stream("POST", url + COMP, json={"prompt": "queued", "max_tokens": 3, "stream": True},
                          timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            it = r.iter_lines()
            while len([ln for ln in lines if ln.startswith(":")]) < 2:
                lines.append(next(it))
            assert running.is_alive() and running.ended_at is None       # still queued behind it
            assert not any(ln.startswith("data: ") for ln in lines)
            for rid in list(eng.requests):
                if eng.requests[rid][0][1:] == [ord(c) + 3 for c in "first"]:
                    eng.abort(rid)
            lines += list(it)
        data = [ln for ln in lines if ln.startswith("data: ")]
        assert data[-1] == "data: [DONE]" and json.loads(data[-2][6:])["choices"][0]["finish_reason"] == "length"
        running.join(30)


def test_queue_full_is_still_429_for_streams():
    eng = FakeEngine(step_s=0.01, max_seq_len=4096, max_running=1, max_waiting=0)
    with LiveServer(create_app(eng, model_name="m")) as url:
        running = Stream(url, {"prompt": "first", "max_tokens": 3000, "ignore_eos": True})
        running.start()
        running.wait_for_chunks(2)
        r = httpx.post(url + COMP, json={"prompt": "x", "max_tokens": 3, "stream": True}, timeout=30)
        assert r.status_code == 429, r.text
        for rid in list(eng.requests):
            eng.abort(rid)
        running.join(30)

"""Every refusal comes back with the right status and the OpenAI error shape {"error": {message, type, param, code}}.

Runs on FakeEngine (max_seq_len 64; `boom:raise` / `boom:error` prompts simulate engine failures).
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.fake_engine import FakeEngine, LiveServer, scrape
from xserv_aot.engine.api import InvalidRequestError, RequestTooLongError
from xserv_aot.server import create_app

TIMEOUT = 20.0
MSGS = [{"role": "user", "content": "hello"}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(max_seq_len=64)


@pytest.fixture(scope="module")
def base_url(engine):
    with LiveServer(create_app(engine, model_name=engine.model_name, max_request_bytes=4096)) as url:
        yield url


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"]
    assert isinstance(err["type"], str)
    return err


def post(base_url, path, body=None, **kw):
    kw.setdefault("timeout", TIMEOUT)
    return httpx.post(base_url + path, json=body, **kw) if body is not None else httpx.post(base_url + path, **kw)


def test_malformed_json(base_url):
    for raw in (b"{not json", b"\xff\xfe", b"", b"[" * 4000):
        err = error_of(post(base_url, CHAT, content=raw, headers={"content-type": "application/json"}), 400)
        assert "JSON" in err["message"]
    error_of(post(base_url, CHAT, [1, 2]), 400)


BAD_CHAT = [
    ({"temperature": "hot"}, "temperature"), ({"temperature": -0.1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"), ({"seed": 1.5}, "seed"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 5}, "stop"), ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": "yes"}, "logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"n": 17}, "n"), ({"n": 0}, "n"), ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"ignore_eos": 1}, "ignore_eos"),
    ({"messages": []}, "messages"), ({"messages": None}, "messages"), ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"), ({"model": 3}, "model"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "xml"}}, "response_format"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"), ({"unknown_thing": 1}, "unknown_thing"), ({"best_of": 2}, "best_of"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                 "function": {"name": "g"}}},
     "tool_choice"),
    ({"guided_choice": []}, "guided_choice"), ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"), ({"min_tokens": -1}, "min_tokens"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                                       "arguments": "{no"}}]}]},
     "messages"),
]


@pytest.mark.parametrize("patch,param", BAD_CHAT, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_CHAT)])
def test_bad_chat_fields(base_url, engine, patch, param):
    err = error_of(post(base_url, CHAT, {"model": engine.model_name, "messages": MSGS, **patch}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


BAD_COMP = [({"prompt": ["a", 5]}, "prompt"), ({"prompt": [[1, 2], []]}, "prompt"), ({"prompt": ""}, "prompt"),
            ({"prompt": 5}, "prompt"), ({"prompt": [1, "x"]}, "prompt"), ({"logprobs": 21}, "logprobs"),
            ({"logprobs": True}, "logprobs"), ({"echo": True, "logprobs": 1}, "echo"), ({"best_of": 1, "n": 2}, "best_of"),
            ({"best_of": 3, "stream": True}, "best_of"), ({"suffix": "end"}, "suffix"), ({"prompt": ["a"] * 65}, "prompt"),
            ({"messages": [{"role": "user", "content": "x"}]}, "messages"), ({"tools": []}, "tools")]


@pytest.mark.parametrize("patch,param", BAD_COMP, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_COMP)])
def test_bad_completion_fields(base_url, engine, patch, param):
    err = error_of(post(base_url, COMP, {"model": engine.model_name, "prompt": "hi", **patch}), 400)
    assert err["param"] == param


def test_nan_temperature_is_refused(base_url, engine):
    raw = json.dumps({"model": engine.model_name, "messages": MSGS}).replace("}]}", "}], \"temperature\": NaN}")
    err = error_of(post(base_url, CHAT, content=raw.encode(), headers={"content-type": "application/json"}), 400)
    assert err["param"] == "temperature"


def test_out_of_vocab_prompt_id(base_url, engine):
    error_of(post(base_url, COMP, {"prompt": [engine.tokenizer.vocab_size + 5]}), 400)


def test_too_long_states_both_numbers(base_url, engine):
    n = len(engine.tokenizer.encode("hi"))
    err = error_of(post(base_url, COMP, {"prompt": "hi", "max_tokens": 100}), 400)
    assert str(engine.max_seq_len) in err["message"] and str(n + 100) in err["message"]
    assert err["code"] == "context_length_exceeded"
    err = error_of(post(base_url, COMP, {"prompt": "x" * 200}), 400)
    assert str(engine.max_seq_len) in err["message"] and str(len(engine.tokenizer.encode("x" * 200))) in err["message"]
    with openai.OpenAI(base_url=base_url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=engine.model_name, messages=MSGS, max_tokens=1000)
        assert e.value.status_code == 400


@pytest.mark.parametrize("exc", [RequestTooLongError, InvalidRequestError])
def test_engine_refusals_map_to_400(exc):
    class Strict(FakeEngine):
        async def generate(self, request_id, prompt_ids, params):
            raise exc(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds 10")
            yield
    eng = Strict()
    with LiveServer(create_app(eng, model_name="m")) as url:
        for stream in (False, True):
            err = error_of(post(url, COMP, {"prompt": "hello", "max_tokens": 8, "stream": stream}), 400)
            assert "exceeds 10" in err["message"]
        assert eng.aborted == [] and scrape(url).get(("xserv_requests_aborted_total", frozenset())) == 0


def test_unknown_model_404(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="gpt-nope", messages=MSGS)
    assert e.value.status_code == 404
    err = error_of(post(base_url, COMP, {"model": "gpt-nope", "prompt": "x"}), 404)
    assert err["param"] == "model" and "gpt-nope" in err["message"]


def test_queue_full_429_with_retry_after():
    eng = FakeEngine(max_running=1, max_waiting=0, step_s=0.01)
    with LiveServer(create_app(eng, model_name="m")) as url:
        body = {"prompt": "x", "max_tokens": 100, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + COMP, json=body, timeout=TIMEOUT) as busy:
            assert busy.status_code == 200
            r = post(url, COMP, {"prompt": "y", "max_tokens": 4})
            err = error_of(r, 429)
            assert int(r.headers["retry-after"]) >= 1 and err["type"] == "rate_limit_error"
            with openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0) as client:
                with pytest.raises(openai.RateLimitError):
                    client.completions.create(model="m", prompt="z", max_tokens=2)
            busy.read()
        assert post(url, COMP, {"prompt": "y", "max_tokens": 4}).status_code == 200


def test_engine_failure_500_hides_details(base_url):
    for stream in (False, True):
        for path, body in ((COMP, {"prompt": "boom:raise"}), (CHAT, {"messages": [{"role": "user",
                                                                                  "content": "boom:raise"}]})):
            r = post(base_url, path, {**body, "max_tokens": 4, "stream": stream})
            err = error_of(r, 500)
            assert "secret" not in r.text and "Traceback" not in r.text and err["type"] == "server_error"
    r = post(base_url, COMP, {"prompt": "boom:error", "max_tokens": 8})
    error_of(r, 500)
    assert "secret" not in r.text


def test_engine_error_mid_stream_sends_error_event(base_url):
    key = ("xserv_requests_finished_total", frozenset({("finish_reason", "error")}))
    before = scrape(base_url).get(key, 0.0)
    body = {"prompt": "boom:error", "max_tokens": 8, "stream": True}
    with httpx.stream("POST", base_url + COMP, json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        text = r.read().decode()
    events = [b[6:] for b in text.split("\n\n") if b]
    assert events[-1] == "[DONE]" and "secret" not in text
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    assert scrape(base_url)[key] == before + 1


def test_body_too_large_413(base_url):
    big = {"prompt": "x" * 5000}
    err = error_of(post(base_url, COMP, big), 413)
    assert "4096" in err["message"]

    def chunks():                                             # no content-length: chunked transfer encoding
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]
    error_of(post(base_url, COMP, content=chunks(), headers={"content-type": "application/json"}), 413)


def test_unknown_route_and_method(base_url):
    error_of(httpx.get(base_url + "/v1/nope", timeout=TIMEOUT), 404)
    error_of(httpx.get(base_url + CHAT, timeout=TIMEOUT), 405)


def test_health_503_when_engine_unhealthy():
    eng = FakeEngine()
    with LiveServer(create_app(eng, model_name="m")) as url:
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
        eng.healthy = False
        error_of(httpx.get(url + "/health", timeout=TIMEOUT), 503)
        assert scrape(url)[("xserv_engine_healthy", frozenset())] == 0
        eng.stats = lambda: 1 / 0
        error_of(httpx.get(url + "/health", timeout=TIMEOUT), 503)
        assert httpx.get(url + "/metrics", timeout=TIMEOUT).status_code == 200


def test_error_statuses_are_counted(base_url):
    keys = [("xserv_http_requests_total", frozenset({("endpoint", CHAT), ("status", "400")})),
            ("xserv_http_requests_total", frozenset({("endpoint", COMP), ("status", "404")})),
            ("xserv_http_requests_total", frozenset({("endpoint", "other"), ("status", "404")}))]
    before = scrape(base_url)
    post(base_url, CHAT, {"messages": []})
    post(base_url, COMP, {"model": "nope", "prompt": "x"})
    httpx.get(base_url + "/no/such/path", timeout=TIMEOUT)
    after = scrape(base_url)
    assert [after[k] - before.get(k, 0.0) for k in keys] == [1, 1, 1]


def test_api_key():
    eng = FakeEngine()
    with LiveServer(create_app(eng, model_name="m", api_key="s3cret")) as url:
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            err = error_of(post(url, COMP, body, headers=headers), 401)
            assert err["code"] == "invalid_api_key"
            error_of(httpx.get(url + "/metrics", headers=headers, timeout=TIMEOUT), 401)
            error_of(httpx.get(url + "/v1/models", headers=headers, timeout=TIMEOUT), 401)
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
        ok = {"Authorization": "Bearer s3cret"}
        assert post(url, COMP, body, headers=ok).status_code == 200
        assert httpx.get(url + "/metrics", headers=ok, timeout=TIMEOUT).status_code == 200
        with openai.OpenAI(base_url=url + "/v1", api_key="s3cret", timeout=TIMEOUT, max_retries=0) as client:
            assert client.completions.create(model="m", prompt="hi", max_tokens=2).choices[0].text is not None
        with openai.OpenAI(base_url=url + "/v1", api_key="bad", timeout=TIMEOUT, max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        assert len(eng.requests) == 2                              # refused requests never reached the engine


def test_oversized_headers_refused_and_server_survives(base_url):
    r = httpx.get(base_url + "/version", headers={"x-big": "a" * 40_000}, timeout=TIMEOUT)
    assert r.status_code in (400, 431)
    assert httpx.get(base_url + "/version", timeout=TIMEOUT).status_code == 200


def test_manage_engine_lifespan():
    eng = FakeEngine()
    with LiveServer(create_app(eng, model_name="m", manage_engine=True)):
        assert eng.started
    assert not eng.started

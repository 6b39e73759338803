"""The OpenAI-compatible server on loopback, driven by the official `openai` client and raw httpx.

Tests named test_fake_* rely on FakeEngine's scripted output (`say:`) or instrumentation (engine.aborted);
the others hold for any deterministic engine (greedy decoding, fixed seeds). To run those against a real
engine, pass --server-plan path/to/plan (served with the NumPy backend); test_fake_* then skip.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.fake_engine import FakeEngine, FakeTokenizer, LiveServer, scrape, wait_until
from xserv_aot.server import create_app

TIMEOUT = 20.0
MSGS = [{"role": "user", "content": "Write a short story about a cat."}]


@pytest.fixture(scope="module")
def engine(request):
    real_plan = request.config.getoption("--server-plan")
    if not real_plan:
        yield FakeEngine()
        return
    from xserv_aot.serve import build_engine
    eng = build_engine(real_plan, backend="cpu", model_name="real")
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def _fake_only(request):
    if request.config.getoption("--server-plan") and request.node.name.startswith("test_fake_"):
        pytest.skip("needs FakeEngine (scripted output / instrumentation)")


@pytest.fixture(scope="module")
def base_url(engine):
    with LiveServer(create_app(engine, model_name=engine.model_name)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0) as c:
        yield c


def sse_events(base_url: str, path: str, body: dict) -> list:
    """Raw wire format: every event is `data: <json>` or `data: [DONE]`, separated by blank lines."""
    with httpx.stream("POST", base_url + path, json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    blocks = [b for b in raw.split("\n\n") if b]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), raw
    return [b[6:] if b[6:] == "[DONE]" else json.loads(b[6:]) for b in blocks]


def chat(client, engine, **kw):
    return client.chat.completions.create(model=engine.model_name, messages=kw.pop("messages", MSGS), **kw)


def test_chat_non_streaming_usage(client, engine):
    r = chat(client, engine, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == engine.model_name
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode_chat(MSGS, add_generation_prompt=True))
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_length_finish_counts_max_tokens(client, engine):
    r = chat(client, engine, max_completion_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
    c = client.completions.create(model=engine.model_name, prompt="Once upon", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 5


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_text_equals_non_streamed(client, engine, kind):
    args = dict(model=engine.model_name, max_tokens=24, temperature=0, seed=1)
    if kind == "chat":
        full = client.chat.completions.create(messages=MSGS, **args)
        chunks = list(client.chat.completions.create(messages=MSGS, stream=True, **args))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == full.choices[0].message.content
    else:
        full = client.completions.create(prompt="The cat sat", **args)
        chunks = list(client.completions.create(prompt="The cat sat", stream=True, **args))
        text = "".join(c.choices[0].text for c in chunks)
        assert text == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == full.choices[0].finish_reason and not any(reasons[:-1])
    assert len({c.id for c in chunks}) == 1


def test_include_usage_with_openai_client(client, engine):
    chunks = list(chat(client, engine, max_tokens=6, temperature=0, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    full = chat(client, engine, max_tokens=6, temperature=0)
    u, f = chunks[-1].usage, full.usage                         # cached_tokens may differ: the cache warms up
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (f.prompt_tokens, f.completion_tokens,
                                                                       f.total_tokens)


def test_sse_wire_format_and_include_usage(base_url, engine):
    body = {"model": engine.model_name, "messages": MSGS, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events = sse_events(base_url, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] <= 6
    u = usage_chunk["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    plain = sse_events(base_url, "/v1/completions", {**body, "prompt": "hi", "messages": None,
                                                    "stream_options": None})
    assert plain[-1] == "[DONE]" and all("usage" not in c for c in plain[:-1])
    assert all(c["object"] == "text_completion" for c in plain[:-1])


def test_stop_string_truncates_before_first_occurrence(client, engine):
    args = dict(max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    text = chat(client, engine, **args).choices[0].message.content
    assert len(text) >= 6, "need some text to pick a stop string from"
    stop = text[3:5]
    r = chat(client, engine, stop=[stop, "\u2603never"], **args)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, engine, stop=stop, stream=True, **args))
    assert streamed == text[:text.index(stop)]


def test_seed_reproducible(client, engine):
    args = dict(max_tokens=16, temperature=1.0, top_p=0.95, extra_body={"ignore_eos": True})
    a = chat(client, engine, seed=123, **args).choices[0].message.content
    b = chat(client, engine, seed=123, **args).choices[0].message.content
    assert a == b


def test_fake_different_seeds_differ(client, engine):
    args = dict(max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    outs = {chat(client, engine, seed=s, **args).choices[0].message.content for s in range(4)}
    assert len(outs) > 1


def test_chat_logprobs(client, engine):
    r = chat(client, engine, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-5)        # greedy picks the most likely token
        assert entry.bytes == list(entry.token.encode())
    streamed = chat(client, engine, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True)
    flat = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in flat] == [(e.token, round(e.logprob, 5)) for e in content]
    plain = chat(client, engine, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_and_token_prompt(client, engine):
    args = dict(model=engine.model_name, max_tokens=6, temperature=0)
    r = client.completions.create(prompt="The cat", logprobs=2, **args)
    lp = r.choices[0].logprobs
    n = len(lp.tokens)
    assert n == r.usage.completion_tokens == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(len(t) == 2 and max(t.values()) == pytest.approx(v, abs=1e-5)
               for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    ids = engine.tokenizer.encode("The cat")
    by_ids = client.completions.create(prompt=ids, **args)
    assert by_ids.choices[0].text == r.choices[0].text and by_ids.usage.prompt_tokens == len(ids)


def test_fake_completion_logprob_tokens_spell_the_text(client, engine):
    r = client.completions.create(model=engine.model_name, prompt="say:hello there", max_tokens=20, temperature=0,
                                  logprobs=1)
    assert r.choices[0].text == "hello there" and r.choices[0].finish_reason == "stop"
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == "hello there</s>"
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_fake_parameters_reach_the_engine(client, engine):
    r = chat(client, engine, max_tokens=5, temperature=0.5, top_p=0.9, seed=7, frequency_penalty=0.5,
             presence_penalty=-0.5, stop=["zz"], user="someone",
             extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [5],
                         "ignore_eos": True})
    _, p = engine.requests[r.id]
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.top_k, p.min_p) == (5, 0.5, 0.9, 7, 20, 0.05)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == (["zz"], [5], True, None)
    r = chat(client, engine, temperature=0)                         # default: up to the context limit
    prompt, p = engine.requests[r.id]
    assert p.max_tokens == engine.max_seq_len - len(prompt)


def test_fake_prefix_cache_reported(client, engine):
    msgs = [{"role": "user", "content": "say:ok " + "long shared prefix " * 4}]
    chat(client, engine, messages=msgs, max_tokens=4)
    r = chat(client, engine, messages=msgs, max_tokens=4)
    assert r.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("think_in_prompt", [False, True])
def test_fake_reasoning_content(think_in_prompt):
    eng = FakeEngine(FakeTokenizer(thinking=True, think_in_prompt=think_in_prompt))
    script = ("" if think_in_prompt else "<think>\\n") + "step one\\nstep two\\n</think>\\n\\nThe answer."
    msgs = [{"role": "user", "content": "say:" + script}]
    with LiveServer(create_app(eng, model_name="m")) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0) as client:
        r = client.chat.completions.create(model="m", messages=msgs, temperature=0)
        msg = r.choices[0].message
        assert msg.content == "The answer." and msg.reasoning_content == "step one\nstep two"
        chunks = list(client.chat.completions.create(model="m", messages=msgs, temperature=0, stream=True))
        deltas = [c.choices[0].delta for c in chunks]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "step one\nstep two"
        assert "".join(d.content or "" for d in deltas) == "The answer."
        off = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "say:plain"}],
                                             temperature=0, extra_body={"chat_template_kwargs":
                                                                        {"enable_thinking": False}})
        assert off.choices[0].message.content == "plain"
        assert getattr(off.choices[0].message, "reasoning_content", None) is None
        assert "</think>" in eng.tokenizer.decode(eng.requests[off.id][0])     # kwargs reached the template


def test_fake_no_reasoning_parser_without_think_template(client, engine):
    r = chat(client, engine, messages=[{"role": "user", "content": "say:<think>x</think>y"}], temperature=0)
    assert r.choices[0].message.content == "<think>x</think>y"
    assert getattr(r.choices[0].message, "reasoning_content", None) is None


def test_models_health_version(client, base_url, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [engine.model_name]
    assert models[0].model_extra["max_model_len"] == engine.max_seq_len
    assert client.models.retrieve(engine.model_name).id == engine.model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert httpx.get(base_url + "/health", timeout=TIMEOUT).status_code == 200
    v = httpx.get(base_url + "/version", timeout=TIMEOUT)
    assert v.status_code == 200 and isinstance(v.json()["version"], str)


def test_metrics_move(client, base_url, engine):
    before = scrape(base_url)
    r = chat(client, engine, max_tokens=5, temperature=0)
    list(chat(client, engine, max_tokens=5, temperature=0, stream=True))
    after = scrape(base_url)

    def delta(name, **labels):
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)
    assert delta("xserv_http_requests_total", endpoint="/v1/chat/completions", status="200") == 2
    assert delta("xserv_prompt_tokens_total") == 2 * r.usage.prompt_tokens
    assert delta("xserv_generation_tokens_total") == 2 * r.usage.completion_tokens
    assert delta("xserv_time_to_first_token_seconds_count") == 2
    assert delta("xserv_e2e_request_latency_seconds_count") == 2
    assert delta("xserv_requests_finished_total", finish_reason=r.choices[0].finish_reason) == 2
    s = engine.stats()
    for name, want in [("xserv_num_requests_running", s.num_running), ("xserv_num_requests_waiting", s.num_waiting),
                       ("xserv_kv_cache_blocks_total", s.kv_blocks_total),
                       ("xserv_num_preemptions_total", s.num_preemptions)]:
        assert after[(name, frozenset())] == want
    for name in ("xserv_kv_cache_usage_ratio", "xserv_prefix_cache_hit_rate", "xserv_kv_cache_blocks_used"):
        assert (name, frozenset()) in after


def test_fake_disconnect_mid_stream_aborts():
    eng = FakeEngine(step_s=0.01)
    with LiveServer(create_app(eng, model_name="m")) as url:
        body = {"model": "m", "messages": MSGS, "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            rid = json.loads(first[6:])["id"]
            for _ in range(3):
                next(lines)
        assert wait_until(lambda: rid in eng.aborted, 5.0), "engine never saw the abort"
        assert wait_until(lambda: not eng._running, 5.0)
        assert len(eng.requests) == 1
        m = scrape(url)
        assert m[("xserv_requests_aborted_total", frozenset())] == 1
        assert m[("xserv_requests_finished_total", frozenset({("finish_reason", "abort")}))] == 1


def test_fake_disconnect_while_waiting_non_streaming_aborts():
    eng = FakeEngine(step_s=0.01)
    with LiveServer(create_app(eng, model_name="m")) as url:
        body = {"model": "m", "prompt": "x", "max_tokens": 200, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=0.3)
        assert wait_until(lambda: len(eng.aborted) == 1 and not eng._running, 5.0)
        assert wait_until(lambda: scrape(url)[("xserv_requests_aborted_total", frozenset())] == 1, 5.0)


def test_concurrent_requests(client, engine):
    from concurrent.futures import ThreadPoolExecutor
    prompts = [f"Count to {i}" for i in range(6)]
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda p: client.completions.create(model=engine.model_name, prompt=p, max_tokens=8,
                                                                 temperature=0), prompts))
    solo = [client.completions.create(model=engine.model_name, prompt=p, max_tokens=8, temperature=0)
            for p in prompts[:2]]
    assert [o.choices[0].text for o in outs[:2]] == [s.choices[0].text for s in solo]
    assert len({o.id for o in outs}) == len(prompts)

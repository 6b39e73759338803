"""The whole stack on loopback: plan -> NumPy runner -> engine -> HTTP server -> official openai client.

A tiny random Qwen3 with the real Qwen3 tokenizer (vocab 151936) keeps every step fast on the CPU.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from tests.fake_engine import LiveServer, scrape
from tests.tiny_models import make_plan
from xserv_aot.engine.api import SamplingParams
from xserv_aot.serve import build_engine
from xserv_aot.server import create_app

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def plan_dir(root):
    return make_plan(root, num_blocks=256)


@pytest.fixture(scope="module")
def server(plan_dir):
    engine = build_engine(plan_dir, backend="cpu", model_name="tiny")
    with LiveServer(create_app(engine, model_name="tiny", manage_engine=True)) as url:
        yield engine, url


def prompts(n: int) -> list[str]:
    words = ["river", "violet", "engine", "cloud", "harbor", "quartz", "meadow", "signal", "lantern", "orbit"]
    rng = np.random.default_rng(1234)
    return [" ".join(rng.choice(words, size=3 + i % 5)) for i in range(n)]


def alone(plan_dir, text: str, max_tokens: int) -> list[int]:
    """What a prompt produces with no other traffic, driven through the synchronous engine."""
    engine = build_engine(plan_dir, backend="cpu").engine
    ids = engine.tokenizer.encode(text)
    return engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0].new_token_ids


def test_16_concurrent_streams_equal_alone(server, plan_dir):
    engine, url = server
    texts = prompts(16)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=120, max_retries=0)

    def stream(text):
        out = []
        for ch in client.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}):
            out.append(ch.choices[0].text if ch.choices else "")
        return "".join(out)

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(stream, texts))
    tok = engine.tokenizer
    for text, g in zip(texts, got):
        assert g == tok.decode(alone(plan_dir, text, 8))


def test_stream_equals_non_stream_and_usage(server):
    _, url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=60, max_retries=0)
    msgs = [{"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    parts, usage = [], None
    for ch in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True,
                                             stream_options={"include_usage": True}):
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            parts.append(c.delta.content or "")
    assert "".join(parts) == full.choices[0].message.content
    assert usage.completion_tokens == full.usage.completion_tokens and usage.prompt_tokens == full.usage.prompt_tokens


def test_seeded_sampling_reproducible(server):
    _, url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=60, max_retries=0)
    kw = dict(model="tiny", prompt="harbor lantern", max_tokens=8, temperature=0.9, top_p=0.9, seed=42)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    c = client.completions.create(**{**kw, "seed": 43}).choices[0].text
    assert a == b and a != c


def test_small_kv_pool_preempts_and_frees(root):
    """A pool of 24 blocks (96 tokens) for 6 requests of ~40 tokens: preemption, yet every output is right."""
    plan = make_plan(root, num_blocks=24)
    engine = build_engine(plan, backend="cpu").engine
    tok = engine.tokenizer
    texts = prompts(6)
    ids = [tok.encode(t) for t in texts]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    together = [o.new_token_ids for o in engine.generate(ids, params)]
    assert engine.stats().num_preemptions > 0
    assert engine.stats().kv_blocks_used == 0
    for t, out in zip(ids, together):
        fresh = build_engine(plan, backend="cpu").engine
        assert out == fresh.generate([t], params)[0].new_token_ids


def test_disconnect_aborts_and_frees_blocks(server):
    engine, url = server
    before = scrape(url)
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "quartz meadow", "max_tokens": 200, "stream": True,
                            "temperature": 0, "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = engine.stats()
        if st.num_running == 0 and st.num_waiting == 0 and st.kv_blocks_used == 0:
            break
        time.sleep(0.05)
    st = engine.stats()
    assert (st.num_running, st.num_waiting, st.kv_blocks_used) == (0, 0, 0)
    after = scrape(url)
    aborted = lambda m: sum(v for (n, _), v in m.items() if "abort" in n and n.endswith("_total"))
    assert aborted(after) >= aborted(before) + 1

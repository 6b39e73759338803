"""/tokenize and /detokenize in vLLM's shapes (reference: the HF tokenizer of the same files), and vLLM's metric
names on /metrics (what vLLM Grafana dashboards query), with the model_name label."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import ASSETS, ensure_assets
from tests.fake_engine import FakeEngine, LiveServer, scrape, tiny_plan
from xserv_aot.serve import build_engine
from xserv_aot.server import create_app

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in 東京?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ae = build_engine(tiny_plan(tmp_path_factory), backend="cpu", model_name="tiny")
    with LiveServer(create_app(ae, model_name="tiny", manage_engine=True)) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        yield url, client, ae


@pytest.fixture(scope="module")
def hf():
    from transformers import PreTrainedTokenizerFast
    ensure_assets()
    return PreTrainedTokenizerFast.from_pretrained(str(ASSETS / "qwen3-tokenizer"))


def test_tokenize_prompt_and_messages(served, hf):
    _, client, ae = served
    text = "Hello, world! 東京 123"
    r = client.post("/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    want = hf(text)["input_ids"]
    assert r == {"count": len(want), "max_model_len": ae.max_seq_len, "tokens": want,
                 "token_strs": hf.convert_ids_to_tokens(want)}
    chat = client.post("/tokenize", json={"messages": MSGS}).json()
    want = hf.apply_chat_template(MSGS, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert chat["tokens"] == want and chat["token_strs"] is None
    no_gen = client.post("/tokenize", json={"messages": MSGS, "add_generation_prompt": False}).json()
    assert no_gen["tokens"] == want[:no_gen["count"]] and no_gen["count"] < chat["count"]


def test_tokenize_count_equals_chat_prompt_tokens(served):
    url, _, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, temperature=0)
    assert httpx.post(url + "/tokenize", json={"messages": MSGS}).json()["count"] == r.usage.prompt_tokens


def test_detokenize(served, hf):
    _, client, _ = served
    ids = hf("caf\u00e9 <|im_end|> ok")["input_ids"]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": hf.decode(ids)}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": MSGS}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
    ("/tokenize", {"messages": [{"role": "wizard"}]}, "messages"), ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 7]}, "tokens"), ("/detokenize", {}, "tokens")])
def test_tokenize_errors(served, path, body, param):
    _, client, _ = served
    r = client.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenize_unknown_model_404(served):
    _, client, _ = served
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        r = client.post(path, json={**body, "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_vllm_metric_names(served):
    url, _, ae = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    before = scrape(url)
    r = client.completions.create(model="tiny", prompt="river", max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = scrape(url)
    m = ("model_name", "tiny")

    def delta(name, *labels):
        key = (name, frozenset([m, *labels]))
        return after.get(key, 0.0) - before.get(key, 0.0)
    assert delta("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == 4
    assert delta("vllm:request_success_total", ("finished_reason", "length")) == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 3
    s = ae.stats()
    assert after[("vllm:num_requests_running", frozenset([m]))] == s.num_running
    assert after[("vllm:num_requests_waiting", frozenset([m]))] == s.num_waiting
    assert 0 <= after[("vllm:kv_cache_usage_perc", frozenset([m]))] <= 1


def test_metrics_key_choice():
    key = "k-metrics"
    for require, status in ((True, 401), (False, 200)):
        with LiveServer(create_app(FakeEngine(), model_name="m", api_key=key, metrics_require_key=require)) as url:
            assert httpx.get(url + "/metrics").status_code == status
            assert httpx.get(url + "/v1/models").status_code == 401
            assert httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}).status_code == 200

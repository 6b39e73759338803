"""OpenAI/vLLM request fields against the real tiny Qwen3 engine on loopback, with the official openai client:
n, best_of, prompt lists, echo, the developer role, logit_bias, min_tokens, response_format and vLLM's
structured-output fields. References are single-choice requests (seed + j for sample j, as documented)."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.fake_engine import FakeEngine, LiveServer, tiny_plan
from xserv_aot.serve import build_engine
from xserv_aot.server import create_app

MSGS = [{"role": "user", "content": "Name a color."}]
EOS = 151645                                            # <|im_end|>, the tiny model's eos


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    ae = build_engine(tiny_plan(tmp_path_factory), backend="cpu", model_name="tiny")
    with LiveServer(create_app(ae, model_name="tiny", manage_engine=True)) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=120, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def fake():
    """FakeEngine: exact and batch-independent, so choice j can be compared with a single request of seed + j.
    (On the real engine, samples that share a prompt's KV compute their last prompt tokens in another batch
    shape, and float32 rounding can move a sampled token; the real-engine tests below compare like with like.)"""
    with LiveServer(create_app(FakeEngine(), model_name="m")) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=60, max_retries=0) as c:
        yield c


def one(client, seed: int, model: str = "tiny", **kw):
    return client.chat.completions.create(model=model, messages=MSGS, max_tokens=6, temperature=1.0, seed=seed,
                                          extra_body={"ignore_eos": True}, **kw)


def test_fake_n_choices_are_the_seeded_single_requests(fake):
    r = one(fake, 40, "m", n=3)
    singles = [one(fake, 40 + j, "m") for j in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in r.choices}) == 3
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles) == 18


def test_n_choices_stream_equals_non_stream(client):
    r = one(client, 40, n=3)
    single = one(client, 40)
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.message.content for c in r.choices}) == 3
    assert r.usage.prompt_tokens == single.usage.prompt_tokens and r.usage.completion_tokens == 18
    parts = {}
    for chunk in one(client, 40, n=3, stream=True):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
    assert [parts[i] for i in range(3)] == [c.message.content for c in r.choices]


def test_fake_best_of_keeps_the_most_likely_sample(fake):
    kw = dict(model="m", prompt="harbor lantern", max_tokens=5, temperature=1.2, extra_body={"ignore_eos": True})
    best = fake.completions.create(**kw, seed=7, best_of=3)
    cands = [fake.completions.create(**kw, seed=7 + j, logprobs=0) for j in range(3)]
    score = [sum(c.choices[0].logprobs.token_logprobs) for c in cands]
    want = cands[max(range(3), key=lambda j: score[j])].choices[0].text
    assert len(set(c.choices[0].text for c in cands)) > 1, "the seeds should give different samples"
    assert [c.text for c in best.choices] == [want] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 15                          # every candidate is counted, as OpenAI does


def test_best_of_on_the_engine(client):
    kw = dict(model="tiny", prompt="harbor lantern", max_tokens=5, temperature=1.2, seed=7,
              extra_body={"ignore_eos": True})
    best = client.completions.create(**kw, best_of=3, n=2)
    assert [c.index for c in best.choices] == [0, 1] and best.usage.completion_tokens == 15


def test_fake_prompt_list_and_n(fake):
    kw = dict(model="m", max_tokens=4, temperature=0.8, seed=3, extra_body={"ignore_eos": True})
    texts = ["river violet", "quartz meadow signal"]
    r = fake.completions.create(prompt=texts, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for p, text in enumerate(texts):
        for j in range(2):
            single = fake.completions.create(prompt=text, **{**kw, "seed": 3 + j})
            assert r.choices[2 * p + j].text == single.choices[0].text
    singles = [fake.completions.create(prompt=t, **kw) for t in texts]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == 16


def test_prompt_list_on_the_engine(client):
    kw = dict(model="tiny", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    texts = ["river violet", "quartz meadow signal"]
    r = client.completions.create(prompt=texts, **kw)
    assert [c.text for c in r.choices] == [client.completions.create(prompt=t, **kw).choices[0].text
                                           for t in texts]                  # greedy: batch-independent
    streamed = {}
    for chunk in client.completions.create(prompt=texts, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(2)] == [c.text for c in r.choices]


def test_echo_prepends_the_prompt(client):
    kw = dict(model="tiny", prompt="orbit cloud", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    echoed = client.completions.create(**kw, echo=True).choices[0].text
    assert echoed == "orbit cloud" + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, echo=True, stream=True)
                       if c.choices)
    assert streamed == echoed


def test_developer_role_is_the_system_role(client):
    dev = client.chat.completions.create(model="tiny", max_tokens=3, temperature=0, messages=[
        {"role": "developer", "content": "Be brief."}, *MSGS])
    sys_ = client.chat.completions.create(model="tiny", max_tokens=3, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, *MSGS])
    assert dev.usage.prompt_tokens == sys_.usage.prompt_tokens
    assert dev.choices[0].message.content == sys_.choices[0].message.content


def test_logit_bias_and_min_tokens(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, temperature=1.0, seed=1,
                                       logit_bias={"1000": 100})
    assert r.choices[0].logprobs is None and r.usage.completion_tokens == 5
    tok = client.completions.create(model="tiny", prompt="a", max_tokens=3, temperature=1.0, seed=1,
                                    logit_bias={"1000": 100}, logprobs=0)
    assert len(set(tok.choices[0].logprobs.tokens)) == 1
    ended = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, temperature=0,
                                           logit_bias={str(EOS): 100}, extra_body={"min_tokens": 3})
    assert ended.usage.completion_tokens == 4 and ended.choices[0].finish_reason == "stop"


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "shade": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                    "maxItems": 2}},
          "required": ["color", "shade", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_response_format(client, seed):
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=80, temperature=1.0, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "color", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, SCHEMA)
    assert list(value) == ["color", "shade", "tags"]                       # the schema's property order


def test_vllm_structured_fields(client):
    kw = dict(model="tiny", messages=MSGS, max_tokens=20, temperature=1.0, seed=5)
    r = client.chat.completions.create(**kw, extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.choices[0].message.content in ("left", "right")
    r = client.chat.completions.create(**kw, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].message.content)
    r = client.completions.create(model="tiny", prompt="x", max_tokens=20, temperature=1.0, seed=5,
                                  extra_body={"guided_json": {"type": "boolean"}})
    assert json.loads(r.choices[0].text) in (True, False)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, extra_body={"guided_regex": "("})
    assert e.value.body["param"] == "guided_regex" and e.value.body["code"] == "invalid_structured_output"

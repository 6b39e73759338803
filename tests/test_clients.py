"""Real client libraries against the CPU server (tiny random Qwen3 with the real Qwen3 tokenizer and template):
the official openai client (typed parse with a pydantic model, tools, streamed tool calls, n, logit_bias,
logprobs), langchain-openai (bind_tools, with_structured_output, an agent loop with one tool round trip) and
litellm. A random model does not choose to call tools, so tool tests use tool_choice required / named, which the
server enforces with structured decoding: the call is always valid."""
from __future__ import annotations

import json
import os
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.fake_engine import LiveServer
from tests.test_tools import SCHEMAS, TOOLS, long_tiny_plan
from xserv_aot.serve import build_engine
from xserv_aot.server import create_app

MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(BaseModel):
    city: Literal["Paris", "Tokyo", "Lima"]
    celsius: int = Field(ge=-40, le=50)
    sky: Literal["clear", "cloudy", "rain"]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    ae = build_engine(long_tiny_plan(tmp_path_factory), backend="cpu", model_name="tiny")
    with LiveServer(create_app(ae, model_name="tiny", manage_engine=True)) as base:
        yield base + "/v1"


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=url, api_key="x", timeout=120, max_retries=0) as c:
        yield c


def test_openai_parse_pydantic(client):
    for seed in range(3):
        r = client.chat.completions.parse(model="tiny", messages=MSGS, response_format=Weather, seed=seed,
                                          temperature=1.0, max_tokens=60)
        w = r.choices[0].message.parsed
        assert isinstance(w, Weather), r.choices[0].message.content
        assert Weather.model_validate_json(r.choices[0].message.content) == w


def test_openai_tools_stream_n_logit_bias_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", seed=7,
                                       temperature=1.0, max_tokens=200)              # seed 7: two calls
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) >= 2          # parallel calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    with client.chat.completions.stream(model="tiny", messages=MSGS, tools=TOOLS, temperature=1.0, seed=7,
                                        tool_choice="required", max_tokens=200) as stream:
        final = stream.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in calls]
    r = client.chat.completions.create(model="tiny", messages=MSGS, n=3, seed=1, temperature=1.0, max_tokens=4,
                                       logprobs=True, top_logprobs=2, logit_bias={"1000": -100})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert len(c.logprobs.content) == 4 and all(len(e.top_logprobs) == 2 for e in c.logprobs.content)
        assert all(e.token != client_token(client, 1000) for e in c.logprobs.content)


def client_token(client, tid: int) -> str:
    import httpx
    return httpx.post(str(client.base_url).removesuffix("/v1/") + "/detokenize", json={"tokens": [tid]}).json()["prompt"]


def get_weather(city: Literal["Paris", "Tokyo", "Lima"], unit: Literal["c", "f"]) -> str:
    """Current weather of a city."""
    return json.dumps({"city": city, "temp": 21 if unit == "c" else 70})


def test_langchain_bind_tools_structured_output_and_agent_loop(url):
    import langchain_openai as lc
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    weather = tool(get_weather)
    llm = lc.ChatOpenAI(model="tiny", base_url=url, api_key="x", temperature=1.0, max_tokens=80, seed=2,
                        max_retries=0, timeout=120)
    msg = llm.bind_tools([weather], tool_choice="get_weather").invoke([HumanMessage("Weather in Paris?")])
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Tokyo", "Lima")
    out = llm.with_structured_output(Weather, method="json_schema").invoke("Weather in Paris?")
    assert isinstance(out, Weather)
    history = [HumanMessage("Weather in Paris?"), msg,
               ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([weather], tool_choice="none").invoke(history)
    assert isinstance(final.content, str) and not final.tool_calls
    assert final.response_metadata["finish_reason"] in ("stop", "length")


def test_litellm_completion_tools_and_stream(url):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")          # no network at import
    import litellm
    kw = dict(model="openai/tiny", api_base=url, api_key="x", messages=MSGS, max_tokens=80, temperature=1.0, seed=4)
    r = litellm.completion(**kw, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    text = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**{**kw, "max_tokens": 5},
                                                                             stream=True))
    plain = litellm.completion(**{**kw, "max_tokens": 5}).choices[0].message.content
    assert text == plain


@pytest.mark.slow
def test_smollm2_tools_and_json_schema_with_the_openai_client(smollm2_plan):
    """A real (small) model: a forced call parses and validates, a json_schema answer validates, auto stays text."""
    ae = build_engine(smollm2_plan, backend="cpu", model_name="smollm2")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}]
    with LiveServer(create_app(ae, model_name="smollm2", manage_engine=True)) as base, \
            openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=300, max_retries=0) as client:
        r = client.chat.completions.create(model="smollm2", messages=MSGS, tools=tools, tool_choice="required",
                                           max_tokens=60, temperature=0)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), tools[0]["function"]["parameters"])
        r = client.chat.completions.parse(model="smollm2", messages=MSGS, response_format=Weather, max_tokens=60,
                                          temperature=0)
        assert isinstance(r.choices[0].message.parsed, Weather)

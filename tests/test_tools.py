"""Function calling: the parsers (whole text and streamed in every split), the server with the official openai
client (FakeEngine scripts the model's text for tool_choice auto; the real tiny Qwen3 engine with tool_choice
required / named, where structured decoding makes any model produce a valid call), and tool history rendering."""
from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest

from tests.fake_engine import FakeEngine, LiveServer, tiny_plan
from xserv_aot.serve import build_engine
from xserv_aot.server import create_app
from xserv_aot.server.tools import StreamingToolParser, ToolSpec, parse_all

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
AUTO = ToolSpec(TOOLS, "auto")


def call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


HERMES_CASES = [
    ("plain answer", "plain answer", []),
    (call("get_weather", {"city": "Paris"}), "", [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n" + call("get_time", {"zone": "UTC"}) + "\n" + call("get_weather", {"city": "Lima"}),
     "Let me check.\n\n", [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Lima"})]),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ("a <tool_ca", "a <tool_ca", []),
    ("open <tool_call>{\"name\": \"x\"", "open <tool_call>{\"name\": \"x\"", []),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_whole_and_every_split(text, content, calls):
    got_content, got_calls = parse_all(AUTO, "hermes", text)
    assert (got_content, _calls(got_calls)) == (content, calls)
    seed = len(text)
    rng = random.Random(seed)
    for trial in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        parts = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        p, out, found = StreamingToolParser(AUTO, "hermes"), "", []
        for part in parts:
            c, k = p.feed(part)
            out, found = out + c, found + k
        c, k = p.flush()
        assert (out + c, _calls(found + k)) == (content, calls), (seed, trial, parts)


def test_llama3_json_parser():
    text = '{"name": "get_weather", "parameters": {"city": "Tokyo"}}; {"name": "get_time", "parameters": {}}'
    content, calls = parse_all(AUTO, "llama3_json", text)
    assert content == "" and _calls(calls) == [("get_weather", {"city": "Tokyo"}), ("get_time", {})]
    assert parse_all(AUTO, "llama3_json", "The weather is fine.") == ("The weather is fine.", [])
    assert parse_all(AUTO, "llama3_json", "{not a call") == ("{not a call", [])


def test_parallel_tool_calls_false_keeps_the_first():
    spec = ToolSpec(TOOLS, "auto", parallel=False)
    text = call("get_time", {"zone": "UTC"}) + call("get_weather", {"city": "Lima"})
    assert _calls(parse_all(spec, "hermes", text)[1]) == [("get_time", {"zone": "UTC"})]


@pytest.fixture(scope="module")
def fake_client():
    with LiveServer(create_app(FakeEngine(max_seq_len=1024), model_name="m")) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=30, max_retries=0) as client:
        yield client


def say(text: str) -> list[dict]:
    return [{"role": "user", "content": "say:" + text.replace("\n", "\\n")}]


def test_fake_auto_tool_calls_openai_client(fake_client):
    text = "Checking.\n" + call("get_weather", {"city": "Paris", "unit": "c"}) + "\n" + call("get_time",
                                                                                         {"zone": "CET"})
    r = fake_client.chat.completions.create(model="m", messages=say(text), tools=TOOLS, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking."
    got = [(c.type, c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls]
    assert got == [("function", "get_weather", {"city": "Paris", "unit": "c"}), ("function", "get_time",
                                                                                 {"zone": "CET"})]
    assert len({c.id for c in ch.message.tool_calls}) == 2 and all(c.id.startswith("call_")
                                                                   for c in ch.message.tool_calls)
    chunks = list(fake_client.chat.completions.create(model="m", messages=say(text), tools=TOOLS, temperature=0,
                                                      stream=True))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = slot["id"] or d.id
            slot["name"] += d.function.name or "" if d.function else ""
            slot["arguments"] += d.function.arguments or "" if d.function else ""
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == [g[1:] for g in got]
    assert all(v["id"] for v in calls.values())
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip() == "Checking."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    none = fake_client.chat.completions.create(model="m", messages=say(text), tools=TOOLS, tool_choice="none",
                                               temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content == text
    assert none.choices[0].finish_reason == "stop"


def long_tiny_plan(tmp_path_factory):
    """The e2e tiny Qwen3 with a 512-token context (tool definitions alone take ~250 prompt tokens)."""
    from tests.tiny_models import E2E_BUILD as BUILD
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    hf = tiny_plan(tmp_path_factory).parent / "hf"
    out = hf.parent / "plan-long"
    if not (out / "manifest.json").is_file():
        compile_plan(hf, out, BuildConfig(**{**BUILD, "max_seq_len": 512}, num_blocks=512))
    return out


@pytest.fixture(scope="module")
def tiny_client(tmp_path_factory):
    ae = build_engine(long_tiny_plan(tmp_path_factory), backend="cpu", model_name="tiny")
    with LiveServer(create_app(ae, model_name="tiny", manage_engine=True)) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=120, max_retries=0) as client:
        yield client, ae


MSGS = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_required_and_named_always_give_valid_calls(tiny_client, seed):
    client, _ = tiny_client
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=seed, max_tokens=120, parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    for c in ch.message.tool_calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, temperature=1.0, seed=seed,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       max_tokens=60)
    (c,) = r.choices[0].message.tool_calls
    assert c.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(c.function.arguments), SCHEMAS["get_time"])


def test_streamed_parallel_calls_equal_non_streamed(tiny_client):
    """tool_choice required with parallel calls: a random model's array may run long, so the seed is one whose
    output ends within max_tokens (several calls, each valid)."""
    client, _ = tiny_client
    kw = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", temperature=1.0, seed=0,
              max_tokens=200)
    full = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert len(full) >= 2, "pick a seed that makes several calls"
    for c in full:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(d.index, ["", ""])
            slot[0] += d.function.name or ""
            slot[1] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in full]


def test_tool_history_renders_and_tools_reach_the_template(tiny_client, qwen_hf):
    client, _ = tiny_client
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=2, temperature=0)
    hf_history = [dict(m) for m in history]
    hf_history[1] = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]}
    want = qwen_hf.apply_chat_template(hf_history, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert r.usage.prompt_tokens == len(want)
    plain = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, temperature=0)
    assert plain.usage.prompt_tokens < r.usage.prompt_tokens


@pytest.fixture(scope="module")
def qwen_hf():
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import ASSETS, ensure_assets
    ensure_assets()
    return PreTrainedTokenizerFast.from_pretrained(str(ASSETS / "qwen3-tokenizer"))

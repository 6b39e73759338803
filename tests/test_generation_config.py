"""Sampling defaults from generation_config.json: read at compile time into the plan, applied by the server to the
fields a request leaves out (the request's own values win)."""
from __future__ import annotations

import json
import shutil

import openai
import pytest

from tests.conftest import SMOLLM2_GGUF, ensure_assets
from tests.fake_engine import FakeEngine, LiveServer, tiny_plan
from xserv_aot.config import BuildConfig, ConfigError
from xserv_aot.plan.builder import compile_plan
from xserv_aot.plan.generation_config import read_generation_defaults
from xserv_aot.serve import build_engine
from xserv_aot.server import create_app

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def test_read_auto_vllm_path(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(QWEN3))
    want = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert read_generation_defaults(tmp_path / "m", "auto") == want
    assert read_generation_defaults(tmp_path / "m", "vllm") == {}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"temperature": 0.2, "max_new_tokens": 64, "repetition_penalty": 1.1}))
    assert read_generation_defaults(tmp_path / "m", str(other)) == {"temperature": 0.2, "max_tokens": 64,
                                                                     "repetition_penalty": 1.1}
    assert read_generation_defaults(tmp_path / "m", str(tmp_path / "m")) == want
    assert read_generation_defaults(tmp_path / "nothing-here", "auto") == {}
    ensure_assets()
    assert read_generation_defaults(SMOLLM2_GGUF, "auto") == {}
    with pytest.raises(ConfigError, match="no generation_config.json"):
        read_generation_defaults(tmp_path / "m", str(tmp_path / "missing"))
    for bad in ({"temperature": "hot"}, {"top_k": 2.5}, {"top_p": 3}, {"max_new_tokens": 0}):
        other.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=list(bad)[0]):
            read_generation_defaults(tmp_path / "m", str(other))


def test_plan_carries_defaults_to_the_server(tmp_path_factory, tmp_path):
    from tests.tiny_models import E2E_BUILD as BUILD
    hf = tmp_path / "hf"
    shutil.copytree(tiny_plan(tmp_path_factory).parent / "hf", hf)
    (hf / "generation_config.json").write_text(json.dumps(QWEN3))
    plan = compile_plan(hf, tmp_path / "plan", BuildConfig(**BUILD, num_blocks=64))
    assert plan.generation_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert build_engine(plan.dir, backend="cpu").generation_defaults == plan.generation_defaults
    plain = compile_plan(hf, tmp_path / "plain", BuildConfig(**BUILD, num_blocks=64), generation_config="vllm")
    assert plain.generation_defaults == {}


def test_server_applies_defaults_request_wins():
    eng = FakeEngine()
    eng.generation_defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 7}
    with LiveServer(create_app(eng, model_name="m")) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        msgs = [{"role": "user", "content": "hi"}]
        r = client.chat.completions.create(model="m", messages=msgs)
        p = eng.requests[r.id][1]
        assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.6, 20, 0.95, 7)
        r = client.chat.completions.create(model="m", messages=msgs, temperature=0, top_p=1, max_tokens=3,
                                           extra_body={"top_k": 0})
        p = eng.requests[r.id][1]
        assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.0, 0, 1.0, 3)
        r = client.completions.create(model="m", prompt="x")
        assert eng.requests[r.id][1].temperature == 0.6

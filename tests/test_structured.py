"""Structured outputs through the real engine (NumPy backend): every output of a constrained request parses and
validates (jsonschema, re.fullmatch, membership), on many seeded random schemas, with the tiny random Qwen3 (real
Qwen3 tokenizer) and with SmolLM2. Also the host sampler's mask semantics, min_tokens and logit_bias."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest

from tests.fake_engine import tiny_plan
from xserv_aot.engine.api import GuidedDecoding, InvalidRequestError, SamplingParams
from xserv_aot.engine.grammar import check_syntax
from xserv_aot.engine.sampler import sample_token
from xserv_aot.serve import build_engine


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A bounded JSON schema (every string, integer and array has a size limit, so outputs are finite)."""
    kinds = ["integer", "boolean", "enum", "string", "null", "const"] + (["array", "object", "anyOf"] if depth < 2
                                                                         else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", "é", "x\"y"], rng.randint(1, 3))}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 5)}
    if kind == "null":
        return {"type": "null"}
    if kind == "const":
        return {"const": rng.choice([7, "k", True])}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": 2}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1), random_schema(rng, depth + 1)]}
    names = rng.sample(["id", "name", "tags", "ok", "n", "sub"], rng.randint(1, 3))
    return {"type": "object", "properties": {k: random_schema(rng, depth + 1) for k in names},
            "required": [k for k in names if rng.random() < 0.7], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_engine(tiny_plan(tmp_path_factory), backend="cpu").engine


def run(engine, prompt: str, guided: list[GuidedDecoding], seed: int, max_tokens: int, **kw):
    ids = engine.tokenizer.encode(prompt)
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i, guided=g, **kw)
              for i, g in enumerate(guided)]
    return engine.generate([ids] * len(guided), params)


@pytest.mark.parametrize("seed", range(5))
def test_random_schemas_always_validate_tiny(tiny, seed):
    rng = random.Random(seed)
    schemas = [{"type": "object", "properties": {"v": random_schema(rng)}, "required": ["v"],
                "additionalProperties": False} if i % 2 else random_schema(rng) for i in range(8)]
    outs = run(tiny, "Answer in JSON:", [GuidedDecoding("json", json.dumps(s)) for s in schemas], seed * 100, 200)
    for schema, out in zip(schemas, outs):
        assert out.finish_reason == "stop", (seed, schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_grammar_json_object_tiny(tiny):
    specs = [GuidedDecoding("regex", r"[a-c]{2,5}-[0-9]{1,3}"), GuidedDecoding("choice", json.dumps(["yes", "no way"])),
             GuidedDecoding("grammar", 'root ::= "(" [0-9] ("+" [0-9])? ")"'),
             GuidedDecoding("grammar", 'start: "A" | "B" "C"')]
    for seed in range(3):
        outs = run(tiny, "Pick:", specs, 10 * seed, 40)
        assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
        assert re.fullmatch(r"[a-c]{2,5}-[0-9]{1,3}", outs[0].text)
        assert outs[1].text in ("yes", "no way")
        assert re.fullmatch(r"\([0-9](\+[0-9])?\)", outs[2].text)
        assert outs[3].text in ("A", "BC")
    obj = run(tiny, "JSON:", [GuidedDecoding("json_object", "")], 5, 30)[0]
    assert obj.text.startswith("{")                       # unbounded: the tiny model may run out of tokens
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)


def test_guided_greedy_equals_masked_argmax(tiny):
    """Greedy under a choice grammar takes, among the tokens that start an allowed answer (found here by decoding
    the whole vocabulary), the one the unconstrained model scores highest."""
    tok = tiny.tokenizer
    choices = [" cat", " dog"]
    ids = tok.encode("Pet:")
    out = tiny.generate([ids], SamplingParams(max_tokens=5, temperature=0,
                                              guided=GuidedDecoding("choice", json.dumps(choices))))[0]
    assert out.text in choices and out.finish_reason == "stop"
    starts = [t for t in range(tok.vocab_size) if (text := tok.decode([t])) and any(c.startswith(text) for c in choices)
              and t not in tok.all_special_ids]
    logits = last_logits(tiny, ids)
    assert out.new_token_ids[0] == max(starts, key=lambda t: (logits[t], -t))


def last_logits(engine, ids: list[int]) -> np.ndarray:
    """The model's logits after ids, read through a request with logprobs=0 (host sampling gets raw logits)."""
    seen = {}
    real = engine.runner.run

    def spy(batch):
        res = real(batch)
        seen["logits"] = None if res.logits is None else np.array(res.logits[0])
        return res
    engine.runner.run = spy
    try:
        engine.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=0))
    finally:
        engine.runner.run = real
    return seen["logits"]


def test_bad_grammars_are_refused(tiny):
    for g in (GuidedDecoding("regex", "("), GuidedDecoding("json", '{"type": 5}'), GuidedDecoding("grammar", "x ::= (")):
        with pytest.raises(InvalidRequestError, match="not usable"):
            check_syntax(g)
        with pytest.raises(InvalidRequestError, match="not usable"):
            tiny.check_request([1, 2], SamplingParams(max_tokens=4, guided=g))


def test_grammar_compiled_once(tiny):
    g = GuidedDecoding("json", json.dumps({"type": "object", "properties": {"q": {"type": "boolean"}},
                                           "required": ["q"], "additionalProperties": False}))
    first = tiny.grammars._template(g)
    run(tiny, "x", [g, g], 1, 20)
    assert tiny.grammars._template(g) is first


def test_mask_never_sampled_and_logprobs_unmasked():
    rng = np.random.default_rng(11)
    logits = rng.normal(size=64).astype(np.float32)
    allowed = np.zeros(64, dtype=bool)
    allowed[[3, 17, 40]] = True
    p = SamplingParams(temperature=1.5, top_p=0.9, logprobs=2)
    for offset in range(200):
        tok, lp = sample_token(logits, p, [], [], seed=5, offset=offset, allowed=allowed)
        assert tok in (3, 17, 40)
        ref = logits.astype(np.float64) - np.log(np.sum(np.exp(logits.astype(np.float64))))
        assert lp.logprob == pytest.approx(ref[tok], abs=1e-9)
    greedy, _ = sample_token(logits, SamplingParams(temperature=0), [], [], 0, 0, allowed)
    assert greedy == max((3, 17, 40), key=lambda i: logits[i])


def test_logit_bias_and_min_tokens(tiny):
    ids = tiny.tokenizer.encode("hello")
    eos = sorted(tiny.eos_token_ids)[0]
    forced = tiny.generate([ids], SamplingParams(max_tokens=3, temperature=0, logit_bias={eos: 100.0}))[0]
    assert forced.new_token_ids == [eos] and forced.finish_reason == "stop"
    later = tiny.generate([ids], SamplingParams(max_tokens=6, temperature=0, logit_bias={eos: 100.0},
                                                min_tokens=3))[0]
    assert later.new_token_ids[3] == eos and eos not in later.new_token_ids[:3] and len(later.new_token_ids) == 4
    tgt = 1000
    biased = tiny.generate([ids], SamplingParams(max_tokens=4, temperature=0.8, seed=3, logit_bias={tgt: 100.0}))[0]
    assert biased.new_token_ids == [tgt] * 4


@pytest.fixture(scope="module")
def smol(smollm2_plan):
    return build_engine(smollm2_plan, backend="cpu").engine


@pytest.mark.slow
def test_random_schemas_always_validate_smollm2(smol):
    rng = random.Random(2024)
    schemas = [random_schema(rng) for _ in range(4)] + [
        {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                          "population": {"type": "integer", "minimum": 0, "maximum": 10 ** 8}},
         "required": ["city", "population"], "additionalProperties": False}] * 2
    prompt = "<|im_start|>user\nGive the largest city of France as JSON.<|im_end|>\n<|im_start|>assistant\n"
    for i in range(0, len(schemas), 4):
        group = schemas[i:i + 4]
        outs = run(smol, prompt, [GuidedDecoding("json", json.dumps(s)) for s in group], 77 + i, 120)
        for schema, out in zip(group, outs):
            assert out.finish_reason == "stop", (schema, out.text)
            jsonschema.validate(json.loads(out.text), schema)
    obj = run(smol, prompt, [GuidedDecoding("json_object", "")], 1, 150)[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)


def test_a_failing_grammar_ends_only_its_request(tiny):
    """A matcher in an error state (forced here by feeding it a token its grammar refuses) ends that request with
    an error; the other request of the same step finishes normally."""
    ids = tiny.tokenizer.encode("x")
    g = GuidedDecoding("choice", json.dumps(["yes"]))
    tiny.add_request("bad", ids, SamplingParams(max_tokens=5, temperature=0, guided=g))
    tiny.add_request("good", ids, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    bad = tiny._seqs["bad"]
    bad.matcher._m.consume_token(tiny.tokenizer.encode("no", add_special_tokens=False)[0])
    final = {}
    while tiny.has_unfinished():
        for o in tiny.step():
            if o.finish_reason is not None:
                final[o.request_id] = o
    assert final["bad"].finish_reason == "error" and "structured output failed" in final["bad"].error
    assert final["good"].finish_reason == "length" and final["good"].num_generated_tokens == 3
    assert tiny.healthy and tiny.consecutive_failures == 0

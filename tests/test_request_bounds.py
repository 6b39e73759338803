"""Engine-level bounds that keep one bad request from failing a whole batch (direct engine users, no server)."""
from __future__ import annotations

import pytest

from tests.test_engine import mkengine
from xserv_aot.engine.api import InvalidRequestError, SamplingParams


@pytest.mark.parametrize("kw", [dict(top_k=2**31), dict(repetition_penalty=5e-324), dict(repetition_penalty=1e9),
                                dict(temperature=float("inf")), dict(temperature=float("nan")), dict(top_k=-1)])
def test_out_of_range_params_are_refused_one_line(kw):
    eng = mkengine()
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, **kw))
    assert "\n" not in str(e.value)
    assert not eng.has_unfinished()


def test_tiny_temperature_is_greedy():
    prompt = [5, 6, 7, 8]
    greedy = mkengine().generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0].new_token_ids
    tiny = mkengine().generate([prompt], SamplingParams(max_tokens=6, temperature=1e-40, seed=3))[0].new_token_ids
    tiny_host = mkengine().generate([prompt], SamplingParams(max_tokens=6, temperature=1e-40, seed=3,
                                                             logprobs=1))[0].new_token_ids
    assert tiny == greedy == tiny_host


EDGES = [  # (field, a value at the bound, a value just outside it)
    ("temperature", 2.0, 2.01), ("temperature", 0.0, -0.01), ("repetition_penalty", 2.0, 2.5),
    ("repetition_penalty", 0.01, 0.005), ("presence_penalty", -2.0, -2.5), ("frequency_penalty", 2.0, 2.1),
]


@pytest.mark.parametrize("field,inside,outside", EDGES)
def test_server_and_engine_agree_on_bounds(field, inside, outside):
    from xserv_aot.server.protocol import RequestError, parse_completion_request
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    params = parse_completion_request({**body, field: inside}).params
    eng = mkengine()
    eng.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=2, **{field: getattr(params, field)}))
    with pytest.raises(RequestError):
        parse_completion_request({**body, field: outside})
    with pytest.raises(InvalidRequestError):
        eng.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=2, **{field: outside}))

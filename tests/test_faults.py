"""Engine faults: a step that raises ends only its requests (with "error"), the engine recovers, and after
max_consecutive_failures failed steps in a row it fails permanently, honestly and without hanging.

Engine and AsyncEngine on FakeRunner (outputs checked against the unpaged reference); then the real stack
(NumPy backend, tiny Qwen3, HTTP server) with a runner wrapper that raises on chosen steps.
"""
from __future__ import annotations

import asyncio
import functools
import json
import random

import httpx
import pytest

from tests.fake_engine import LiveServer, scrape, tiny_plan
from tests.fake_runner import FakeRunner, FaultyRunner
from tests.test_engine import VOCAB, expected, mkbuild, mkengine, random_requests
from tests.test_storm import alone_ids
from xserv_aot.engine.api import EngineFailedError, SamplingParams
from xserv_aot.engine.async_engine import AsyncEngine
from xserv_aot.serve import build_engine
from xserv_aot.server import create_app

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def run_all(eng, limit: int = 500) -> dict[str, list]:
    """Step until idle, recovering from failures like AsyncEngine does; request id -> its outputs."""
    outs: dict[str, list] = {}
    for _ in range(limit):
        if not eng.has_unfinished():
            return outs
        try:
            step = eng.step()
        except RuntimeError as e:
            step = eng.recover(f"engine step failed: {e}")
        for o in step:
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not go idle")


def assert_idle_and_free(eng) -> None:
    st = eng.stats()
    assert (st.num_running, st.num_waiting, st.kv_blocks_used) == (0, 0, 0)
    assert not eng._seqs and not eng.scheduler.running and not eng.scheduler.waiting
    assert not any(eng.scheduler.block_manager.ref_counts)


def test_failed_step_ends_only_its_requests_and_the_rest_are_exact():
    reqs = random_requests(random.Random(11), 8)
    runner = FaultyRunner(FakeRunner(mkbuild(max_num_seqs=2, decode_buckets=[1, 2]), VOCAB), fail_calls={4})
    eng = mkengine(runner=runner)
    for i, (prompt, params) in enumerate(reqs):
        eng.add_request(f"r{i}", prompt, params)
    outs = run_all(eng)
    errored = [rid for rid, o in outs.items() if o[-1].finish_reason == "error"]
    assert 1 <= len(errored) <= 2 and runner.failures == 1
    for i, (prompt, params) in enumerate(reqs):
        rid, got = f"r{i}", outs[f"r{i}"]
        ids = [t for o in got for t in o.new_token_ids]
        want = expected(prompt, params)
        assert [o.finish_reason for o in got[:-1]] == [None] * (len(got) - 1)
        if rid in errored:
            assert got[-1].error == "engine step failed: injected fault at run 4" and ids == want[:len(ids)]
        else:
            assert ids == want, rid                  # restarted on a reset pool, yet token-exact
    st = eng.stats()
    assert st.healthy and st.consecutive_failures == 0 and st.num_step_failures == 1
    assert st.last_error == "engine step failed: injected fault at run 4"
    assert_idle_and_free(eng)


def test_one_failure_on_an_idle_engine_keeps_it_healthy_and_it_serves_again():
    runner = FaultyRunner(FakeRunner(mkbuild(), VOCAB), fail_calls={0})
    eng = mkengine(runner=runner)
    eng.add_request("a", [1, 2, 3], GREEDY)
    outs = run_all(eng)
    assert outs["a"][-1].finish_reason == "error"
    st = eng.stats()
    assert st.healthy and st.consecutive_failures == 1 and "run 0" in st.last_error
    assert eng.generate([[4, 5]], GREEDY)[0].new_token_ids == expected([4, 5], GREEDY)
    assert eng.stats().consecutive_failures == 0 and eng.stats().healthy


def test_failures_separated_by_successes_never_accumulate():
    runner = FaultyRunner(FakeRunner(mkbuild(), VOCAB), fail_calls={0, 3, 6, 9})
    eng = mkengine(runner=runner, max_consecutive_failures=2)
    for k in range(4):                               # fail, then two good steps: repeatedly
        eng.add_request(f"x{k}", [k + 1, 7], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        assert run_all(eng)[f"x{k}"][-1].finish_reason == "error"
        assert eng.generate([[9, k]], SamplingParams(temperature=0.0, max_tokens=2))[0].finish_reason == "length"
    st = eng.stats()
    assert st.healthy and st.num_step_failures == 4 and st.consecutive_failures == 0


@pytest.mark.parametrize("limit", [1, 3])
def test_n_consecutive_failures_fail_the_engine_permanently(limit):
    runner = FaultyRunner(FakeRunner(mkbuild(max_num_seqs=1, decode_buckets=[1]), VOCAB), always=True)
    eng = mkengine(runner=runner, max_consecutive_failures=limit)
    for i in range(limit + 2):                       # one runs (and fails) per step, the rest wait
        eng.add_request(f"r{i}", [i + 1, 2], GREEDY)
    outs = run_all(eng)
    assert runner.failures == limit
    assert all(len(o) == 1 and o[0].finish_reason == "error" for o in outs.values()) and len(outs) == limit + 2
    st = eng.stats()
    assert not st.healthy and st.consecutive_failures == limit and st.num_step_failures == limit
    assert f"after {limit} consecutive step failures" in outs[f"r{limit + 1}"][0].error
    assert_idle_and_free(eng)
    with pytest.raises(EngineFailedError, match="failed permanently"):
        eng.add_request("late", [1], GREEDY)
    with pytest.raises(ValueError, match="max_consecutive_failures"):
        mkengine(max_consecutive_failures=0)


def test_failure_inside_postprocess_and_inside_schedule_recover():
    lp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    runner = FaultyRunner(FakeRunner(mkbuild(), VOCAB), bad_result_calls={2})
    eng = mkengine(runner=runner)
    eng.add_request("a", [1, 2, 3], GREEDY)
    eng.add_request("b", [4, 5, 6], lp)              # needs logits: the bad result breaks postprocess mid-batch
    outs = run_all(eng)
    assert outs["b"][-1].finish_reason == "error" and "no logits" in outs["b"][-1].error
    assert all(o.finish_reason == "error" for o in (outs["a"][-1], outs["b"][-1]))
    assert_idle_and_free(eng)

    real = eng.scheduler.schedule
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("scheduler bug")
        return real()
    eng.scheduler.schedule = flaky
    eng.add_request("c", [7, 8], GREEDY)
    eng.add_request("d", [9, 9, 9], GREEDY)
    outs = run_all(eng)
    assert {rid: o[-1].finish_reason for rid, o in outs.items()} == {"c": "error", "d": "error"}
    assert_idle_and_free(eng)
    assert eng.generate([[3, 1]], GREEDY)[0].new_token_ids == expected([3, 1], GREEDY)
    assert eng.stats().healthy and eng.stats().num_step_failures == 2


# AsyncEngine


async def drain(ae, rid, prompt, params, timeout=20.0):
    async def go():
        return [o async for o in ae.generate(rid, prompt, params)]
    return await asyncio.wait_for(go(), timeout)


def test_async_engine_always_failing_ends_everything_and_refuses_new_requests():
    runner = FaultyRunner(FakeRunner(mkbuild(max_num_seqs=2, decode_buckets=[1, 2]), VOCAB), always=True)
    ae = AsyncEngine(mkengine(runner=runner, max_consecutive_failures=3), max_waiting=64)
    ae.start()

    async def main():
        results = await asyncio.gather(*(drain(ae, f"r{i}", [i + 1, 3], GREEDY) for i in range(10)),
                                       return_exceptions=True)
        with pytest.raises(EngineFailedError, match="not running.*failed permanently"):
            await drain(ae, "late", [1], GREEDY)
        return results

    try:
        results = asyncio.run(main())
    finally:
        ae.shutdown()
    for r in results:                               # refused outright (raced the failure) or ended with "error"
        assert isinstance(r, EngineFailedError) or (r[-1].finish_reason == "error" and r[-1].error)
    assert sum(not isinstance(r, Exception) for r in results) >= 3 and runner.failures == 3
    st = ae.stats()
    assert not st.healthy and st.consecutive_failures == 3
    assert (st.num_running, st.num_waiting, st.kv_blocks_used) == (0, 0, 0) and not ae._streams
    assert_idle_and_free(ae.engine)


def test_async_shutdown_racing_new_requests_never_hangs():
    ae = AsyncEngine(mkengine(), max_waiting=1000)
    ae.start()

    async def main():
        loop = asyncio.get_running_loop()
        tasks = [asyncio.create_task(drain(ae, f"r{i}", [i % 40 + 1, 2], SamplingParams(max_tokens=80,
                                                                                        ignore_eos=True)))
                 for i in range(60)]
        await asyncio.sleep(0.01)
        stopper = loop.run_in_executor(None, ae.shutdown)
        tasks += [asyncio.create_task(drain(ae, f"late{i}", [5], GREEDY)) for i in range(20)]
        await stopper
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    for r in results:                               # no TimeoutError: every stream ended or was refused
        assert isinstance(r, EngineFailedError) or r[-1].finish_reason in ("abort", "length"), r
    assert not ae._streams and ae.stats().num_waiting == 0 and ae.stats().kv_blocks_used == 0


# through the HTTP server, on the real NumPy backend


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return tiny_plan(tmp_path_factory, num_blocks=64)


MAX_FAILURES = 3


def served(plan, **runner_kw):
    """The server over an engine core process whose runner is wrapped, in that process, by FaultyRunner."""
    ae = build_engine(plan, backend="cpu", model_name="tiny", engine_process=True,
                      runner_wrapper=functools.partial(FaultyRunner, **runner_kw),
                      engine_kwargs={"max_consecutive_failures": MAX_FAILURES})
    return ae, LiveServer(create_app(ae, model_name="tiny", manage_engine=True))


def completion(url, prompt_ids, stream=False, max_tokens=6):
    body = {"model": "tiny", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


def sse_events(r) -> list:
    return [json.loads(ln[6:]) if ln != "data: [DONE]" else "[DONE]" for ln in r.text.splitlines()
            if ln.startswith("data: ")]


def test_server_transient_fault_gives_500_and_error_event_then_recovers(plan):
    ae, srv = served(plan)
    tok = ae.tokenizer
    ids = tok.encode("meadow signal orbit")
    with srv as url:
        ae.call_runner("fail_next_calls", 1)
        r = completion(url, ids)
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal error while generating"
        ae.call_runner("fail_next_calls", 1)
        r = completion(url, ids, stream=True)
        ev = sse_events(r)
        assert r.status_code == 200 and ev[-1] == "[DONE]"
        assert ev[-2]["error"]["message"] == "internal error while generating"
        assert "injected" not in r.text             # no engine detail reaches the client
        assert httpx.get(url + "/health").status_code == 200
        st = ae.stats()
        assert st.healthy and st.consecutive_failures == 2 and "injected fault" in st.last_error
        r = completion(url, ids)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == tok.decode(alone_ids(plan, ids, 6))
        assert ae.stats().consecutive_failures == 0
        m = scrape(url)
        assert m[("xserv_engine_healthy", frozenset())] == 1 and m[("xserv_kv_cache_blocks_used", frozenset())] == 0


def test_server_reports_a_permanently_failed_engine(plan):
    ae, srv = served(plan, always=True)
    ids = ae.tokenizer.encode("quartz harbor")
    with srv as url:
        for k in range(MAX_FAILURES):
            assert httpx.get(url + "/health").status_code == 200
            assert completion(url, ids, stream=k % 2 == 1).status_code in (500, 200)
        assert httpx.get(url + "/health").status_code == 503
        m = scrape(url)
        assert m[("xserv_engine_healthy", frozenset())] == 0
        assert m[("xserv_num_requests_running", frozenset())] == 0 == m[("xserv_kv_cache_blocks_used", frozenset())]
        r = completion(url, ids)                    # refused at once, never queued
        assert r.status_code >= 500 and "error" in r.json()
        assert not ae.stats().healthy and ae.call_runner("num_failures") == MAX_FAILURES


def test_health_reports_a_stopped_engine():
    """An engine loop that was shut down (not failed) is reported by /health as 503, not ok."""
    eng = AsyncEngine(mkengine())
    with LiveServer(create_app(eng, model_name="m")) as url:
        eng.start()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        eng.shutdown()
        r = httpx.get(url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"

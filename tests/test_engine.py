"""LLMEngine and AsyncEngine on FakeRunner (paged KV of token ids): outputs must equal the unpaged reference."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest

from tests.fake_runner import (FakeDetokenizer, FakeRunner, FakeTokenizer, context_logits, reference_generate)
from xserv_aot.config import BuildConfig
from xserv_aot.engine.api import InvalidRequestError, QueueFullError, RequestTooLongError, SamplingParams
from xserv_aot.engine.async_engine import AsyncEngine
from xserv_aot.engine.llm_engine import LLMEngine
from xserv_aot.engine.text_output import TextOutput

VOCAB = 50


def mkbuild(**kw) -> BuildConfig:
    d = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[8, 16], max_seq_len=96, block_size=4,
             target="cpu")
    d.update(kw)
    return BuildConfig(**d).validate()


def mkengine(build=None, eos=(), runner=None, tokenizer=None, **kw):
    runner = runner or FakeRunner(build or mkbuild(), VOCAB, eos)
    tok = tokenizer or FakeTokenizer(eos)
    return LLMEngine(runner, tok, detokenizer_factory=FakeDetokenizer, seed=0, **kw)


def random_requests(rng: random.Random, n: int):
    shared = [rng.randrange(VOCAB) for _ in range(13)]
    reqs = []
    for i in range(n):
        tail = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
        prompt = (shared[:rng.randrange(4, 14)] + tail) if i % 2 else tail
        kind = i % 4
        if kind == 0:
            p = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 20), ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(temperature=0.9, top_k=10, top_p=0.9, seed=rng.randrange(2 ** 40),
                               max_tokens=rng.randrange(1, 20))
        elif kind == 2:
            p = SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.3,
                               logprobs=2, seed=i, max_tokens=rng.randrange(1, 20), ignore_eos=True)
        else:
            p = SamplingParams(temperature=0.0, presence_penalty=0.8, max_tokens=rng.randrange(1, 20))
        reqs.append((prompt, p))
    return reqs


def expected(prompt, params, eos=()):
    return reference_generate(prompt, params, params.seed or 0, VOCAB, eos)


def test_concurrent_requests_match_unpaged_reference_and_solo_runs():
    eos = (3,)
    reqs = random_requests(random.Random(0), 12)
    eng = mkengine(eos=eos)
    outs = eng.generate([p for p, _ in reqs], [s for _, s in reqs])
    for (prompt, params), o in zip(reqs, outs):
        want = expected(prompt, params, eos)
        assert o.new_token_ids == want
        assert o.finish_reason == ("stop" if want[-1] in eos and not params.ignore_eos else "length")
        assert o.text == FakeTokenizer(eos).decode(want if o.finish_reason == "length" else want[:-1])
        assert o.num_prompt_tokens == len(prompt) and o.num_generated_tokens == len(want)
        assert (o.logprobs is not None) == (params.logprobs is not None)
    assert eng.stats().prefix_cache_hits > 0 and eng.stats().kv_blocks_used == 0
    for (prompt, params), o in list(zip(reqs, outs))[:4]:
        assert mkengine(eos=eos).generate([prompt], params)[0].new_token_ids == o.new_token_ids


def test_small_pool_preempts_and_everything_finishes_and_frees():
    build = mkbuild(num_blocks=16)                  # 64 token slots: one sequence fits, 4 at once do not
    reqs = [(p, SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                               max_tokens=64 - len(p), ignore_eos=True, logprobs=s.logprobs))
            for p, s in random_requests(random.Random(1), 10)]
    eng = mkengine(build)
    outs = eng.generate([p for p, _ in reqs], [s for _, s in reqs])
    for (prompt, params), o in zip(reqs, outs):
        assert o.finish_reason == "length" and o.new_token_ids == expected(prompt, params)
    st = eng.stats()
    assert st.num_preemptions > 0 and st.kv_blocks_used == 0 and not eng.has_unfinished()
    assert st.num_running == st.num_waiting == 0


def test_abort_frees_blocks_at_once():
    eng = mkengine()
    eng.add_request("a", list(range(10)), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("b", list(range(20, 26)), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    used = eng.stats().kv_blocks_used
    out = eng.abort("a")
    assert out.finish_reason == "abort" and out.request_id == "a"
    assert used == 3 + 2                           # KV of 12 and 8 tokens
    assert eng.stats().kv_blocks_used == 2 and eng.stats().num_running == 1
    assert eng.abort("a") is None and eng.abort("nope") is None
    eng.abort("b")
    assert eng.stats().kv_blocks_used == 0 and not eng.has_unfinished()
    eng.add_request("w", [1, 2, 3])
    eng.abort("w")                                  # still waiting: just dropped
    assert not eng.has_unfinished() and eng.step() == []


def test_stop_strings_split_across_tokens():
    prompt = [5, 9, 14, 2]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full_ids = expected(prompt, params)
    tok = FakeTokenizer()
    pieces = [tok.piece(t) for t in full_ids]
    k = next(i for i in range(5, len(pieces) - 1) if pieces[i] + pieces[i + 1] not in "".join(pieces[:i]))
    stop = pieces[k][-1] + pieces[k + 1]           # ends one token, spans into the next
    full_text = "".join(pieces)
    cut = full_text.index(stop)
    eng = mkengine()
    eng.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                stop=["never-there", stop]))
    deltas, last = [], None
    while eng.has_unfinished():
        for o in eng.step():
            deltas.append(o.text)
            last = o
    assert "".join(deltas) == full_text[:cut]
    assert last.finish_reason == "stop" and len(deltas) <= k + 2
    eng2 = mkengine()                               # a held-back prefix that never completes is released
    out = eng2.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                 stop=[full_text[-1] + "#"]))[0]
    assert out.text == full_text and out.finish_reason == "length"


def test_stop_string_buffer_against_reference():
    rng = random.Random(2)
    for _ in range(400):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(1, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        hits = [text.find(s) for s in stops if s in text]
        want = text[:min(hits)] if hits else text
        buf = TextOutput(None, stops)
        emitted, pos, stopped = "", 0, False
        while pos < len(text) and not stopped:
            n = rng.randrange(1, 4)
            delta, stopped = buf.feed(text[pos:pos + n])
            pos += n
            emitted += delta
            assert want.startswith(emitted)
        if not stopped:
            emitted += buf.flush()
        assert emitted == want and stopped == bool(hits)


def test_eos_and_stop_token_ids_end_without_their_text():
    prompt = [1, 2, 3, 4, 5]
    ids = expected(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    stop_tok = ids[6]
    first = ids.index(stop_tok)
    out = mkengine().generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_tok]))[0]
    assert out.new_token_ids == ids[:first + 1] and out.finish_reason == "stop"
    assert out.text == FakeTokenizer().decode(ids[:first])
    out = mkengine(eos=(stop_tok,)).generate([prompt], SamplingParams(temperature=0.0, max_tokens=30))[0]
    assert out.new_token_ids == ids[:first + 1] and out.finish_reason == "stop"
    out = mkengine(eos=(stop_tok,)).generate([prompt], SamplingParams(temperature=0.0, max_tokens=30,
                                                                      ignore_eos=True))[0]
    assert out.new_token_ids == ids and out.finish_reason == "length"


def test_seeded_request_is_identical_inside_different_batches():
    rng = random.Random(7)
    target = ([rng.randrange(VOCAB) for _ in range(9)], SamplingParams(temperature=1.0, top_p=0.95, seed=1234,
                                                                       max_tokens=25, ignore_eos=True))
    results = []
    for companions in (0, 1, 3, 6):
        others = [([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))],
                   SamplingParams(temperature=1.0, max_tokens=rng.randrange(1, 30))) for _ in range(companions)]
        batch = others[:companions // 2] + [target] + others[companions // 2:]
        outs = mkengine().generate([p for p, _ in batch], [s for _, s in batch])
        results.append(outs[companions // 2].new_token_ids)
    assert all(r == results[0] for r in results) and len(results[0]) == 25
    host = SamplingParams(**{**target[1].__dict__, "logprobs": 1})   # host sampler: same draw
    assert mkengine().generate([target[0]], host)[0].new_token_ids == results[0]


def test_unseeded_requests_draw_distinct_seeds():
    eng = mkengine()
    outs = eng.generate([[1, 2, 3]] * 4, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert len({tuple(o.new_token_ids) for o in outs}) > 1


def test_logprobs_and_cached_token_counts():
    prompt = list(range(10, 30))
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    eng = mkengine()
    first = eng.generate([prompt], params)[0]
    second = eng.generate([prompt + [1, 2]], params)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 20
    assert len(first.logprobs) == 5
    for i, lp in enumerate(first.logprobs):
        x = context_logits(prompt + first.new_token_ids[:i], VOCAB).astype(np.float64)
        ref = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        assert lp.token_id == first.new_token_ids[i] == int(np.argmax(x))
        assert lp.logprob == pytest.approx(ref[lp.token_id]) and len(lp.top) == 3
        assert [t for t, _ in lp.top] == list(np.argsort(-ref, kind="stable")[:3])


def test_length_limits_and_request_errors():
    eng = mkengine(mkbuild(max_seq_len=32, num_blocks=8))
    out = eng.generate([[1] * 12], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.new_token_ids) == 20
    with pytest.raises(RequestTooLongError, match=r"12 tokens.*max_tokens is 21.*33.*max_seq_len 32"):
        eng.add_request("x", [1] * 12, SamplingParams(max_tokens=21))
    with pytest.raises(RequestTooLongError, match="25 tokens but the KV cache holds at most 24 tokens"):
        mkengine(mkbuild(max_seq_len=32, num_blocks=6)).add_request("x", [1] * 25, SamplingParams(max_tokens=1))
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(min_p=2), dict(logprobs=21),
                dict(max_tokens=0), dict(stop=["a", "b", "c", "d", "e"]), dict(stop=[""]),
                dict(repetition_penalty=0), dict(presence_penalty=3)):
        with pytest.raises(InvalidRequestError):
            eng.add_request("x", [1, 2], SamplingParams(**bad))
    with pytest.raises(InvalidRequestError, match="prompt"):
        eng.add_request("x", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="prompt token ids"):
        eng.add_request("x", [VOCAB], SamplingParams())
    eng.add_request("dup", [1], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="dup"):
        eng.add_request("dup", [1], SamplingParams())


def test_pool_smaller_than_one_sequence_ends_it_with_an_error():
    eng = mkengine(mkbuild(num_blocks=3))
    outs = eng.generate([[1] * 10, [2] * 3], SamplingParams(max_tokens=20, ignore_eos=True))
    assert outs[0].finish_reason == "error" and "KV cache too small" in outs[0].error
    assert outs[1].finish_reason == "error" or outs[1].new_token_ids == expected(
        [2] * 3, SamplingParams(max_tokens=20, ignore_eos=True))
    assert eng.stats().kv_blocks_used == 0


def test_runner_failure_fails_that_step_and_the_engine_recovers():
    fail = {"armed": True}

    def fail_when(batch):
        if fail["armed"] and len(batch.seq_lens) == 2:
            fail["armed"] = False
            return True
        return False

    eng = mkengine(runner=FakeRunner(mkbuild(), VOCAB, fail_when=fail_when))
    p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    eng.add_request("a", [1, 2, 3], p)
    eng.step()
    eng.add_request("b", [4, 5, 6], p)
    with pytest.raises(RuntimeError):
        eng.step()
    outs = eng.recover("engine step failed: RuntimeError: injected runner failure")
    assert sorted(o.request_id for o in outs) == ["a", "b"] and all(o.finish_reason == "error" for o in outs)
    st = eng.stats()
    assert st.healthy and st.kv_blocks_used == 0 and not eng.has_unfinished()
    assert (st.consecutive_failures, st.num_step_failures) == (1, 1) and "injected" in st.last_error
    again = eng.generate([[7, 8, 9]], p)[0]
    st = eng.stats()
    assert again.new_token_ids == expected([7, 8, 9], p) and st.healthy and st.consecutive_failures == 0
    assert st.num_step_failures == 1 and "injected" in st.last_error


def test_default_detokenizer_is_used_with_a_tokenizer():
    eng = LLMEngine(FakeRunner(mkbuild(), VOCAB), FakeTokenizer(), seed=0)
    out = eng.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert out.text == FakeTokenizer().decode(out.new_token_ids)


# AsyncEngine


async def collect(engine, rid, prompt, params):
    outs = [o async for o in engine.generate(rid, prompt, params)]
    assert outs[-1].finish_reason is not None and all(o.finish_reason is None for o in outs[:-1])
    return outs


def test_async_engine_concurrent_generate():
    reqs = random_requests(random.Random(4), 10)
    ae = AsyncEngine(mkengine(), model_name="fake")
    ae.start()

    async def main():
        return await asyncio.gather(*(collect(ae, f"r{i}", p, s) for i, (p, s) in enumerate(reqs)))

    try:
        results = asyncio.run(main())
    finally:
        ae.shutdown()
    for (prompt, params), outs in zip(reqs, results):
        assert [t for o in outs for t in o.new_token_ids] == expected(prompt, params)
    assert ae.stats().kv_blocks_used == 0 and ae.stats().healthy


class SlowRunner(FakeRunner):
    def run(self, batch):
        time.sleep(0.005)
        return super().run(batch)


def test_async_cancel_aborts_and_frees():
    runner = SlowRunner(mkbuild(), VOCAB)
    ae = AsyncEngine(mkengine(runner=runner))
    ae.start()

    async def main():
        got = asyncio.Event()

        async def consume():
            async for _ in ae.generate("long", list(range(20)), SamplingParams(max_tokens=70, ignore_eos=True)):
                got.set()
        task = asyncio.create_task(consume())
        await got.wait()
        assert ae.stats().kv_blocks_used > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            s = ae.stats()
            if s.num_running == 0 and s.kv_blocks_used == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    try:
        assert asyncio.run(main())
        assert len(runner.batches) < 60            # aborted long before max_tokens
    finally:
        ae.shutdown()


class GatedRunner(FakeRunner):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def run(self, batch):
        assert self.gate.wait(10)
        return super().run(batch)


def test_async_queue_full_too_long_and_error_recovery():
    runner = GatedRunner(mkbuild(max_num_seqs=1, decode_buckets=[1], max_seq_len=64), VOCAB)
    ae = AsyncEngine(mkengine(runner=runner), max_waiting=2)
    ae.start()
    p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def main():
        with pytest.raises(RequestTooLongError):
            await anext(ae.generate("long", [1] * 60, SamplingParams(max_tokens=10)))
        tasks = []
        for i in range(3):                          # one running (stuck in the gated runner), then two waiting
            tasks.append(asyncio.create_task(collect(ae, f"q{i}", [i + 1, 2], p)))
            for _ in range(200):
                if (ae.stats().num_running, ae.stats().num_waiting) == (1, i):
                    break
                await asyncio.sleep(0.01)
        assert ae.stats().num_waiting == 2
        with pytest.raises(QueueFullError):
            await anext(ae.generate("over", [1, 2], p))
        runner.gate.set()
        return await asyncio.gather(*tasks)

    try:
        for i, outs in enumerate(asyncio.run(main())):
            assert [t for o in outs for t in o.new_token_ids] == expected([i + 1, 2], p)
        runner.fail_when = lambda b: True
        bad = asyncio.run(collect(ae, "bad", [5, 6], p))
        assert bad[-1].finish_reason == "error" and "injected runner failure" in bad[-1].error
        assert "Traceback" not in bad[-1].error and "\n" not in bad[-1].error
        assert ae.stats().healthy and ae.stats().consecutive_failures == 1
        runner.fail_when = None
        good = asyncio.run(collect(ae, "good", [5, 6], p))
        assert [t for o in good for t in o.new_token_ids] == expected([5, 6], p) and ae.stats().healthy
        assert ae.stats().consecutive_failures == 0
    finally:
        runner.gate.set()
        ae.shutdown()


def test_async_shutdown_ends_open_requests():
    ae = AsyncEngine(mkengine(runner=SlowRunner(mkbuild(), VOCAB)))
    ae.start()

    async def main():
        agen = ae.generate("r", [1, 2, 3], SamplingParams(max_tokens=90, ignore_eos=True))
        await anext(agen)
        await asyncio.get_running_loop().run_in_executor(None, ae.shutdown)
        rest = [o async for o in agen]
        return rest

    rest = asyncio.run(main())
    assert rest[-1].finish_reason == "abort"
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(anext(ae.generate("r2", [1], SamplingParams())))


def test_engine_on_the_numpy_backend_matches_a_solo_session(tmp_path):
    """The same engine on the real plan runner: concurrent, prefix-sharing greedy requests == one at a time."""
    tiny = pytest.importorskip("tests.tiny_models")
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    from xserv_aot.runtime.session import Session

    model_dir = tiny.make_tiny_model(tmp_path / "hf", "qwen3", sharded=False, seed=3)
    plan = compile_plan(model_dir, tmp_path / "plan", mkbuild(prefill_buckets=[8, 16], max_seq_len=64,
                                                              num_blocks=24, dtype="float32"))
    rng = np.random.default_rng()
    shared = rng.integers(3, 256, 11).tolist()
    prompts = [shared + rng.integers(3, 256, n).tolist() for n in (1, 9, 20, 3, 14)]
    eng = LLMEngine(NumpyRunner(plan), None)
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.new_token_ids == Session(NumpyRunner(plan)).greedy(prompt, 10)[0]
    assert eng.stats().prefix_cache_hits > 0 and eng.stats().kv_blocks_used == 0

"""Host sampler against straightforward float64 references written here."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from xserv_aot.engine.api import SamplingParams
from xserv_aot.engine.sampler import apply_penalties, draw, sample_token
from xserv_aot.rng import uniform


def ref_uniform(seed, offset):
    m = 2 ** 64
    z = (seed + (offset + 1) * 0x9E3779B97F4A7C15) % m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % m
    z = z ^ (z >> 31)
    return (z >> 40) / 2 ** 24


def ref_penalties(logits, prompt, out, presence, frequency, repetition):
    x = [float(v) for v in logits]
    for t in set(prompt) | set(out):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(out):
        x[t] -= frequency * out.count(t) + presence
    return x


def ref_distribution(x, temperature, top_k, top_p, min_p):
    """(ids most likely first, their final probabilities) in plain Python floats."""
    m = max(x)
    e = [math.exp((v - m) / temperature) for v in x]
    total = sum(e)
    probs = [v / total for v in e]
    ranked = sorted(range(len(x)), key=lambda i: (-probs[i], i))
    if 0 < top_k < len(x):
        ranked = ranked[:top_k]
    mass = sum(probs[i] for i in ranked)
    q = {i: probs[i] / mass for i in ranked}
    if top_p < 1:
        keep, c = [], 0.0
        for i in ranked:
            keep.append(i)
            c += q[i]
            if c >= top_p:
                break
        ranked = keep
    if min_p > 0:
        ranked = [i for i in ranked if q[i] >= min_p * q[ranked[0]]]
    mass = sum(q[i] for i in ranked)
    return ranked, [q[i] / mass for i in ranked]


def ref_draw(x, temperature, top_k, top_p, min_p, seed, offset):
    if temperature <= 0:
        return max(range(len(x)), key=lambda i: (x[i], -i))
    ids, p = ref_distribution(x, temperature, top_k, top_p, min_p)
    u, c = ref_uniform(seed, offset), 0.0
    for i, pi in zip(ids, p):
        c += pi
        if c > u:
            return i
    return ids[-1]


def random_case(rng, vocab):
    logits = (rng.standard_normal(vocab) * rng.uniform(0.5, 4)).astype(np.float32)
    prompt = [int(t) for t in rng.integers(0, vocab, rng.integers(1, 12))]
    out = [int(t) for t in rng.integers(0, vocab, rng.integers(0, 12))]
    return logits, prompt, out


def test_uniform_is_the_plan_splitmix64():
    rng = random.Random(3)
    for _ in range(500):
        seed, off = rng.randrange(2 ** 63), rng.randrange(2 ** 20)
        assert uniform(seed, off) == ref_uniform(seed, off)
    us = [uniform(7, i) for i in range(20000)]
    assert 0 <= min(us) and max(us) < 1 and abs(np.mean(us) - 0.5) < 0.01


def test_penalties_match_reference():
    rng = np.random.default_rng(0)
    for _ in range(50):
        logits, prompt, out = random_case(rng, 40)
        pres, freq, rep = rng.uniform(-2, 2), rng.uniform(-2, 2), rng.uniform(0.5, 2)
        got = apply_penalties(logits, prompt, out, pres, freq, rep)
        np.testing.assert_allclose(got, ref_penalties(logits, prompt, out, pres, freq, rep), rtol=1e-12, atol=1e-12)
    x = np.array([2.0, -2.0, 1.0], np.float32)
    np.testing.assert_allclose(apply_penalties(x, [0, 1], [], repetition=2.0), [1.0, -4.0, 1.0])


@pytest.mark.parametrize("vocab", [7, 50])
def test_draw_matches_reference(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(300):
        logits, _, _ = random_case(rng, vocab)
        t = float(rng.choice([0.0, 0.3, 1.0, 1.7]))
        k = int(rng.choice([0, 1, 3, vocab, vocab + 5]))
        p = float(rng.choice([1.0, 0.9, 0.5, 0.05]))
        mp = float(rng.choice([0.0, 0.05, 0.3]))
        seed, off = int(rng.integers(0, 2 ** 63)), int(rng.integers(0, 1000))
        assert draw(logits, t, k, p, mp, seed, off) == ref_draw([float(v) for v in logits], t, k, p, mp, seed, off)


def test_empirical_distribution_matches_reference():
    rng = np.random.default_rng(11)
    logits = rng.standard_normal(12).astype(np.float32)
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.1, presence_penalty=0.5,
                            frequency_penalty=0.3, repetition_penalty=1.3)
    prompt, out = [1, 2, 2], [3, 3, 5]
    x = ref_penalties(logits, prompt, out, 0.5, 0.3, 1.3)
    ids, probs = ref_distribution(x, 0.7, 8, 0.9, 0.1)
    n = 20000
    counts = np.zeros(12)
    for s in range(n):
        tok, _ = sample_token(logits, params, prompt, out, seed=s * 7919, offset=len(out))
        counts[tok] += 1
    assert set(np.flatnonzero(counts)) <= set(ids)
    for i, p in zip(ids, probs):
        assert abs(counts[i] / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3


def test_logprobs_are_log_softmax_of_penalized_logits():
    rng = np.random.default_rng(5)
    vocab = 20
    for _ in range(30):
        logits, prompt, out = random_case(rng, vocab)
        params = SamplingParams(temperature=float(rng.choice([0.0, 0.8])), top_k=4, repetition_penalty=1.2,
                                frequency_penalty=0.4, logprobs=20)
        tok, lp = sample_token(logits, params, prompt, out, seed=1, offset=len(out))
        x = ref_penalties(logits, prompt, out, 0.0, 0.4, 1.2)
        m = max(x)
        lse = m + math.log(sum(math.exp(v - m) for v in x))
        assert lp.token_id == tok and lp.logprob == pytest.approx(x[tok] - lse, abs=1e-9)
        assert len(lp.top) == vocab and sum(math.exp(v) for _, v in lp.top) == pytest.approx(1.0, abs=1e-9)
        assert [i for i, _ in lp.top] == sorted(range(vocab), key=lambda i: (-x[i], i))
        if params.temperature == 0:
            assert tok == lp.top[0][0]
    _, lp = sample_token(logits, SamplingParams(logprobs=0), prompt, out, 1, 0)
    assert lp.top == []
    _, lp = sample_token(logits, SamplingParams(logprobs=3), prompt, out, 1, 0)
    assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_host_draw_equals_numpy_backend_sample_op():
    numpy_ops = pytest.importorskip("xserv_aot.runtime.numpy_ops")
    rng = np.random.default_rng(2)
    for _ in range(200):
        logits, _, _ = random_case(rng, 64)
        t, k, p = float(rng.choice([0.0, 0.5, 1.0])), int(rng.choice([0, 5, 20])), float(rng.choice([1.0, 0.8]))
        seed, off = int(rng.integers(0, 2 ** 63)), int(rng.integers(0, 500))
        assert draw(logits, t, k, p, 0.0, seed, off) == numpy_ops.sample_row(logits, t, k, p, seed, off)

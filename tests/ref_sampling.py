"""Plain-Python float64 references of the sampling rules (docs/plan-format.md `sample` op and the host sampler's
penalties / min_p / logprobs), written from the spec without the engine's code: the oracle for test_sampler and
for FakeRunner's tokens."""
from __future__ import annotations

import math


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


def ref_sample_token(logits, params, prompt: list[int], out: list[int], seed: int, offset: int, min_temperature: float):
    """(token, logprob of it, top [(id, logprob)]) as the host sampler must produce them."""
    x = ref_penalties(logits, prompt, out, params.presence_penalty, params.frequency_penalty,
                      params.repetition_penalty)
    t = params.temperature if params.temperature >= min_temperature else 0.0
    tok = ref_draw(x, t, params.top_k, params.top_p, params.min_p, seed, offset)
    m = max(x)
    lse = m + math.log(sum(math.exp(v - m) for v in x))
    n = 0 if params.logprobs is None else params.logprobs
    top = [(i, x[i] - lse) for i in sorted(range(len(x)), key=lambda i: (-x[i], i))[:n]]
    return tok, x[tok] - lse, top

"""Host-side sampling for rows the device sampler cannot handle (penalties, logit_bias, min_p, logprobs, masks).

Per row, in float64: penalties (vLLM/OpenAI semantics) -> logit_bias -> logprobs -> mask -> temperature -> top_k
-> top_p -> min_p -> seeded draw.
- repetition_penalty r: every token id seen in prompt or output has its logit divided by r when > 0, else
  multiplied by r. Then frequency_penalty * count(id in output) and presence_penalty * (id in output) are
  subtracted.
- logit_bias adds its value to each listed id's logit (ids beyond the vocabulary are ignored).
- the mask (grammar, min_tokens) sets disallowed ids to -inf; at least one id must stay allowed.
- logprobs are log_softmax of the penalized, biased logits, before the mask, before temperature and truncation (so they do not depend on
  the sampling knobs, like OpenAI's), for the chosen token and the `params.logprobs` most likely ids.
- the draw follows the plan's `sample` op exactly (docs/plan-format.md): most-likely-first order with ties to the
  lower id; top_k then top_p on the renormalized top-k mass; min_p keeps ids with p >= min_p * max p;
  u = uniform(seed, offset), offset = tokens generated so far, so a seeded request gives the same tokens in any
  batch and whether it is sampled here or on the device.
"""
from __future__ import annotations

import numpy as np

from xserv_aot.engine.api import GREEDY_BELOW, MAX_LOGPROBS, SamplingParams, TokenLogprob
from xserv_aot.runtime.numpy_ops import truncated_draw



def effective_temperature(t: float) -> float:
    """Temperatures too small for float32 logits / t are greedy (the device sampler treats 0 as argmax)."""
    return float(t) if t >= GREEDY_BELOW else 0.0



def apply_penalties(logits: np.ndarray, prompt_ids: list[int], output_ids: list[int], presence: float = 0.0,
                    frequency: float = 0.0, repetition: float = 1.0) -> np.ndarray:
    x = np.array(logits, dtype=np.float64)
    if repetition != 1.0:
        seen = np.unique(np.asarray(list(prompt_ids) + list(output_ids), dtype=np.int64))
        v = x[seen]
        x[seen] = np.where(v > 0, v / repetition, v * repetition)
    if output_ids and (frequency or presence):
        counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=x.shape[0])[:x.shape[0]]
        x -= frequency * counts + presence * (counts > 0)
    return x


def _top_order(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest entries of x, largest first, ties to the lower id (k <= 0 or >= len: all)."""
    if 0 < k < x.shape[0]:
        kth = np.partition(x, x.shape[0] - k)[x.shape[0] - k]
        cand = np.flatnonzero(x >= kth)
        return cand[np.lexsort((cand, -x[cand]))][:k]
    return np.argsort(-x, kind="stable")


def draw(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
         seed: int = 0, offset: int = 0) -> int:
    x = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        return int(np.argmax(x))
    order = _top_order(x, top_k)
    z = x[order] / temperature
    p = np.exp(z - z[0])
    return truncated_draw(p / p.sum(), order, top_p, min_p, seed, offset)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def apply_logit_bias(x: np.ndarray, bias: dict[int, float]) -> np.ndarray:
    ids = np.fromiter((int(t) for t in bias), dtype=np.int64, count=len(bias))
    vals = np.fromiter((float(v) for v in bias.values()), dtype=np.float64, count=len(bias))
    keep = ids < x.shape[0]
    np.add.at(x, ids[keep], vals[keep])
    return x


def sample_token(logits: np.ndarray, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                 seed: int, offset: int, allowed: np.ndarray | None = None) -> tuple[int, TokenLogprob | None]:
    """Sample one token from a float32 [vocab] logits row; also its logprobs when params.logprobs is set.
    allowed: bool [vocab] mask of the ids that may be sampled (None: all)."""
    x = apply_penalties(logits, prompt_ids, output_ids, params.presence_penalty, params.frequency_penalty,
                        params.repetition_penalty)
    if params.logit_bias:
        x = apply_logit_bias(x, params.logit_bias)
    xs = x
    if allowed is not None:
        if not allowed.any():
            raise RuntimeError("the token mask allows no token")
        xs = np.where(allowed[:x.shape[0]], x, -np.inf)
    token = draw(xs, effective_temperature(params.temperature), params.top_k, params.top_p, params.min_p, seed,
                 offset)
    if params.logprobs is None:
        return token, None
    lp = log_softmax(x)
    n = min(int(params.logprobs), MAX_LOGPROBS)
    top = [(int(i), float(lp[i])) for i in _top_order(lp, n)] if n > 0 else []
    return token, TokenLogprob(token, float(lp[token]), top)

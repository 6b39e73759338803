"""One prompt -> streamed text, driving a runner directly (device-side sampling), with timing."""
from __future__ import annotations

import time
from typing import Callable

from xserv_aot.detokenizer import IncrementalDetokenizer
from xserv_aot.errors import UsageError, XservError
from xserv_aot.runtime.batch import NONFINITE_ID
from xserv_aot.runtime.session import Session


def check_sampling(max_tokens: int, sampling: dict) -> None:
    if max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {max_tokens}")
    if not sampling.get("temperature", 0.0) >= 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {sampling['temperature']}")
    if not 0 < sampling.get("top_p", 1.0) <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {sampling['top_p']}")
    if sampling.get("top_k", 0) < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = off), got {sampling['top_k']}")


def stream_generate(runner, tok, prompt_ids: list[int], max_tokens: int, sampling: dict,
                    emit: Callable[[str], object]) -> dict:
    """Greedy or sampled generation until EOS / max_tokens / max_seq_len; emits text deltas as they complete."""
    check_sampling(max_tokens, sampling)
    limit = runner.plan.build.max_seq_len
    if len(prompt_ids) >= limit:
        raise UsageError(f"prompt is {len(prompt_ids)} tokens; the plan's max_seq_len is {limit}")
    max_tokens = min(max_tokens, limit - len(prompt_ids))
    eos = set(tok.eos_token_ids) | set(runner.plan.model.eos_token_ids)
    params = {"temperature": [sampling.get("temperature", 0.0)], "top_p": [sampling.get("top_p", 1.0)],
              "top_k": [sampling.get("top_k", 0)], "seeds": [sampling.get("seed", 0)]}
    session, detok = Session(runner), IncrementalDetokenizer(tok)
    t0 = time.perf_counter()
    for i in range(0, len(prompt_ids), session.chunk):
        ids, _ = session.step({0: prompt_ids[i: i + session.chunk]}, False, {**params, "sample_offsets": [0]})
    t1 = time.perf_counter()
    n, tokid = 0, int(ids[0])
    while True:
        n += 1
        if tokid == NONFINITE_ID:
            raise XservError("the model produced non-finite logits (NaN/Inf); is the plan's checkpoint corrupt?")
        if tokid in eos:
            break
        emit(detok.add(tokid))
        if n >= max_tokens:
            break
        ids, _ = session.step({0: [tokid]}, False, {**params, "sample_offsets": [n]})
        tokid = int(ids[0])
    emit(detok.flush())
    t2 = time.perf_counter()
    return {"tokens": n, "ttft_s": t1 - t0, "tok_per_s": (n - 1) / (t2 - t1) if n > 1 and t2 > t1 else 0.0}

"""`xserv-aot bench`: time to first token and decode throughput on random prompts (wall clock, host-synced steps)."""
from __future__ import annotations

import time

import numpy as np

from xserv_aot.runtime.session import Session


def run_bench(runner, prompt_len: int, decode_steps: int, batch: int = 1, seed: int = 0) -> dict:
    b = runner.plan.build
    if prompt_len + decode_steps > b.max_seq_len:
        raise ValueError(f"prompt {prompt_len} + {decode_steps} steps exceeds max_seq_len {b.max_seq_len}")
    if batch > b.max_num_seqs:
        raise ValueError(f"batch {batch} exceeds the plan's max_num_seqs {b.max_num_seqs}")
    rng = np.random.default_rng(seed)
    session = Session(runner, num_seqs=batch)
    prompts = [rng.integers(0, runner.plan.model.vocab_size, prompt_len).tolist() for _ in range(batch)]
    ttft = []
    last = {}
    for k, p in enumerate(prompts):
        t0 = time.perf_counter()
        last[k] = session.prefill(k, p, need_logits=False)[0]
        ttft.append(time.perf_counter() - t0)
    session.step({k: [last[k]] for k in range(batch)}, need_logits=False)          # warm the decode bucket
    t0 = time.perf_counter()
    for _ in range(decode_steps - 1):
        ids, _ = session.step({k: [last[k]] for k in range(batch)}, need_logits=False)
        last = {k: int(ids[k]) for k in range(batch)}
    dt = time.perf_counter() - t0
    steps = max(decode_steps - 1, 1)
    return {"backend": type(runner).__name__, "batch": batch, "prompt_len": prompt_len,
            "ttft_ms": float(np.median(ttft) * 1e3), "decode_ms_per_step": dt / steps * 1e3,
            "decode_tok_per_s": batch * steps / dt if dt > 0 else 0.0}

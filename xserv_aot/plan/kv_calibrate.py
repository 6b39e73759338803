"""`--kv-cache-scales calibrate`: per-layer FP8 KV scales measured on the model being compiled. Its plan runs on the
NumPy backend with a bf16 KV cache (target cpu) over PROMPTS, each prefilled and decoded GREEDY_TOKENS greedy steps;
layer l's k scale is fp8.scale_of(amax of every key written), max(amax, 1e-12) / 448, so the largest key seen is
stored as 448, and its v scale likewise. Needs real weights and the model's tokenizer; takes the time of
len(PROMPTS) short generations on the CPU (seconds for a 135M model, minutes for 8B)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from xserv_aot import fp8, kv_cache

PROMPTS = ("The capital of France is Paris. It is known for",
           "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
           "Explain, step by step, why the sky is blue during the day and red at sunset.",
           "1, 1, 2, 3, 5, 8, 13, 21,",
           "User: Write a short poem about the sea.\nAssistant:")
GREEDY_TOKENS = 16


def calibrate(plan_dir: Path, manifest: dict) -> dict:
    """The scales section for the plan being written in plan_dir (its weights and tokenizer already there)."""
    from xserv_aot.plan.manifest import Plan
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    from xserv_aot.runtime.session import Session
    from xserv_aot.tokenizer import Tokenizer
    probe = copy.deepcopy(manifest)
    b = probe["build"]
    b.update(kv_cache_dtype="auto", kv_cache_scales="auto", target="cpu")
    shape = probe["kv_cache"]["shape"]
    probe["kv_cache"] = {"shape": shape, "dtype": b["dtype"], "size": kv_cache.pool_bytes(shape, b["dtype"])}
    probe["kernels"] = {"target": "cpu"}
    path = Path(plan_dir) / "manifest.json"
    path.write_text(json.dumps(probe))
    try:
        plan = Plan.load(plan_dir, verify="none")
        runner, tok = NumpyRunner(plan), Tokenizer.from_dir(plan_dir)
        amax = np.zeros((shape[0], 2), np.float32)
        for text in PROMPTS:
            ids = tok.encode(text)[: plan.build.max_seq_len - GREEDY_TOKENS]
            runner.reset_kv()
            Session(runner).greedy(ids, GREEDY_TOKENS)
            for rank in runner.ranks:
                amax = np.maximum(amax, np.abs(rank.kv).reshape(shape[0], 2, -1).max(axis=-1))
    finally:
        path.unlink()
    return kv_cache.scales_section(fp8.scale_of(amax[:, 0]).tolist(), fp8.scale_of(amax[:, 1]).tolist(),
                                   "calibrated")

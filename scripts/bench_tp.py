"""Tensor-parallel benchmark and full-model parity on several H200s (issue 16 targets). NOT RUN yet.

  python3 scripts/bench_tp.py --config plans/qwen3-8b.config.json --tp 2 --check-logits    # >= 400 tok/s batch 1
  python3 scripts/bench_tp.py --config plans/qwen3-32b.config.json --tp 2 --batch 1,64     # >= 110 tok/s batch 1

Compiles a dummy-weight plan at --tp (and at TP=1 for --check-logits, which needs the model to fit one GPU), times
decode steps on rank 0 (host wall time of runner.run: staging, the pipe round trip to every rank, graph replay with
its NCCL calls, the copy back) after a --context-token prefill, and compares full-model logits of forced tokens
with TP=1 (relative L2 error per position; bf16 tolerance 2e-2). Prints a markdown report (and --json).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def compile_tp(config: Path, build: dict, tp: int, work: Path):
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    t0 = time.perf_counter()
    plan = compile_plan(config, work / f"{config.stem}-tp{tp}", BuildConfig.from_dict({**build, "tensor_parallel": tp}),
                        dummy_weights=True, force=True)
    log(f"compiled {config.stem} at TP={tp} in {time.perf_counter() - t0:.1f}s")
    return plan


def make_runner(plan):
    if plan.tensor_parallel > 1:
        from xserv_aot.runtime.tp_ranks import TensorParallelRunner
        return TensorParallelRunner(plan, "cuda")
    from xserv_aot.runtime.cuda.runner import CudaRunner
    return CudaRunner(plan)


def decode_ms(runner, batch: int, context: int, steps: int) -> np.ndarray:
    """Per-step wall times (ms) of `steps` decode steps of `batch` sequences at about `context` tokens each."""
    from xserv_aot.runtime.session import Session
    s = Session(runner, num_seqs=batch)
    rng = np.random.default_rng(batch)
    for k in range(batch):
        s.prefill(k, rng.integers(3, runner.plan.model.vocab_size, context).tolist(), need_logits=False)
    tokens = {k: [5] for k in range(batch)}
    s.step(tokens, need_logits=False)
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        s.step(tokens, need_logits=False)
        out.append(time.perf_counter() - t0)
    return np.array(out) * 1e3


def forced_logits(runner, prompt: list[int], forced: list[int]) -> np.ndarray:
    from xserv_aot.runtime.session import Session
    s = Session(runner)
    out = [s.prefill(0, prompt)[1]]
    out += [s.step({0: [t]})[1][0] for t in forced]
    return np.array(out, dtype=np.float64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="plans/qwen3-8b.config.json")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", default="1", help="decode batch sizes, e.g. 1,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--work", default="/tmp/xserv-bench-tp")
    ap.add_argument("--check-logits", action="store_true", help="also compare logits with a TP=1 plan")
    ap.add_argument("--json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    top = max(batches)
    decode = sorted({1, *batches})
    build = {"max_num_seqs": top, "decode_buckets": decode, "prefill_buckets": sorted({128, max(128, top)}),
             "max_seq_len": args.max_seq_len, "dtype": "bfloat16", "target": "sm_90a",
             "num_blocks": top * -(-args.max_seq_len // 16)}
    work, config = Path(args.work), Path(args.config)
    work.mkdir(parents=True, exist_ok=True)
    res = {"config": config.name, "tp": args.tp, "context": args.context, "decode": {}}
    plan = compile_tp(config, build, args.tp, work)
    runner = make_runner(plan)
    try:
        for b in batches:
            ms = decode_ms(runner, b, args.context, args.steps)
            res["decode"][b] = {"median_ms": float(np.median(ms)), "tok_per_s": b * 1e3 / float(np.median(ms))}
            log(f"TP={args.tp} batch {b}: {res['decode'][b]['median_ms']:.3f} ms/step, "
                f"{res['decode'][b]['tok_per_s']:.1f} tok/s")
        if args.check_logits:
            rng = np.random.default_rng(0)
            prompt = rng.integers(3, plan.model.vocab_size, 200).tolist()
            forced = rng.integers(3, plan.model.vocab_size, 16).tolist()
            runner.reset_kv()
            got = forced_logits(runner, prompt, forced)
    finally:
        runner.close()
    if args.check_logits:
        one = make_runner(compile_tp(config, build, 1, work))
        try:
            want = forced_logits(one, prompt, forced)
        finally:
            one.close()
        errs = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
        res["logits_rel_err_max"] = float(errs.max())
        res["argmax_agree"] = int((got.argmax(1) == want.argmax(1)).sum())
        log(f"logits TP={args.tp} vs TP=1: max rel err {errs.max():.2e} (bf16 tolerance 2e-2), argmax agree "
            f"{res['argmax_agree']}/{len(errs)}")
    print(f"\n| model | TP | batch | ms/step | tok/s |\n| --- | --- | --- | --- | --- |")
    for b, d in res["decode"].items():
        print(f"| {config.stem} | {args.tp} | {b} | {d['median_ms']:.3f} | {d['tok_per_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

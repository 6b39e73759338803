#!/usr/bin/env python3
"""Full-model parity on the GPU: a 36-layer Qwen3-8B-shape model with random bf16 weights made by transformers,
saved as sharded safetensors, compiled with `xserv-aot compile`, served by CudaRunner; per-step logits over a
prompt and teacher-forced decode steps against HF float32, next to HF bf16's own error against the same reference.

  python3 scripts/parity_8b.py --work /tmp/parity [--prompt 100 --steps 64 --seed N --batch 1[,8,...]]

Pass: our max (and mean) per-step relative error <= 1.2 x HF bf16's. --batch B runs B copies of the sequence in
one decode bucket (every row must match row 0 bit for bit: batched independence at the full shape); a list of
batch sizes checks each against the same model, references and plan.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960)
BUILD = dict(max_num_seqs=64, decode_buckets=[1, 2, 4, 8, 16, 32, 48, 64], prefill_buckets=[64, 128, 512],
             max_seq_len=1024, block_size=16, num_blocks=4096, dtype="bfloat16", target="sm_90a")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/parity")
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--batch", default="1", help="batch size, or a comma-separated list of them")
    ap.add_argument("--out")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="a build setting on top of BUILD, e.g. --set megakernel_sms=132")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else int(np.random.default_rng().integers(1 << 30))
    log(f"seed {seed}")
    import torch

    from tests.test_cuda_e2e import make_model          # the GPU tests' random Qwen3 (fan-in scaled weights)
    work = Path(args.work)
    hf_dir, plan_dir = work / "hf", work / "plan"
    t0 = time.perf_counter()
    model = make_model(hf_dir, SHAPE, seed, max_shard_size="4GB")
    log(f"HF model made and saved ({len(list(hf_dir.glob('*.safetensors')))} shards) in {time.perf_counter() - t0:.0f}s")

    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, SHAPE["vocab_size"], args.prompt).tolist()
    forced = rng.integers(3, SHAPE["vocab_size"], args.steps).tolist()
    ids = torch.tensor([prompt + forced], device="cuda")
    with torch.no_grad():
        bf16 = model(ids).logits[0].float().cpu().numpy()[args.prompt - 1:]
        model.float()
        fp32 = model(ids).logits[0].float().cpu().numpy()[args.prompt - 1:]
    del model
    torch.cuda.empty_cache()
    log("HF bf16 and float32 logits done")

    build = work / "build.json"
    build.write_text(json.dumps({**BUILD, **{k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}}))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "xserv_aot.cli", "compile", str(hf_dir), "-o", str(plan_dir),
                        "--build-config", str(build), "--force"], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"compile failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    log(f"xserv-aot compile: {time.perf_counter() - t0:.0f}s")

    from xserv_aot.plan.manifest import Plan
    from xserv_aot.runtime.cuda.runner import CudaRunner
    from xserv_aot.runtime.session import Session
    results = []
    runner = CudaRunner(Plan.load(plan_dir), log=log)
    try:
        for batch in (int(b) for b in args.batch.split(",")):
            got = run_batch(Session(runner, num_seqs=batch), batch, prompt, forced)
            results.append(score(seed, batch, got, bf16, fp32))
            print(json.dumps({k: v for k, v in results[-1].items() if not k.endswith("_steps")}, indent=1), flush=True)
    finally:
        runner.close()
    if args.out:
        Path(args.out).write_text(json.dumps(results if len(results) > 1 else results[0], indent=1))
    sys.exit(0 if all(r["pass"] for r in results) else 1)


def run_batch(s, batch: int, prompt: list[int], forced: list[int]) -> list[list[np.ndarray]]:
    """The prompt's last logits then one row a teacher-forced step, for each of `batch` copies of the sequence."""
    rows = list(range(batch))
    got = [[] for _ in rows]
    for i in rows:
        _, last = s.prefill(i, prompt)
        got[i].append(last)
    for tok in forced:
        out = s.step({i: [tok] for i in rows})[1]
        for i in rows:
            got[i].append(out[i])
    return got


def score(seed: int, batch: int, got: list[list[np.ndarray]], bf16: np.ndarray, fp32: np.ndarray) -> dict:
    ours = np.array(got[0], np.float64)
    for i in range(1, batch):
        if not np.array_equal(np.array(got[i]), np.array(got[0])):
            sys.exit(f"batch {batch}: row {i} differs from row 0")
    e_ours, e_bf16 = rel(ours, fp32), rel(bf16.astype(np.float64), fp32)
    res = {"seed": seed, "steps": len(e_ours), "batch": batch,
           "ours_max": float(e_ours.max()), "ours_mean": float(e_ours.mean()),
           "hf_bf16_max": float(e_bf16.max()), "hf_bf16_mean": float(e_bf16.mean()),
           "greedy_agree_vs_fp32": float((ours.argmax(1) == fp32.argmax(1)).mean()),
           "hf_bf16_greedy_agree_vs_fp32": float((bf16.argmax(1) == fp32.argmax(1)).mean()),
           "ours_steps": e_ours.round(5).tolist(), "hf_bf16_steps": e_bf16.round(5).tolist()}
    res["pass"] = res["ours_max"] <= 1.2 * res["hf_bf16_max"] and res["ours_mean"] <= 1.2 * res["hf_bf16_mean"]
    return res


if __name__ == "__main__":
    main()

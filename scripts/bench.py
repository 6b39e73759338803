#!/usr/bin/env python3
"""Qwen3-8B-shape benchmark on one GPU with dummy weights: batch-1 decode at context 128 / 4096, TTFT for
128 / 1024 / 4096 / 8192-token prompts, decode throughput at batch 8 / 32 / 64, per-op profile of decode_1, the
bandwidth roofline, and HF transformers (static cache + torch.compile) as the peer, in the same run.

  python3 scripts/bench.py --plan PLAN_DIR --out docs/benchmarks/DATE-qwen3-8b-h200.md [--hf]
  python3 scripts/bench.py --config plans/qwen3-8b.config.json --build plans/h200.build.json ...   (compiles)
Decode steps are timed wall-clock around runner.run() (staging, H2D, graph replay, D2H, sync), median of many.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xserv_aot.plan.roofline import bucket_costs, ceilings_for, costs_floor_s  # noqa: E402
from xserv_aot.runtime.batch import BatchDescription  # noqa: E402
from xserv_aot.runtime.cuda.profile import decode_batch, format_table, profile_runner  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_plan(args):
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.plan.manifest import Plan
    if args.plan:
        return Plan.load(args.plan)
    build = BuildConfig.from_dict(json.loads(Path(args.build).read_text()))
    out = Path(args.work) / "qwen3-8b-plan"
    t0 = time.perf_counter()
    plan = compile_plan(Path(args.config), out, build, dummy_weights=True, force=True)
    log(f"compiled plan in {time.perf_counter() - t0:.1f}s")
    return plan


def step_times(runner, batch, n: int) -> np.ndarray:
    runner.run(batch)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        runner.run(batch)
        out.append(time.perf_counter() - t0)
    return np.array(out) * 1e3


def decode_bytes(plan, bucket: str, context: int) -> int:
    bk = next(b for b in plan.buckets if b.name == bucket)
    return sum(c[2] for c in bucket_costs(plan, bk, context))                    # decode: every seq of the bucket


def step_floor_ms(plan, bk, context: int) -> float:
    """The bucket's floor at `context` (plan/roofline.py): bytes over the read ceiling or FLOPs over the peak."""
    return costs_floor_s(bucket_costs(plan, bk, context), ceilings_for(plan.build.target))[0] * 1e3


def ttft(runner, prompt_len: int, reps: int = 3) -> float:
    from xserv_aot.runtime.session import Session
    rng = np.random.default_rng(prompt_len)
    out = []
    for _ in range(reps):
        s = Session(runner)
        prompt = rng.integers(0, runner.plan.model.vocab_size, prompt_len).tolist()
        t0 = time.perf_counter()
        s.prefill(0, prompt, need_logits=False)
        out.append(time.perf_counter() - t0)
    return float(np.median(out) * 1e3)


def bench_ours(plan, res: dict, steps: int) -> None:
    from xserv_aot.runtime.cuda.runner import CudaRunner
    t0 = time.perf_counter()
    runner = CudaRunner(plan, log=log)
    res["startup_s"] = time.perf_counter() - t0
    try:
        for ctx in (128, 4096):
            t = step_times(runner, decode_batch(plan, 1, ctx), steps)
            nbytes = decode_bytes(plan, "decode_1", ctx)
            res[f"decode_b1_ctx{ctx}"] = {"ms_per_step": float(np.median(t)), "p90_ms": float(np.percentile(t, 90)),
                                          "tok_per_s": 1e3 / float(np.median(t)), "bytes_per_step": nbytes,
                                          "roofline_ms": nbytes / ceilings_for(plan.build.target).read_bytes_per_s * 1e3}
            log(f"decode b1 ctx {ctx}: {np.median(t):.3f} ms/step = {1e3 / np.median(t):.1f} tok/s "
                f"(roofline {nbytes / ceilings_for(plan.build.target).read_bytes_per_s * 1e3:.3f} ms)")
        for b in (8, 32, 64):
            if b > plan.build.max_num_seqs:
                continue
            t = step_times(runner, decode_batch(plan, b, 256), max(steps // 2, 10))
            res[f"decode_b{b}_ctx256"] = {"ms_per_step": float(np.median(t)), "tok_per_s": b * 1e3 / float(np.median(t))}
            log(f"decode b{b} ctx 256: {np.median(t):.3f} ms/step = {b * 1e3 / np.median(t):.0f} tok/s")
        for n in (128, 1024, 4096, 8192):
            if n <= plan.build.max_seq_len:
                res[f"ttft_{n}"] = ttft(runner, n)
                log(f"TTFT {n}: {res[f'ttft_{n}']:.1f} ms")
        for ctx in (128, 4096):
            prof = profile_runner(runner, "decode_1", ctx)
            res[f"profile_decode_1_ctx{ctx}"] = format_table(prof, plan.build.target)
            print(res[f"profile_decode_1_ctx{ctx}"], flush=True)
        for b in (8, 64):
            if f"decode_{b}" in runner.buckets:
                prof = profile_runner(runner, f"decode_{b}", 256)
                res[f"profile_decode_{b}_ctx256"] = format_table(prof, plan.build.target)
                print(res[f"profile_decode_{b}_ctx256"], flush=True)
        big = max(b.num_tokens for b in plan.buckets if b.kind == "prefill")
        prof = profile_runner(runner, f"prefill_{big}", big)
        res[f"profile_prefill_{big}"] = format_table(prof, plan.build.target)
        print(res[f"profile_prefill_{big}"], flush=True)
    finally:
        runner.close()


def mixed_batch(plan, num_decodes: int, context: int, chunk: int) -> BatchDescription:
    """num_decodes sequences decoding at `context` plus one new prompt's first `chunk` tokens (own blocks)."""
    b = plan.build
    dec = decode_batch(plan, num_decodes, context)
    base = num_decodes * -(-context // b.block_size)
    table = list(range(base, base + -(-chunk // b.block_size)))
    if table[-1] >= b.num_blocks:
        raise ValueError("mixed batch does not fit the KV pool")
    n = dec.num_tokens
    return BatchDescription(
        input_ids=dec.input_ids + [1] * chunk, positions=dec.positions + list(range(chunk)),
        slot_mapping=dec.slot_mapping + [table[p // b.block_size] * b.block_size + p % b.block_size
                                         for p in range(chunk)],
        query_start_loc=dec.query_start_loc + [n + chunk], seq_lens=dec.seq_lens + [chunk],
        block_tables=dec.block_tables + [table])


def bench_throughput(plan, res: dict, steps: int) -> None:
    """Decode steps for batch x context with their floors (step_floor_ms: weights + KV bytes or FLOPs), mixed steps
    (decodes + a 512-token chunk), and per-op profiles of the large buckets."""
    from xserv_aot.runtime.cuda.runner import CudaRunner
    runner = CudaRunner(plan, log=log)
    rows = []
    try:
        for bsz in (1, 8, 32, 64, 128, 256):
            if bsz > plan.build.max_num_seqs:
                continue
            for ctx in (256, 1024, 4096):
                try:
                    batch = decode_batch(plan, bsz, ctx)
                except ValueError:
                    continue
                t = step_times(runner, batch, steps)
                bk = runner.bucket_for(batch)
                ms, floor = float(np.median(t)), step_floor_ms(plan, bk, ctx)
                rows.append((f"decode b{bsz} ctx {ctx}", ms, bsz * 1e3 / ms, floor))
                res[f"thr_decode_b{bsz}_ctx{ctx}"] = {"ms_per_step": ms, "tok_per_s": bsz * 1e3 / ms, "floor_ms": floor}
                log(f"decode b{bsz} ctx {ctx}: {ms:.3f} ms/step = {bsz * 1e3 / ms:.0f} tok/s (floor {floor:.3f} ms)")
        for nd in (64, 256):
            if nd > plan.build.max_num_seqs - 1 + 1:
                continue
            for ctx in (256, 1024):
                try:
                    batch = mixed_batch(plan, min(nd, plan.build.max_num_seqs - 1), ctx, 512)
                    t = step_times(runner, batch, max(steps // 2, 10))
                except ValueError as e:
                    log(f"mixed {nd}+512 ctx {ctx}: {e}")
                    continue
                ms = float(np.median(t))
                bk = runner.bucket_for(batch)
                rows.append((f"mixed {batch.num_seqs - 1} decodes ctx {ctx} + 512 prompt ({bk.name})", ms,
                             (batch.num_seqs - 1) * 1e3 / ms, float("nan")))
                res[f"thr_mixed_{nd}_ctx{ctx}"] = {"ms_per_step": ms, "bucket": bk.name}
                log(f"mixed {batch.num_seqs - 1} decodes ctx {ctx} + 512: {ms:.3f} ms/step in {bk.name}")
        res["throughput_table"] = "\n".join(
            [f"{'step':48s} {'ms':>8s} {'decode tok/s':>12s} {'floor ms':>9s}"] +
            [f"{a:48s} {b:8.3f} {c:12.0f} {d:9.3f}" for a, b, c, d in rows])
        print(res["throughput_table"], flush=True)
        for name, ctx in (("decode_64", 1024), ("decode_256", 1024), ("decode_32", 1024), ("prefill_640", 640)):
            if name in runner.buckets:
                prof = profile_runner(runner, name, ctx)
                res[f"profile_{name}_ctx{ctx}"] = format_table(prof, plan.build.target)
                print(res[f"profile_{name}_ctx{ctx}"], flush=True)
    finally:
        runner.close()


def bench_pdl(plan, res: dict, steps: int) -> None:
    """Batch-1 and batch-8 decode again with programmatic dependent launch on (build.pdl): what PDL buys. The
    plan is reused with pdl switched on in memory (a plan compiled with --pdl launches the same way)."""
    import copy
    import dataclasses

    from xserv_aot.runtime.cuda.runner import CudaRunner
    pdl_plan = copy.copy(plan)
    pdl_plan.build = dataclasses.replace(plan.build, pdl=True)
    runner = CudaRunner(pdl_plan)
    try:
        for b, ctx in ((1, 128), (1, 4096), (8, 256)):
            t = step_times(runner, decode_batch(plan, b, ctx), steps)
            res[f"decode_b{b}_ctx{ctx}_pdl"] = {"ms_per_step": float(np.median(t)), "tok_per_s": b * 1e3 / float(np.median(t))}
            log(f"decode b{b} ctx {ctx} with PDL: {np.median(t):.3f} ms/step = {b * 1e3 / np.median(t):.1f} tok/s")
    finally:
        runner.close()


def gemv_sweep(res: dict, copies: int = 8, reps: int = 5) -> None:
    """Batch-1 GEMV variants (rows per warp R = 1, 2, 4) on the Qwen3-8B shapes, each launch on one of `copies`
    weight buffers in turn (so L2 holds none of them), timed as a captured graph of copies x reps launches."""
    from xserv_aot.runtime.cuda.driver import Launch
    from xserv_aot.runtime.cuda.kernel_lib import KernelLib
    lib = KernelLib()
    dev = lib.dev
    rows = []
    for name, N, K in (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("down", 4096, 12288), ("gate_up", 24576, 4096)):
        ws = [lib.empty((N, K), "bfloat16", poison=False) for _ in range(copies)]
        for j, w in enumerate(ws):
            lib.launch("fill_normal_bf16", [4096], [256], [("ptr", w), ("u64", N * K), ("u64", j), ("f32", 0.0),
                                                            ("f32", 0.02)])
        x = lib.to_device(np.random.default_rng(0).standard_normal((1, K)).astype(np.float32), "bfloat16")
        out = lib.empty((1, N), "bfloat16", poison=False)
        variants = ([("gemv_gate_m1", 2)] if name == "gate_up" else
                    [("gemv_r1_m1_bf16", 1), ("gemv_m1_bf16", 2), ("gemv_r4_m1_bf16", 4)])
        for fn, R in variants:
            if fn == "gemv_gate_m1":
                grid, mk = -(-(N // 2) // 8), lambda w: [("ptr", x.ptr), ("ptr", w.ptr), ("ptr", out.ptr), ("i32", 1),
                                                          ("i32", N // 2), ("i32", K)]
            else:
                grid, mk = -(-N // (8 * R)), lambda w: [("ptr", x.ptr), ("ptr", w.ptr), ("ptr", 0), ("ptr", out.ptr),
                                                         ("i32", 1), ("i32", N), ("i32", K)]
            launches = [Launch(fn, lib.func(fn), (grid, 1, 1), (256, 1, 1), 0, mk(w)) for w in ws] * reps
            g = dev.capture(lambda st: [ln(st) for ln in launches])
            dev.graph_launch(g)
            dev.sync()
            e0, e1 = dev.event(), dev.event()
            t = []
            for _ in range(5):
                dev.record(e0)
                dev.graph_launch(g)
                dev.record(e1)
                t.append(dev.elapsed_ms(e0, e1) / len(launches) * 1e3)
            us = float(np.median(t))
            rows.append((name, fn, R, us, N * K * 2 / (us * 1e-6) / 1e9))
            log(f"gemv sweep {name} {N}x{K} {fn} (R={R}): {us:.2f} us, {rows[-1][4]:.0f} GB/s")
    dev.close()
    res["gemv_sweep"] = "\n".join([f"{'matrix':8s} {'kernel':18s} {'R':>2s} {'us':>8s} {'GB/s':>6s}"] +
                                   [f"{a:8s} {b:18s} {c:2d} {d:8.2f} {e:6.0f}" for a, b, c, d, e in rows])
    print(res["gemv_sweep"], flush=True)


def bench_hf(plan, res: dict, new_tokens: int = 128) -> None:
    """HF transformers peer: same config, random bf16 weights, static KV cache, generate()'s automatic torch.compile."""
    import torch
    import transformers
    m = plan.model
    cfg = transformers.Qwen3Config(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                                   intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers,
                                   num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                                   head_dim=m.head_dim, max_position_embeddings=m.max_position_embeddings,
                                   rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=False)
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config.cache_implementation = "static"      # generate() then compiles the decode forward
    model.generation_config.pad_token_id = 0                      # itself (torch.compile, mode reduce-overhead)
    ids = torch.randint(0, m.vocab_size, (1, 128), device="cuda")

    def gen(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    gen(new_tokens + 1)
    gen(new_tokens + 1)
    res["hf_compile_s"] = time.perf_counter() - t0
    t1 = np.median([gen(1) for _ in range(3)])
    tn = np.median([gen(new_tokens + 1) for _ in range(3)])
    res["hf_decode_b1_ctx128"] = {"ms_per_step": (tn - t1) / new_tokens * 1e3, "tok_per_s": new_tokens / (tn - t1),
                                  "ttft_128_ms": t1 * 1e3}
    res["hf_version"] = f"transformers {transformers.__version__}, torch {torch.__version__}"
    log(f"HF decode b1 ctx~128: {res['hf_decode_b1_ctx128']['ms_per_step']:.3f} ms/step = "
        f"{res['hf_decode_b1_ctx128']['tok_per_s']:.1f} tok/s; TTFT 128 {t1 * 1e3:.1f} ms")


def gpu_info() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                               "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def report(res: dict, args, plan) -> str:
    d = res
    lines = [f"# Qwen3-8B shape on one H200: xserv-aot CUDA backend ({res['date']})", "",
             f"- command: `{res['command']}`", f"- commit: {args.commit or 'uncommitted working tree'}",
             f"- GPU: {res['gpu']}", f"- plan: {plan.model.num_layers} layers, dummy weights (bf16), buckets "
             f"decode {plan.build.decode_buckets} prefill {plan.build.prefill_buckets}, max_seq_len "
             f"{plan.build.max_seq_len}; GEMM library: {'CUTLASS' if plan.kernels.get('gemm_library') else 'none (mma.sync fallback)'}",
             f"- runner start (alloc, dummy weights, warm-up, graph capture): {d.get('startup_s', 0):.1f} s", "",
             "| measurement | ms | tok/s | roofline ms (bytes / the target's read bandwidth, plan/roofline.py) |", "| --- | --- | --- | --- |"]
    for ctx in (128, 4096):
        r = d.get(f"decode_b1_ctx{ctx}")
        if r:
            lines.append(f"| decode batch 1, context {ctx} | {r['ms_per_step']:.3f} | {r['tok_per_s']:.1f} | "
                         f"{r['roofline_ms']:.3f} ({1e3 / r['roofline_ms']:.0f} tok/s) |")
    for b, ctx in ((1, 128), (1, 4096), (8, 256)):
        r = d.get(f"decode_b{b}_ctx{ctx}_pdl")
        if r:
            lines.append(f"| decode batch {b}, context {ctx}, PDL on (build.pdl) | {r['ms_per_step']:.3f} | "
                         f"{r['tok_per_s']:.1f} | |")
    for b in (8, 32, 64):
        r = d.get(f"decode_b{b}_ctx256")
        if r:
            lines.append(f"| decode batch {b}, context 256 | {r['ms_per_step']:.3f} | {r['tok_per_s']:.0f} | |")
    for n in (128, 1024, 4096, 8192):
        if f"ttft_{n}" in d:
            lines.append(f"| TTFT, {n}-token prompt | {d[f'ttft_{n}']:.1f} | | |")
    hf = d.get("hf_decode_b1_ctx128")
    if hf:
        lines.append(f"| HF transformers peer: decode batch 1, context ~128 | {hf['ms_per_step']:.3f} | "
                     f"{hf['tok_per_s']:.1f} | |")
        lines.append(f"| HF transformers peer: TTFT 128 | {hf['ttft_128_ms']:.1f} | | |")
        lines.append("")
        lines.append(f"Peer: {d['hf_version']}, Qwen3ForCausalLM same config, random bf16 weights, static cache, "
                     f"torch.compile of the decode step by generate() (CompileConfig default: mode='reduce-overhead'); "
                     f"compile + warm-up {d['hf_compile_s']:.0f} s." + (f" Note: {d['hf_note']}." if "hf_note" in d else ""))
    elif "hf_error" in d:
        lines += ["", f"Peer: HF transformers run failed: {d['hf_error']}"]
    if "gemv_sweep" in d:
        lines += ["", "## Batch-1 GEMV variants (rows per warp), weights rotated over 8 copies (no L2 reuse)", "",
                  "```", d["gemv_sweep"], "```"]
    for key in sorted(k for k in d if k.startswith("profile_")):
        lines += ["", f"## {key}", "", "```", d[key], "```"]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan")
    ap.add_argument("--config", default="plans/qwen3-8b.config.json")
    ap.add_argument("--build", default="plans/h200.build.json")
    ap.add_argument("--work", default="/tmp/xserv-bench")
    ap.add_argument("--out", help="markdown report path")
    ap.add_argument("--json")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--pdl", action="store_true", help="also time decode with PDL on (build.pdl)")
    ap.add_argument("--throughput", action="store_true",
                    help="only the batched decode / mixed-step table with floors and large-bucket profiles")
    ap.add_argument("--gemv-sweep", action="store_true", help="also time batch-1 GEMV variants on the 8B shapes")
    ap.add_argument("--hf-from", help="reuse the HF peer numbers of an earlier bench.json (same GPU, same day)")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers (static cache + torch.compile)")
    ap.add_argument("--commit", default=os.environ.get("XSERV_COMMIT", ""))
    args = ap.parse_args()
    res = {"date": datetime.date.today().isoformat(), "command": " ".join(["python3"] + sys.argv), "gpu": gpu_info()}
    plan = load_plan(args)
    if args.throughput:
        bench_throughput(plan, res, args.steps)
        text = "\n".join(["# batched decode throughput", "", f"- command: `{res['command']}`", f"- GPU: {res['gpu']}",
                          f"- commit: {args.commit or 'uncommitted working tree'}", "", "```",
                          res.get("throughput_table", ""), "```"] +
                         sum([["", f"## {k}", "", "```", v, "```"] for k, v in res.items() if k.startswith("profile_")],
                             []))
        if args.out:
            Path(args.out).write_text(text + "\n")
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        return
    bench_ours(plan, res, args.steps)
    if args.pdl:
        bench_pdl(plan, res, args.steps)
    if args.gemv_sweep:
        gemv_sweep(res)
    if args.hf_from:
        old = json.loads(Path(args.hf_from).read_text())
        res.update({k: v for k, v in old.items() if k.startswith("hf_")})
        res["hf_note"] = f"peer numbers from an earlier run in this session ({args.hf_from})"
    if args.hf:
        try:
            bench_hf(plan, res)
        except Exception as e:          # the peer is informative; its failure must not lose our numbers
            res["hf_error"] = " ".join(str(e).split())[:300]
            log(f"HF peer failed: {res['hf_error']}")
    text = report(res, args, plan)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    print(text)


if __name__ == "__main__":
    main()

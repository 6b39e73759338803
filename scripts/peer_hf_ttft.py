#!/usr/bin/env python3
"""Same-run TTFT peer (device machine): HF transformers Qwen3ForCausalLM built from a config.json with random bf16
weights and `attn_implementation="sdpa"`; one prompt of each length, `model(input_ids, logits_to_keep=1,
use_cache=True)` then argmax of the last logits; CUDA events, median of 5 runs after 2 warm-ups.

  python3 scripts/peer_hf_ttft.py [--config plans/qwen3-8b.config.json] [--prompts 1024,4096,8192]
"""
from __future__ import annotations

import argparse
import json

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

WARMUP, RUNS = 2, 5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="plans/qwen3-8b.config.json")
    ap.add_argument("--prompts", default="1024,4096,8192")
    args = ap.parse_args()
    cfg = {k: v for k, v in json.load(open(args.config)).items() if not k.startswith("_")}
    config = Qwen3Config(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    print(f"HF {config.model_type}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, "
          f"attention {model.config._attn_implementation}", flush=True)
    for n in (int(x) for x in args.prompts.split(",")):
        ids = torch.randint(0, config.vocab_size, (1, n), device="cuda")
        times = []
        with torch.inference_mode():
            for i in range(WARMUP + RUNS):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = model(input_ids=ids, logits_to_keep=1, use_cache=True)
                out.logits[:, -1].argmax(-1)
                b.record()
                torch.cuda.synchronize()
                if i >= WARMUP:
                    times.append(a.elapsed_time(b))
                del out
        print(f"HF sdpa TTFT {n}: {sorted(times)[RUNS // 2]:.1f} ms (runs {', '.join(f'{t:.1f}' for t in times)})",
              flush=True)


if __name__ == "__main__":
    main()

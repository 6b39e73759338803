#!/usr/bin/env python3
"""NumPy backend vs HF transformers (float32, same CPU, same process, one after the other): prefill of an N-token
prompt and greedy decode, SmolLM2-135M-Instruct from its GGUF (dequantized to float32 by both).

  python3 scripts/bench_cpu.py [--prompt-len 1525 --decode 32 --gguf build/assets/smollm2/...gguf]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def ours(gguf: Path, ids: list[int], decode: int) -> dict:
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    from xserv_aot.runtime.session import Session
    out = Path(tempfile.mkdtemp()) / "plan"
    plan = compile_plan(gguf, out, BuildConfig(max_num_seqs=1, decode_buckets=[1], prefill_buckets=[512],
                                               max_seq_len=2048, dtype="float32", target="cpu"))
    s = Session(NumpyRunner(plan))
    greedy = {"temperature": [0.0], "top_p": [1.0], "top_k": [0], "seeds": [0]}
    t0 = time.perf_counter()
    for i in range(0, len(ids), s.chunk):
        tok, _ = s.step({0: ids[i:i + s.chunk]}, False, {**greedy, "sample_offsets": [0]})
    t1 = time.perf_counter()
    toks = [int(tok[0])]
    for n in range(1, decode):
        tok, _ = s.step({0: [toks[-1]]}, False, {**greedy, "sample_offsets": [n]})
        toks.append(int(tok[0]))
    t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_tok_per_s": (decode - 1) / (t2 - t1), "tokens": toks}


def hf(gguf: Path, ids: list[int], decode: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        out = model(x, use_cache=True, logits_to_keep=1)
        t1 = time.perf_counter()
        toks, past = [int(out.logits[0, -1].argmax())], out.past_key_values
        for _ in range(1, decode):
            out = model(torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            toks.append(int(out.logits[0, -1].argmax()))
        t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_tok_per_s": (decode - 1) / (t2 - t1), "tokens": toks,
            "torch_threads": torch.get_num_threads()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, default=ROOT / "build/assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--prompt-len", type=int, default=1525)
    ap.add_argument("--decode", type=int, default=32)
    args = ap.parse_args()
    ids = [100 + (i * 7919) % 40000 for i in range(args.prompt_len)]
    result = {"ours": ours(args.gguf, ids, args.decode), "hf": hf(args.gguf, ids, args.decode)}
    result["same_greedy_tokens"] = result["ours"].pop("tokens") == result["hf"].pop("tokens")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

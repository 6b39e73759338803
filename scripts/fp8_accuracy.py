"""FP8 accuracy on real weights, NumPy backend: the same model compiled bf16 and `--quantization fp8`.

For each prompt: the bf16 plan generates greedily; the FP8 plan is fed the same tokens (teacher forcing), so every
step compares logits at the same context: relative error ||l_fp8 - l_bf16|| / ||l_bf16|| and whether the argmax
agrees. Then the FP8 plan generates on its own, and the script counts its tokens equal to bf16's position by
position (after a first divergence the two texts differ, so this is the stricter figure). Prompts longer than
64 tokens run their prefill as W8A8 (quantize_fp8 + FP8 GEMM), decode steps as W8A16.

    python scripts/fp8_accuracy.py build/assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --tokens 64 \
        [--rounding gptq] [--scale mse|refit] [--dev]

--dev measures on DEV_PROMPTS, held-out prompts of the same kind (short questions, code, two long passages) on
which settings are chosen before PROMPTS, the evaluation, is run.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xserv_aot.config import BuildConfig  # noqa: E402
from xserv_aot.plan.builder import compile_plan  # noqa: E402
from xserv_aot.runtime.numpy_backend import NumpyRunner  # noqa: E402
from xserv_aot.runtime.session import Session  # noqa: E402
from xserv_aot.tokenizer import Tokenizer  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three laws of thermodynamics state that",
    "Here is a recipe for a simple tomato soup:",
    "In 1969, the Apollo 11 mission",
    "A haiku about the ocean:",
    "The difference between a list and a tuple in Python is",
    "Photosynthesis is the process by which",
    "To solve a quadratic equation, you",
    "The quick brown fox jumps over the lazy dog. This sentence is famous because",
    "import numpy as np\n\ndef softmax(x):",
    "Dear hiring manager, I am writing to apply for",
    "The main causes of the French Revolution were",
    "Water boils at 100 degrees Celsius at sea level, but on a mountain",
    "Machine learning models are trained by",
    "SELECT name, COUNT(*) FROM orders",
    "The best way to learn a new language is",
    ("Large language models read a prompt as a sequence of tokens. Each token is embedded, passed through many "
     "transformer layers of attention and feed-forward blocks, and the last layer's output is projected onto the "
     "vocabulary to score the next token. Quantizing the weights of those layers to eight bits halves the bytes "
     "that each decoding step must read, which is why"),
    ("The history of the printing press begins long before Gutenberg. Woodblock printing was used in China as "
     "early as the seventh century, and movable type made of ceramic and later metal appeared in China and Korea "
     "centuries before it reached Europe. When Gutenberg combined movable metal type with an oil-based ink and a "
     "screw press around 1440, the consequences for European society were"),
]
DEV_PROMPTS = [                      # held-out prompts of the same kind, for choosing settings (never PROMPTS)
    "The largest planet in the solar system is",
    "def is_prime(n):",
    "It was a dark and stormy night, and the old house",
    "The main idea of the theory of evolution is that",
    "Here is how to make a cup of green tea:",
    "In 1492, Christopher Columbus",
    "A limerick about a cat:",
    "The difference between a process and a thread is",
    "The human heart pumps blood by",
    "To find the area of a circle, you",
    "Every good boy does fine. Music students learn this phrase because",
    "import json\n\ndef load_config(path):",
    "Dear customer, thank you for your order of",
    "The main causes of the First World War were",
    "Ice melts at zero degrees Celsius, but salt water",
    "Neural networks learn by adjusting",
    "UPDATE users SET email =",
    "The easiest way to start running is",
    ("A compiler translates a program written in a high-level language into machine code. It first reads the "
     "source text and splits it into tokens, then builds a syntax tree, checks the types of every expression, "
     "and finally emits instructions for the target processor. Doing this work ahead of time, rather than while "
     "the program runs, matters because"),
    ("The story of the bicycle starts in the early nineteenth century. The first two-wheeled machines had no "
     "pedals at all: riders pushed themselves along the ground with their feet. Pedals attached to the front "
     "wheel came decades later, and the chain drive and air-filled tyres that made cycling comfortable arrived "
     "near the end of the century, when the effect on how ordinary people travelled was"),
]
BUILD = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[32, 128], max_seq_len=256, block_size=16,
             dtype="bfloat16", target="cpu")


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def compile_pair(model: Path, root: Path, scheme: str = "auto", kv_cache_dtype: str = "auto",
                 quantization: str = "fp8", kv_cache_scales: str = "auto", rounding: str = "nearest",
                 scale: str = "amax", refit_rounds: int = 0) -> tuple[Path, Path]:
    """The bf16 plan and the one under test (quantization, FP8 rounding / scale and KV cache dtype as given)."""
    bf16, fp8 = root / "bf16", root / "fp8"
    compile_plan(model, bf16, BuildConfig(**BUILD), force=True)
    t0 = time.time()
    fp8_opts = dict(fp8_rounding=rounding, fp8_scale=scale, fp8_refit_rounds=refit_rounds) \
        if quantization == "fp8" else {}
    compile_plan(model, fp8, BuildConfig(**BUILD, quantization=quantization, fp8_scheme=scheme,
                                         kv_cache_dtype=kv_cache_dtype, kv_cache_scales=kv_cache_scales, **fp8_opts),
                 force=True)
    print(f"plan under test ({quantization}, {scheme}, scale {scale}, rounding {rounding}, KV {kv_cache_dtype}) "
          f"compiled in {time.time() - t0:.1f} s", flush=True)
    return bf16, fp8


def run_batch(runner, prompts: list[list[int]], n_tokens: int, feed: list[list[int]] | None = None):
    """Greedy decoding of the prompts side by side (one sequence each), or with `feed` the given tokens fed
    instead of the sampled ones (teacher forcing). Returns (tokens, logits) per prompt: n_tokens of each."""
    runner.reset_kv()
    s = Session(runner, num_seqs=len(prompts))
    first = [s.prefill(k, p) for k, p in enumerate(prompts)]
    tokens, logits = [[t] for t, _ in first], [[lg] for _, lg in first]
    for i in range(1, n_tokens):
        nxt = {k: [feed[k][i - 1] if feed else tokens[k][-1]] for k in range(len(prompts))}
        ids, lg = s.step(nxt)
        for k in range(len(prompts)):
            tokens[k].append(int(ids[k]))
            logits[k].append(lg[k])
    return tokens, logits


def measure(bf16_plan: Path, fp8_plan: Path, prompts: list[str], n_tokens: int, batch: int = 4) -> dict:
    from xserv_aot.plan.manifest import Plan
    tok = Tokenizer.from_dir(bf16_plan)
    r16, r8 = NumpyRunner(Plan.load(bf16_plan)), NumpyRunner(Plan.load(fp8_plan))
    rows = []
    for lo in range(0, len(prompts), batch):
        ids = [tok.encode(t) for t in prompts[lo:lo + batch]]
        ref_tokens, ref_logits = run_batch(r16, ids, n_tokens)
        _, got = run_batch(r8, ids, n_tokens, feed=ref_tokens)
        free, _ = run_batch(r8, ids, n_tokens)
        for k in range(len(ids)):
            e = [rel_err(g, r) for g, r in zip(got[k], ref_logits[k])]
            a = [int(np.argmax(g)) == t for g, t in zip(got[k], ref_tokens[k])]
            same = [x == y for x, y in zip(free[k], ref_tokens[k])]
            rows.append({"prompt_tokens": len(ids[k]), "errs": e, "agree": a, "same": same,
                         "prefix_equal": same.index(False) if False in same else len(same)})
    errs = [e for r in rows for e in r["errs"]]
    n = len(errs)
    return {"steps": n, "mean_err": float(np.mean(errs)), "p95_err": float(np.percentile(errs, 95)),
            "max_err": float(np.max(errs)), "argmax_agree": sum(sum(r["agree"]) for r in rows) / n,
            "free_running_same": sum(sum(r["same"]) for r in rows) / n,
            "per_prompt": [{"prompt_tokens": r["prompt_tokens"], "mean_err": float(np.mean(r["errs"])),
                            "max_err": float(np.max(r["errs"])), "argmax_agree": float(np.mean(r["agree"])),
                            "free_running_same": float(np.mean(r["same"])), "prefix_equal": r["prefix_equal"]}
                           for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="checkpoint (HF dir or .gguf) to compile bf16 and fp8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--dev", action="store_true", help="measure on DEV_PROMPTS (choosing settings), not PROMPTS")
    ap.add_argument("--scheme", default="auto", help="--fp8-scheme of the FP8 plan: channel | block128 | auto")
    ap.add_argument("--quantization", default="fp8", help="weights of the plan under test: fp8 | none (bf16)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="KV cache of the plan under test: auto | fp8_e4m3")
    ap.add_argument("--kv-cache-scales", default="auto", help="fp8_e4m3 KV scales: auto | calibrate")
    ap.add_argument("--rounding", default="nearest", help="--fp8-rounding of the FP8 plan: nearest | gptq")
    ap.add_argument("--scale", default="amax", help="--fp8-scale of the FP8 plan: amax | mse | refit")
    ap.add_argument("--refit-rounds", type=int, default=0, help="--fp8-refit-rounds of --scale refit (0: default)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        bf16, fp8 = compile_pair(args.model, Path(tmp), args.scheme, args.kv_cache_dtype, args.quantization,
                                 args.kv_cache_scales, args.rounding, args.scale, args.refit_rounds)
        res = measure(bf16, fp8, (DEV_PROMPTS if args.dev else PROMPTS)[:args.prompts], args.tokens)
    res["seconds"] = round(time.time() - t0, 1)
    for i, row in enumerate(res["per_prompt"]):
        print(f"prompt {i:>2} ({row['prompt_tokens']:>3} tokens): err mean {row['mean_err']:.4f} max "
              f"{row['max_err']:.4f}  argmax agree {row['argmax_agree']:.3f}  free-running same "
              f"{row['free_running_same']:.3f} (equal prefix {row['prefix_equal']})")
    print(f"{res['steps']} steps: logits rel err mean {res['mean_err']:.4f} p95 {res['p95_err']:.4f} max "
          f"{res['max_err']:.4f}; argmax agreement (teacher-forced) {res['argmax_agree']:.3f}; free-running "
          f"tokens equal {res['free_running_same']:.3f}; {res['seconds']} s")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

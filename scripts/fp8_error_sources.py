"""Where the FP8 weights' logits error comes from: a plain NumPy forward (float32 activations, the ops of the NumPy
backend) of the model with bf16 weights against the same model with some weights FP8, teacher-forced over
held-out texts (DEV_TEXTS: neither scripts/fp8_accuracy.py's prompts nor the calibration texts).

Variants: every linear round-to-nearest (RTN) per channel; one linear type at a time; one layer at a time; the
W8A8 activations (every linear input quantized per token); an MSE-clipped per-channel scale; the compile's
calibrated weights (fp8_rounding "gptq" or "nearest" with fp8_scale amax, mse or refit, calibrated on
plan/calibration_text.py). --dev-docs adds the first long prose paragraphs of README.md and docs/architecture.md
(each cut to 200 tokens) to the held-out texts.

    python scripts/fp8_error_sources.py build/assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf [--layers]
    python scripts/fp8_error_sources.py MODEL --only gptq --roundings gptq,nearest --gptq-scales refit --dev-docs
"""
from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xserv_aot import fp8  # noqa: E402
from xserv_aot.checkpoint import open_checkpoint  # noqa: E402
from xserv_aot.dtypes import round_to  # noqa: E402
from xserv_aot.plan import calibration_text, fp8_calibrate, quantize  # noqa: E402
from xserv_aot.plan.weights import plan_tensors, rope_tables  # noqa: E402
from xserv_aot.runtime import numpy_ops as ops  # noqa: E402
from xserv_aot.tokenizer import Tokenizer  # noqa: E402

DEV_TEXTS = (
    "The lighthouse keeper kept a log of every ship that passed, the wind, the height of the waves and the colour "
    "of the sky at dusk. Over thirty winters the pages filled four shelves, and when the light was automated a "
    "historian from the university asked to borrow them. She found that the storms had grown no stronger, but "
    "that the ships had grown much larger and far fewer.",
    "def count_words(path):\n    counts = {}\n    with open(path, encoding='utf-8') as f:\n        for line in f:\n"
    "            for word in line.lower().split():\n                word = word.strip('.,;:!?\"()')\n"
    "                if word:\n                    counts[word] = counts.get(word, 0) + 1\n"
    "    return sorted(counts.items(), key=lambda kv: -kv[1])\n",
    "Student: Why does the moon look bigger near the horizon?\nTeacher: It is not bigger; a photograph shows the "
    "same size at the horizon and overhead. The effect happens in the brain, which judges distant objects near "
    "the ground against trees and buildings, and seems to treat the sky as a flattened dome.",
)


def load(model: Path):
    m, source, fmt = open_checkpoint(model)
    w = {name: arr for name, arr, _ in plan_tensors(m, source, 2)}
    tok = Tokenizer.from_gguf(model) if fmt == "gguf" else Tokenizer.from_dir(model)
    return m, w, tok


def forward(m, w, tokens, linear_weight, start=0, xs=None, keep=False):
    """Logits of every position; linear_weight(layer, kind, W, inputs) gives each linear's weight. keep: also
    the hidden states entering each layer."""
    cos, sin = rope_tables(m, max(len(t) for t in tokens))
    bf = {k: round_to(v, "bfloat16") for k, v in w.items() if not quantize.is_linear(k)}
    xs = xs if xs is not None else [ops.embedding(np.asarray(t), bf["embed_tokens"]) for t in tokens]
    kept = []
    for li in range(start, m.num_layers):
        kept.append(xs)
        lw = {k.split(".")[2]: v for k, v in bf.items() if k.startswith(f"layers.{li}.")}
        lw.update({kind: w[f"layers.{li}.{kind}"] for kind in quantize.LINEARS})
        xs = fp8_calibrate.layer_forward(m, lw, xs, cos, sin, lambda kind, a, inp: linear_weight(li, kind, a, inp))
    head = bf.get("lm_head", bf["embed_tokens"])
    logits = [ops.linear(ops.rmsnorm(x, bf["final_norm"], m.rms_norm_eps), head) for x in xs]
    return (logits, kept) if keep else logits


def rtn(a, scheme=fp8.CHANNEL, scale=None):
    return fp8.dequantize(*fp8.quantize_weight(a, scheme, scale), scheme)


def stats(got, ref):
    e = np.concatenate([np.linalg.norm(g - r, axis=1) / np.linalg.norm(r, axis=1) for g, r in zip(got, ref)])
    agree = np.concatenate([g.argmax(1) == r.argmax(1) for g, r in zip(got, ref)])
    return f"err mean {e.mean():.4f} p95 {np.percentile(e, 95):.4f} max {e.max():.4f} argmax {agree.mean():.3f}"


def w8a8_ops():
    """numpy_ops with every linear's input quantized per token (the W8A8 prefill's activations, channel scheme)."""
    def linear(x, wt, b=None):
        xq, xs = fp8.quantize_rows(x, x.shape[1])
        return ops.linear(xq * xs, wt, b)
    return types.SimpleNamespace(**{**{k: getattr(ops, k) for k in dir(ops) if not k.startswith("__")},
                                    "linear": linear})


def dev_docs(tok, root=Path(__file__).resolve().parents[1], per_file=3, cut=200):
    """Token ids of the first long prose paragraphs (no table, no code) of README.md and docs/architecture.md."""
    out = []
    for f in ("README.md", "docs/architecture.md"):
        paras = [p for p in (root / f).read_text().split("\n\n") if len(p) > 400 and "|" not in p and "```" not in p]
        out += [tok.encode(p)[:cut] for p in paras[:per_file]]
    return out


def gptq_weights(m, w, tok, scale_rule, damp, rounding="gptq", rounds=0):
    schemes = {f"layers.{li}.{kind}": fp8.CHANNEL for li in range(m.num_layers) for kind in quantize.LINEARS}
    tokens = [tok.encode(t) for t in calibration_text.TEXTS]
    out, t0 = {}, time.time()
    stream = fp8_calibrate.calibrated_stream(((k, v, False) for k, v in w.items()), m, schemes, tokens, scale_rule,
                                             damp, rounding, rounds)
    for name, arr, _ in stream:
        out[name] = arr
    print(f"{rounding} ({scale_rule} scale, damp {damp}): {sum(map(len, tokens))} calibration tokens, "
          f"{time.time() - t0:.1f} s")
    return {k: fp8.dequantize(out[k], out[k + ".scale"], fp8.CHANNEL) for k in schemes}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--layers", action="store_true", help="also one layer at a time (slow)")
    ap.add_argument("--only", choices=["gptq"], help="only the GPTQ variants")
    ap.add_argument("--gptq-scales", default="amax,mse", help="fp8_scale rules of the GPTQ variants")
    ap.add_argument("--damp", type=float, default=0.01, help="GPTQ damping (fraction of the mean diag(H))")
    ap.add_argument("--roundings", default="gptq", help="fp8_rounding of the calibrated variants: gptq,nearest")
    ap.add_argument("--refit-rounds", type=int, default=0, help="refits per weight of fp8_scale refit (0: default)")
    ap.add_argument("--dev-docs", action="store_true", help="more held-out text: README / architecture paragraphs")
    args = ap.parse_args()
    m, w, tok = load(args.model)
    tokens = [tok.encode(t) for t in DEV_TEXTS] if not args.dev_docs else \
        [tok.encode(t)[:200] for t in DEV_TEXTS] + dev_docs(tok)
    print(f"{sum(map(len, tokens))} dev tokens in {len(tokens)} texts")
    bf = {k: round_to(v, "bfloat16") for k, v in w.items()}
    ref, kept = forward(m, w, tokens, lambda li, kind, a, inp: bf[f"layers.{li}.{kind}"], keep=True)
    f32 = forward(m, w, tokens, lambda li, kind, a, inp: a)
    print(f"float32 weights        {stats(f32, ref)}")
    q = {k: rtn(w[k]) for k in w if quantize.is_linear(k) and k != "lm_head"}
    got = forward(m, w, tokens, lambda li, kind, a, inp: q[f"layers.{li}.{kind}"])
    print(f"RTN all                {stats(got, ref)}")
    if not args.only:
        for only in quantize.LINEARS:
            got = forward(m, w, tokens, lambda li, kind, a, inp: (q if kind == only else bf)[f"layers.{li}.{kind}"])
            print(f"RTN {only:<18} {stats(got, ref)}")
        real = fp8_calibrate.ops
        fp8_calibrate.ops = w8a8_ops()
        got = forward(m, w, tokens, lambda li, kind, a, inp: q[f"layers.{li}.{kind}"])
        fp8_calibrate.ops = real
        print(f"RTN all + W8A8 acts    {stats(got, ref)}")
        mq = {k: rtn(w[k], scale=fp8.mse_scale(w[k], fp8.CHANNEL)) for k in q}
        got = forward(m, w, tokens, lambda li, kind, a, inp: mq[f"layers.{li}.{kind}"])
        print(f"MSE scale all          {stats(got, ref)}")
    for rounding in args.roundings.split(","):
        for rule in args.gptq_scales.split(","):
            g = gptq_weights(m, w, tok, rule, args.damp, rounding, args.refit_rounds)
            got = forward(m, w, tokens, lambda li, kind, a, inp: g[f"layers.{li}.{kind}"])
            print(f"{rounding} all, {rule} scale {stats(got, ref)}")
    if args.layers:
        for layer in range(m.num_layers):
            got = forward(m, w, tokens, lambda li, kind, a, inp: (q if li == layer else bf)[f"layers.{li}.{kind}"],
                          start=layer, xs=kept[layer])
            print(f"RTN layer {layer:<12} {stats(got, ref)}")


if __name__ == "__main__":
    main()

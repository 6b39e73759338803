"""Compile-time FP8 weights calibrated on text (build settings fp8_rounding "gptq", fp8_scale "refit";
docs/plan-format.md "FP8").

The float32 model runs on the calibration texts (plan/calibration_text.py) one layer at a time with the NumPy
backend's ops, each linear's input taken from the model as quantized so far (sequential GPTQ: a layer sees the
already rounded earlier layers and, inside the layer, qkv -> o_proj -> gate_up -> down in order). Each FP8 linear's
Hessian X^T X of those inputs drives plan/gptq.py (rounding "gptq"; "nearest" rounds each value alone); its scales
are chosen before as without calibration (fp8_scale amax or mse), or with fp8_scale "refit" start at amax and are
then refitted to the rounded values by least squares on the same Hessian (plan/scale_refit.py), refit_rounds times,
rounding again at each new scale between two refits. The plan's formats are the same in every case.
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from xserv_aot import fp8
from xserv_aot.config import ConfigError
from xserv_aot.model_config import ModelConfig
from xserv_aot.plan import calibration_text, gptq
from xserv_aot.plan.quantize import weight_scale
from xserv_aot.plan.scale_refit import refit_scales
from xserv_aot.plan.weights import rope_tables
from xserv_aot.runtime import numpy_ops as ops

Stream = Iterator[tuple[str, np.ndarray, bool]]
Rounder = Callable[[str, np.ndarray, list[np.ndarray]], np.ndarray]   # (name, W, inputs) -> W as the plan holds it
REFIT_ROUNDS = {"nearest": 4, "gptq": 1}   # refits per weight, a rounding at the new scale between two (chosen on
                                           # held-out texts: docs/benchmarks/2026-12-01-fp8-accuracy-s7-cpu.md)


def refit_rounds(rounding: str, scale_rule: str, asked: int = 0) -> int:
    """Refits per weight: none without fp8_scale refit, else `asked` (build setting fp8_refit_rounds) or the
    rounding's REFIT_ROUNDS."""
    return 0 if scale_rule != "refit" else asked or REFIT_ROUNDS[rounding]


def needs_calibration(rounding: str, scale_rule: str) -> bool:
    return rounding == "gptq" or scale_rule == "refit"


def setting(rounding: str, scale_rule: str) -> str:
    """The build setting that asks for calibration, for refusals."""
    return "fp8_rounding gptq" if rounding == "gptq" else f"fp8_scale {scale_rule}"


def check_calibratable(source, stored: dict, dummy: bool, what: str) -> None:
    """One line when calibration (`what`: the setting asking for it) cannot run: no weights, or weights that
    already are FP8."""
    if dummy:
        raise ConfigError(f"{what} calibrates real weights; --dummy-weights has none (use fp8_rounding nearest and "
                          f"fp8_scale amax)")
    if stored:
        raise ConfigError(f"{what} calibrates float weights; {source} already stores {len(stored)} FP8 weights "
                          f"(compile it with fp8_rounding nearest and fp8_scale amax)")


def calibration_tokens(source, tokenizer, what: str) -> list[list[int]]:
    """The calibration texts as token ids of the checkpoint's tokenizer (None: refused in one line)."""
    if tokenizer is None:
        raise ConfigError(f"{what} needs the model's tokenizer for its calibration texts; {source} has no "
                          f"tokenizer.json")
    return [tokenizer.encode(t) for t in calibration_text.TEXTS]


def rounding_record(tokens: list[list[int]] | None, rounding: str = "nearest", scale_rule: str = "amax",
                    rounds: int = 0) -> dict:
    """The manifest's quantization.rounding: nearest, or gptq with its settings; with calibration its set, and
    with fp8_scale refit the refits per weight."""
    if not tokens:
        return {"method": "nearest"}
    out = {"method": "gptq", "damp": gptq.DAMP, "block": gptq.BLOCK, "act_order": True} if rounding == "gptq" \
        else {"method": "nearest"}
    if scale_rule == "refit":
        out["refit"] = {"rounds": refit_rounds(rounding, scale_rule, rounds)}
    return {**out, "sequential": True, "calibration": {"texts": len(tokens), "tokens": sum(map(len, tokens)),
                                                       "sha256": calibration_text.digest()}}


def hessian(xs: list[np.ndarray]) -> np.ndarray:
    """sum_i X_i^T X_i in float64 over the calibration sequences' inputs X_i [T_i, K]."""
    k = xs[0].shape[1]
    h = np.zeros((k, k), dtype=np.float64)
    for x in xs:
        h += (x.T @ x).astype(np.float64)
    return h


def calibrated_rounder(schemes: dict[str, str], scale_rule: str, rounding: str = "gptq", damp: float = gptq.DAMP,
                       rounds: int = 0) -> tuple[Rounder, dict]:
    """A Rounder that rounds the weights named in schemes (GPTQ or nearest) at the scales of
    quantize.weight_scale, refitted with fp8_scale refit (and keeps the rest); the dict collects those quantized
    values and scales by name for the stream."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def rounder(name: str, w: np.ndarray, xs: list[np.ndarray]) -> np.ndarray:
        if name not in schemes:
            return w
        scheme, h = schemes[name], hessian(xs)

        def rounded(s):
            if rounding == "gptq":
                return gptq.gptq_round(w, fp8.expand_scale(s, scheme, *w.shape), h, damp)
            return fp8.quantize_weight(w, scheme, s)[0]
        s = weight_scale(w, scheme, "amax" if scale_rule == "refit" else scale_rule)
        q = rounded(s)
        n = refit_rounds(rounding, scale_rule, rounds)
        for i in range(n):
            s = refit_scales(w, q, h, scheme, s)
            if i < n - 1:
                q = rounded(s)
        out[name] = (q, s)
        return fp8.dequantize(q, s, scheme)
    return rounder, out


def layer_forward(m: ModelConfig, lw: dict[str, np.ndarray], xs: list[np.ndarray], cos: np.ndarray, sin: np.ndarray,
                  rounder: Rounder) -> list[np.ndarray]:
    """One decoder layer over every sequence's hidden states [T, H] (causal, positions from 0); each linear's weight
    is first passed through rounder with its inputs. Returns the layer's outputs."""
    normed = [ops.rmsnorm(x, lw["input_norm"], m.rms_norm_eps) for x in xs]
    w = rounder("qkv", lw["qkv"], normed)
    attn = [attend(m, ops.linear(h, w, lw.get("qkv_bias")), lw.get("q_norm"), lw.get("k_norm"), cos, sin)
            for h in normed]
    w = rounder("o_proj", lw["o_proj"], attn)
    xs = [x + ops.linear(a, w) for x, a in zip(xs, attn)]
    normed = [ops.rmsnorm(x, lw["post_attn_norm"], m.rms_norm_eps) for x in xs]
    w = rounder("gate_up", lw["gate_up"], normed)
    act = [ops.silu_mul(ops.linear(h, w)) for h in normed]
    w = rounder("down", lw["down"], act)
    return [x + ops.linear(a, w) for x, a in zip(xs, act)]


def attend(m: ModelConfig, qkv: np.ndarray, q_norm, k_norm, cos, sin) -> np.ndarray:
    """Causal self-attention of one sequence [T, ...] with its own KV (one block of T slots)."""
    t = qkv.shape[0]
    kv = np.zeros((2, t, m.num_kv_heads, m.head_dim), dtype=np.float32)
    pos = np.arange(t)
    q = ops.qk_norm_rope_cache(qkv, pos, pos, q_norm, k_norm, cos, sin, kv, m.num_heads, m.num_kv_heads,
                               m.head_dim, m.rms_norm_eps)
    return ops.attention(q, kv, [0, t], [t], [[0]], t, m.head_dim ** -0.5)


def layer_of(name: str) -> tuple[int, str] | None:
    parts = name.split(".")
    return (int(parts[1]), parts[2]) if parts[0] == "layers" else None


def calibrated_stream(tensors: Stream, m: ModelConfig, schemes: dict[str, str], tokens: list[list[int]],
                      scale_rule: str = "amax", damp: float = gptq.DAMP, rounding: str = "gptq", rounds: int = 0
                      ) -> Stream:
    """quantize.quantized_stream's output (same names, order and formats) for a float32 checkpoint stream, the
    FP8 weights rounded (GPTQ or nearest) and scaled (refit) on the calibration token sequences, layer after
    layer."""
    cos, sin = rope_tables(m, max(len(t) for t in tokens))
    rounder, done = calibrated_rounder(schemes, scale_rule, rounding, damp, rounds)
    xs, layer, embedding, head_inputs = [], {}, None, []

    def emit(name, arr, is_rope):
        if name in done:
            q, s = done.pop(name)
            yield name, q, False
            yield name + ".scale", s, True
        else:
            yield name, arr, is_rope

    for name, arr, is_rope in tensors:
        where = layer_of(name)
        if where is not None:
            layer[where[1]] = (name, arr)
            if where[1] == "down":                   # the last weight of a layer in plan order
                prefix = f"layers.{where[0]}."
                xs = layer_forward(m, {k: a for k, (_, a) in layer.items()}, xs, cos, sin,
                                   lambda kind, w, inp: rounder(prefix + kind, w, inp))
                for full, a in layer.values():
                    yield from emit(full, a, False)
                layer = {}
            continue
        if name == "embed_tokens":
            embedding, xs = arr, [ops.embedding(np.asarray(t), arr) for t in tokens]
        if name == "final_norm":
            head_inputs = [ops.rmsnorm(x, arr, m.rms_norm_eps) for x in xs]
        if name == "lm_head":
            rounder(name, arr, head_inputs)
        yield from emit(name, arr, is_rope)
        if name == "final_norm" and m.tie_word_embeddings and "lm_head" in schemes:
            rounder("lm_head", embedding, head_inputs)
            yield from emit("lm_head", embedding, False)

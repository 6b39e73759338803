"""Compile-time FP8 (docs/plan-format.md "FP8"): which plan weights are FP8 and with which scheme, every plan
tensor's dtype, and the weight stream with FP8 weights and their `<name>.scale` tensors in place.

Scheme choice ("auto"): fp8_block128 where both N and K divide by 128, else fp8_channel. Block scales follow the
magnitude of each 128 x 128 tile (a smaller error than one scale per row of 4096+ inputs), match Qwen's published
FP8 checkpoints (a plan quantized here runs as theirs does), and whole tiles keep the W8A8 activation groups of 128
aligned with the weight tiles; per-channel is the fallback for shapes such as SmolLM2's 576 that do not tile.
"""
from __future__ import annotations

import re
from typing import Iterator

import numpy as np

from xserv_aot import fp8
from xserv_aot.config import BuildConfig, ConfigError
from xserv_aot.model_config import ModelConfig
from xserv_aot.dtypes import FP8
from xserv_aot.plan.weights import weight_specs

LINEARS = ("qkv", "o_proj", "gate_up", "down")
FP8_MIN_SM = 89                      # FP8 tensor cores: Ada (sm_89) and Hopper (sm_90) onwards


def scale_name(weight: str) -> str:
    return weight + ".scale"


def auto_scheme(n: int, k: int) -> str:
    return fp8.BLOCK128 if n % fp8.BLOCK == 0 and k % fp8.BLOCK == 0 else fp8.CHANNEL


def head_shape(m: ModelConfig) -> list[int]:
    return [m.vocab_size, m.hidden_size]


def weight_schemes(m: ModelConfig, b: BuildConfig, stored: dict[str, str] | None = None) -> dict[str, str]:
    """plan weight name -> FP8 scheme: `stored` (a pre-quantized checkpoint's FP8 weights) as they are, then, with
    quantization fp8, every other layer linear and (quantize_lm_head) the lm_head in b.fp8_scheme."""
    out = dict(stored or {})
    if b.quantization != "fp8":
        return out
    specs = weight_specs(m)
    names = [f"layers.{li}.{lin}" for li in range(m.num_layers) for lin in LINEARS]
    for name in names + (["lm_head"] if b.quantize_lm_head else []):
        if name not in out:
            n, k = specs[name][0] if name in specs else head_shape(m)
            out[name] = auto_scheme(n, k) if b.fp8_scheme == "auto" else f"fp8_{b.fp8_scheme}"
    return out


def check_target(target: str) -> None:
    """FP8 plans run only where FP8 tensor cores exist (or on the CPU); one line otherwise."""
    found = re.fullmatch(r"sm_(\d+)[a-z]?", target)
    if target != "cpu" and (found is None or int(found.group(1)) < FP8_MIN_SM):
        raise ConfigError(f"FP8 weights need FP8 tensor cores (sm_{FP8_MIN_SM} or newer); target {target} has none")


def tensor_table(m: ModelConfig, b: BuildConfig, schemes: dict[str, str]) -> dict[str, tuple[list[int], str]]:
    """(shape, dtype) of every unsharded plan weight in plan order (rope tables excluded): each FP8 weight followed
    by its scale; a tied model with an FP8 head gets its own lm_head after final_norm."""
    out: dict[str, tuple[list[int], str]] = {}
    specs = {name: shape for name, (shape, _) in weight_specs(m).items()}
    if "lm_head" in schemes and "lm_head" not in specs:
        specs["lm_head"] = head_shape(m)
    for name, shape in specs.items():
        if name in schemes:
            out[name] = (shape, FP8)
            out[scale_name(name)] = (fp8.weight_scale_shape(schemes[name], *shape), "float32")
        else:
            out[name] = (shape, b.dtype)
    return out


def weight_scale(w: np.ndarray, scheme: str, rule: str) -> np.ndarray:
    """The scales of an FP8 weight by build setting fp8_scale: amax (amax / 448 per row or block) or mse."""
    return fp8.mse_scale(w, scheme) if rule == "mse" else fp8.quantize_weight(w, scheme)[1]


def quantized_stream(tensors: Iterator[tuple[str, np.ndarray, bool]], schemes: dict[str, str], tied: bool,
                     stored_scales: dict[str, np.ndarray] | None = None, scale_rule: str = "amax"
                     ) -> Iterator[tuple[str, np.ndarray, bool]]:
    """The plan weight stream in tensor_table order: weights named in `schemes` as e4m3 values (float32 arrays)
    followed by their scales (scale_rule: weight_scale); with a scale in stored_scales the values already are e4m3
    (a pre-quantized checkpoint) and pass through. tied: the model ties its head, so an FP8 lm_head is quantized
    from embed_tokens."""
    stored_scales = stored_scales or {}
    embedding = None
    for name, arr, is_rope in tensors:
        if name not in schemes:
            yield name, arr, is_rope
        elif name in stored_scales:
            yield name, arr, False
            yield scale_name(name), stored_scales[name], True
        else:
            yield from _quantized(name, arr, schemes[name], scale_rule)
        if name == "embed_tokens":
            embedding = arr
        if name == "final_norm" and tied and "lm_head" in schemes:
            yield from _quantized("lm_head", embedding, schemes["lm_head"], scale_rule)


def _quantized(name: str, arr: np.ndarray, scheme: str, scale_rule: str) -> Iterator[tuple[str, np.ndarray, bool]]:
    q, s = fp8.quantize_weight(arr, scheme, weight_scale(arr, scheme, scale_rule))
    yield name, q, False
    yield scale_name(name), s, True


def is_linear(name: str) -> bool:
    """A plan weight that may be FP8: a layer linear or the lm_head."""
    return name == "lm_head" or name.rsplit(".", 1)[-1] in LINEARS


def manifest_section(schemes: dict[str, str], stored: dict, ignored: list[str], rounding: dict,
                     scale_rule: str) -> dict | None:
    """The manifest's `quantization` entry (None for a plan without FP8 weights): per weight its scheme and whether
    it came FP8 from the checkpoint or was quantized by the compile; the checkpoint's static input scales, dropped;
    how the compile chose the scales of its FP8 weights and rounded them (plan/fp8_calibrate.rounding_record)."""
    if not schemes:
        return None
    return {"method": "fp8", "lm_head": "lm_head" in schemes, "schemes": dict(schemes),
            "from_checkpoint": sorted(stored), "ignored_input_scales": len(ignored), "scale": scale_rule,
            "rounding": rounding}

"""The KV cache's element type and the per-layer scales of an FP8 KV cache (docs/plan-format.md "FP8 KV cache").

`kv_cache_dtype` fp8_e4m3: the pool holds e4m3fn bytes; layer l's keys read as float(k) * k_scale[l] and its values
as float(v) * v_scale[l] (float32). A written element is the value a bf16 plan's cache holds (the bf16 rounding of
k after norm and RoPE, v as the linear wrote it), divided by the layer's scale in float32 (IEEE division), rounded
to nearest even and saturated to +-448: what the kernels' cvt.rn.satfinite.e4m3x2.f32 does.
"""
from __future__ import annotations

import math
import re

import numpy as np

from xserv_aot.dtypes import FP8, FP8_MAX, ITEMSIZE, round_to, to_fp8

FP8_KV = "fp8_e4m3"           # the build setting's name for it; the plan dtype is dtypes.FP8 (float8_e4m3fn)
DEFAULT_SCALE = 1.0           # a layer's scale when the checkpoint carries none (vLLM's default too)
SCALE_SOURCES = ("checkpoint", "default", "calibrated")


def kv_dtype(build) -> str:
    """The plan dtype of the KV pool: build.dtype for auto, float8_e4m3fn for fp8_e4m3."""
    choice = build.kv_cache_dtype
    return build.dtype if choice == "auto" else FP8 if choice == FP8_KV else choice


def is_fp8(kv_cache: dict) -> bool:
    return kv_cache["dtype"] == FP8


def check_kv_build(build) -> None:
    """One line for a KV dtype / scale setting that is unknown or does not fit the build."""
    from xserv_aot.config import KV_CACHE_DTYPES, KV_CACHE_SCALES, ConfigError
    if build.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype {build.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if build.kv_cache_scales not in KV_CACHE_SCALES:
        raise ConfigError(f"kv_cache_scales {build.kv_cache_scales!r} is not one of {', '.join(KV_CACHE_SCALES)}")
    if build.kv_cache_dtype not in ("auto", FP8_KV, build.dtype):
        raise ConfigError(f"kv_cache_dtype {build.kv_cache_dtype} with dtype {build.dtype}: the KV cache is either "
                          f"the build dtype (auto) or fp8_e4m3")
    if build.kv_cache_dtype == FP8_KV:
        from xserv_aot.plan.quantize import FP8_MIN_SM
        found = re.fullmatch(r"sm_(\d+)[a-z]?", build.target)
        if build.target != "cpu" and (found is None or int(found.group(1)) < FP8_MIN_SM):
            raise ConfigError(f"an fp8_e4m3 KV cache needs FP8 support (sm_{FP8_MIN_SM} or newer); target "
                              f"{build.target} has none")
    elif build.kv_cache_scales != "auto":
        raise ConfigError(f"kv_cache_scales {build.kv_cache_scales} needs kv_cache_dtype fp8_e4m3")


def pool_bytes(shape: list[int], dtype: str) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def bytes_per_token(kv_cache: dict) -> int:
    """KV bytes one token takes over every layer (K and V; one rank's heads)."""
    layers, _, _, _, heads, hd = kv_cache["shape"]
    return layers * 2 * heads * hd * ITEMSIZE[kv_cache["dtype"]]


def quantize(x: np.ndarray, scale: float) -> np.ndarray:
    """float32 values -> e4m3 values (as float32) of x / scale: float32 division, RNE, saturating to +-448."""
    q = np.asarray(x, dtype=np.float32) / np.float32(scale)
    return to_fp8(np.clip(q, -FP8_MAX, FP8_MAX)).astype(np.float32)


def stored(x: np.ndarray, build_dtype: str, scale: float) -> np.ndarray:
    """What a KV read returns for a written float32 value x: float(e4m3(round(x) / scale)) * scale, float32."""
    return quantize(round_to(x, build_dtype), scale) * np.float32(scale)


def scales_section(k: list[float], v: list[float], source: str) -> dict:
    assert source in SCALE_SOURCES
    return {"k": [float(np.float32(s)) for s in k], "v": [float(np.float32(s)) for s in v], "source": source}


def check_scales(kv: dict, num_layers: int) -> None:
    """An FP8 pool's `scales` entry: one finite positive float32 k and v scale a layer."""
    from xserv_aot.plan.integrity import PlanError
    sc = kv.get("scales")
    if not is_fp8(kv):
        if sc is not None:
            raise PlanError(f"kv_cache: scales given for a {kv['dtype']} pool")
        return
    if not isinstance(sc, dict) or sc.get("source") not in SCALE_SOURCES:
        raise PlanError("kv_cache: an fp8 pool needs scales {k, v, source}")
    for part in ("k", "v"):
        vals = sc.get(part)
        if not isinstance(vals, list) or len(vals) != num_layers or not all(
                isinstance(s, float) and math.isfinite(s) and s > 0 for s in vals):
            raise PlanError(f"kv_cache: scales.{part} must be {num_layers} finite positive floats")


def layer_scales(kv: dict, layer: int) -> tuple[float, float]:
    """(k_scale, v_scale) of a layer of an FP8 pool, as float32 values."""
    sc = kv["scales"]
    return float(np.float32(sc["k"][layer])), float(np.float32(sc["v"][layer]))

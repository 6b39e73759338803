"""Pre-quantized FP8 safetensors checkpoints, read from config.json's quantization_config:

- Qwen's Qwen3-*-FP8 (quant_method "fp8", weight_block_size [128, 128]): `X.weight` F8_E4M3 with
  `X.weight_scale_inv` [ceil(N/128), ceil(K/128)]; despite the name W_real = W * weight_scale_inv (DeepSeek-V3's
  convention). quant_method "fp8" without weight_block_size: per-tensor `X.weight_scale` (+ `X.input_scale`).
- llm-compressor / compressed-tensors ("float-quantized", 8-bit float weights): `X.weight_scale` [N, 1] (strategy
  channel, "FP8 dynamic"), a scalar (strategy tensor, "FP8 static", with a scalar `X.input_scale`), or
  [ceil(N/128), ceil(K/128)] (strategy block, block_structure [128, 128]).

Per-tensor scales become per-channel ones (scheme fp8_channel). Static input scales are ignored: W8A8 linears
quantize activations per token with their own scales, at least as fine as one static scale; the manifest records
that they were dropped. Anything else (E5M2, zero points, other block shapes, KV-cache scales, an FP8 tensor that
is not a layer linear, a missing or misshapen scale) is refused in one line naming the tensor.
"""
from __future__ import annotations

import numpy as np

from xserv_aot import fp8
from xserv_aot.checkpoint import CheckpointError

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")
FP8_DTYPE = "F8_E4M3"


def layout_of(qcfg: dict) -> tuple[str, set[str]]:
    """(scale tensor suffix, allowed strategies among channel / tensor / block) of a quantization_config."""
    method = qcfg.get("quant_method")
    if method == "fp8":
        if qcfg.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"quantization_config: FP8 format {qcfg.get('fmt')!r} is not supported (e4m3 only)")
        block = qcfg.get("weight_block_size")
        if block is None:
            return ".weight_scale", {"tensor"}
        if list(block) != [fp8.BLOCK, fp8.BLOCK]:
            raise CheckpointError(f"quantization_config: weight_block_size {block} is not supported ([128, 128] only)")
        return ".weight_scale_inv", {"block"}
    if method == "compressed-tensors":
        if qcfg.get("kv_cache_scheme"):
            raise CheckpointError("quantization_config: kv_cache_scheme (FP8 KV-cache scales) is not supported")
        strategies = set()
        for name, group in (qcfg.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            fmt = group.get("format") or qcfg.get("format")
            if (w.get("num_bits"), w.get("type"), fmt) != (8, "float", "float-quantized"):
                raise CheckpointError(f"quantization_config group {name}: only 8-bit float weights "
                                      f"(float-quantized) are supported, got {w.get('num_bits')}-bit "
                                      f"{w.get('type')} {fmt}")
            if w.get("symmetric") is False:
                raise CheckpointError(f"quantization_config group {name}: asymmetric (zero-point) FP8 weights "
                                      f"are not supported")
            strategy = w.get("strategy")
            if strategy == "block" and list(w.get("block_structure") or []) != [fp8.BLOCK, fp8.BLOCK]:
                raise CheckpointError(f"quantization_config group {name}: block_structure "
                                      f"{w.get('block_structure')} is not supported ([128, 128] only)")
            if strategy not in ("channel", "tensor", "block"):
                raise CheckpointError(f"quantization_config group {name}: weight strategy {strategy!r} is not "
                                      f"supported (channel, tensor, block)")
            strategies.add(strategy)
        if not strategies:
            raise CheckpointError("quantization_config: compressed-tensors config without config_groups")
        return ".weight_scale", strategies
    raise CheckpointError(f"quantization_config: quant_method {method!r} is not supported (fp8, compressed-tensors)")


class Fp8Checkpoint:
    """A TensorSource whose FP8 weights read as their e4m3 values (float32, not dequantized); the scale tensors are
    taken out of names() and handed to the plan by plan_fp8."""

    def __init__(self, source, qcfg: dict):
        self.source = source
        self.suffix, self.strategies = layout_of(qcfg)
        all_names = source.names()
        self.ignored_inputs = sorted(n for n in all_names if n.endswith(".input_scale"))
        self._names = [n for n in all_names if not n.endswith(SCALE_SUFFIXES)]
        scales = {n for n in all_names if n.endswith(SCALE_SUFFIXES) and not n.endswith(".input_scale")}
        self.fp8 = {n for n in self._names if source.dtype(n) == FP8_DTYPE}
        for n in self._names:
            if source.dtype(n).startswith("F8") and n not in self.fp8:
                raise CheckpointError(f"checkpoint tensor {n}: dtype {source.dtype(n)} is not supported "
                                      f"(FP8 weights must be {FP8_DTYPE})")
        for n in sorted(scales):
            if n.endswith(self.suffix) and n[:-len(self.suffix)] + ".weight" in self.fp8:
                continue
            raise CheckpointError(f"checkpoint tensor {n}: a scale this FP8 layout ({self.suffix}) does not use, "
                                  f"or of no FP8 weight")

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(name)

    def get(self, name: str) -> np.ndarray:
        return self.source.get(name)

    def scale(self, name: str) -> tuple[str, np.ndarray]:
        """(scheme, scales in that scheme's layout) of FP8 weight `name` (an HF name)."""
        sname = name[:-len(".weight")] + self.suffix
        if sname not in self.source.names():
            raise CheckpointError(f"checkpoint tensor {name}: FP8 weight without its scale {sname}")
        n, k = self.source.shape(name)
        s = np.asarray(self.source.get(sname), dtype=np.float32)
        if not np.isfinite(s).all() or (s <= 0).any():
            raise CheckpointError(f"checkpoint tensor {sname}: scales must be finite and positive")
        block = [fp8.groups(n, fp8.BLOCK), fp8.groups(k, fp8.BLOCK)]
        if "block" in self.strategies and list(s.shape) == block:
            return fp8.BLOCK128, s
        if "channel" in self.strategies and list(s.shape) in ([n, 1], [n]):
            return fp8.CHANNEL, s.reshape(n)
        if "tensor" in self.strategies and s.size == 1 and s.ndim <= 1:
            return fp8.CHANNEL, np.full(n, s.reshape(()), dtype=np.float32)
        raise CheckpointError(f"checkpoint tensor {sname}: shape {list(s.shape)} fits none of this checkpoint's "
                              f"FP8 strategies ({', '.join(sorted(self.strategies))}) for weight [{n}, {k}]")

    def plan_fp8(self, specs: dict[str, tuple[list[int], list[str]]]) -> tuple[dict[str, str], dict[str, np.ndarray]]:
        """(plan name -> scheme, plan name -> scales) for the plan weights made of FP8 checkpoint tensors; the
        parts of a concatenated weight (qkv, gate_up) concatenate their scales along N. specs: the plan's linears
        (weights.weight_specs entries); an FP8 tensor feeding none of them is refused."""
        schemes, scales, covered = {}, {}, set()
        for plan_name, (_, parts) in specs.items():
            fp8_parts = [p for p in parts if p in self.fp8]
            if not fp8_parts:
                continue
            if len(fp8_parts) != len(parts) or len(self.source.shape(parts[0])) != 2:
                other = next((p for p in parts if p not in self.fp8), parts[0])
                raise CheckpointError(f"checkpoint tensor {other}: plan weight {plan_name} mixes FP8 and "
                                      f"non-FP8 parts, or is not a matrix")
            got = [self.scale(p) for p in parts]
            kinds = {scheme for scheme, _ in got}
            if len(kinds) != 1:
                raise CheckpointError(f"checkpoint tensor {parts[0]}: the parts of {plan_name} "
                                      f"({', '.join(parts)}) have different FP8 scale layouts")
            scheme = kinds.pop()
            if scheme == fp8.BLOCK128 and len(parts) > 1:
                for p in parts:
                    if self.source.shape(p)[0] % fp8.BLOCK:
                        raise CheckpointError(f"checkpoint tensor {p}: {self.source.shape(p)[0]} rows, not a "
                                              f"multiple of 128, so its block scales cannot join {plan_name}'s")
            schemes[plan_name] = scheme
            scales[plan_name] = np.concatenate([s for _, s in got], axis=0)
            covered.update(parts)
        for n in sorted(self.fp8 - covered):
            raise CheckpointError(f"checkpoint tensor {n}: FP8, but not a layer linear the plan keeps in FP8")
        return schemes, scales

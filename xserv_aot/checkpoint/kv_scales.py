"""Per-layer KV cache scales a checkpoint carries, in the names llm-compressor and vLLM write: scalar
`model.layers.L.self_attn.k_scale` / `.v_scale`, the older single `.self_attn.kv_scale` (both), or
`.self_attn.k_proj.output_scale` / `.v_proj.output_scale`. They are taken out of the tensors the model reads and
become the plan's FP8 KV scales (dequant = float(e4m3) * scale); a bf16 KV cache ignores them."""
from __future__ import annotations

import math
import re

from xserv_aot.checkpoint import CheckpointError

PATTERN = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
                     r"v_proj\.output_scale)")
PARTS = {"k_scale": "k", "k_proj.output_scale": "k", "v_scale": "v", "v_proj.output_scale": "v", "kv_scale": "kv"}


class KvScaleSource:
    """A TensorSource without its KV scale tensors; kv_scales() reads them. Everything else is the source's."""

    def __init__(self, source):
        self.source = source
        self.scale_names = {n: PATTERN.fullmatch(n) for n in source.names() if PATTERN.fullmatch(n)}

    def names(self) -> list[str]:
        return [n for n in self.source.names() if n not in self.scale_names]

    def __getattr__(self, name):
        return getattr(self.source, name)

    def kv_scales(self, num_layers: int) -> tuple[list[float], list[float]] | None:
        """(k scales, v scales) a layer, or None when the checkpoint has none; a layer without one, a layer past
        the model's, or a scale that is not one finite positive number is refused naming the tensor."""
        if not self.scale_names:
            return None
        found: dict[tuple[int, str], float] = {}
        for name, m in sorted(self.scale_names.items()):
            layer = int(m.group(1))
            if layer >= num_layers:
                raise CheckpointError(f"checkpoint tensor {name}: layer {layer} of a {num_layers}-layer model")
            value = self.source.get(name)
            if value.size != 1 or not math.isfinite(float(value.reshape(-1)[0])) or float(value.reshape(-1)[0]) <= 0:
                raise CheckpointError(f"checkpoint tensor {name}: a KV scale must be one finite positive number")
            for part in ("k", "v") if PARTS[m.group(2)] == "kv" else (PARTS[m.group(2)],):
                found.setdefault((layer, part), float(value.reshape(-1)[0]))
        for layer in range(num_layers):
            for part in ("k", "v"):
                if (layer, part) not in found:
                    raise CheckpointError(f"checkpoint: layer {layer} has no {part}_scale while other layers have "
                                          f"KV scales (model.layers.{layer}.self_attn.{part}_scale)")
        return [found[(l, "k")] for l in range(num_layers)], [found[(l, "v")] for l in range(num_layers)]

"""Checkpoint readers: a HF model directory (safetensors) or a .gguf file, seen as float32 tensors with HF names."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from xserv_aot.model_config import ModelConfig
from xserv_aot.errors import XservError, one_line  # noqa: F401  (re-exported for the readers)


class CheckpointError(XservError, ValueError):
    """A checkpoint that cannot be read; the message is one line naming the file or tensor."""


class TensorSource(Protocol):
    def names(self) -> list[str]:
        """HF tensor names, e.g. model.layers.0.self_attn.q_proj.weight."""

    def shape(self, name: str) -> tuple[int, ...]:
        """HF layout shape ([out, in] for Linear)."""

    def get(self, name: str) -> np.ndarray:
        """The tensor as a fresh float32 array in HF layout."""


def open_checkpoint(path: Path) -> tuple[ModelConfig, TensorSource, str]:
    """(config, tensors, "safetensors" | "gguf") for a HF model directory or a .gguf file."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from xserv_aot.checkpoint.gguf_reader import GGUFCheckpoint

        source = GGUFCheckpoint(path)
        return source.config, source, "gguf"
    if path.is_dir():
        from xserv_aot.checkpoint.safetensors_reader import SafetensorsCheckpoint
        from xserv_aot.model_config import read_hf_config

        config = read_hf_config(path)
        source = SafetensorsCheckpoint(path)
        config.source_dtype = source.dtype_name() or config.source_dtype
        from xserv_aot.checkpoint.kv_scales import KvScaleSource
        return config, KvScaleSource(with_quantization(path, source)), "safetensors"
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    raise CheckpointError(f"{path}: expected a Hugging Face model directory or a .gguf file")


def with_quantization(model_dir: Path, source):
    """The source as its config.json's quantization_config says to read it (checkpoint/fp8_layouts.py); FP8
    tensors without one are refused."""
    import json

    from xserv_aot.checkpoint.fp8_layouts import Fp8Checkpoint
    qcfg = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    if qcfg is not None:
        return Fp8Checkpoint(source, qcfg)
    for name in source.names():
        if source.dtype(name).startswith("F8"):
            raise CheckpointError(f"checkpoint tensor {name}: {source.dtype(name)} but config.json has no "
                                  f"quantization_config to say how it is scaled")
    return source

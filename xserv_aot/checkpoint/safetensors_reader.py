"""safetensors reader (single file or sharded via model.safetensors.index.json), memory-mapped, any float dtype -> float32.

File layout: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}},
then the data; offsets are relative to byte 8 + N.
"""
from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from xserv_aot.checkpoint import CheckpointError, one_line
from xserv_aot.dtypes import from_bf16_bits

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
          "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}   # FP8: its e4m3 values; scales in checkpoint/fp8_layouts.py
DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
ITEMSIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


@dataclass
class _Entry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int                         # absolute byte offsets in file
    end: int


def read_header(file: Path) -> dict[str, _Entry]:
    """Parse and check one safetensors header: every tensor's bytes must lie inside the file."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: corrupt safetensors header (file is {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{file}: corrupt safetensors header (header length {n} exceeds file size {size})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header (invalid JSON: {one_line(e)})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = str(info["dtype"]), tuple(int(d) for d in info["shape"]), info["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: corrupt safetensors header entry for tensor {name}") from None
        numel = int(np.prod(shape, dtype=np.int64))
        if dtype in ITEMSIZES and end - begin != numel * ITEMSIZES[dtype] or begin < 0 or end < begin:
            raise CheckpointError(f"{file}: tensor {name} has data_offsets [{begin}, {end}] that do not fit "
                                  f"shape {list(shape)} of {dtype}")
        if 8 + n + end > size:
            raise CheckpointError(f"{file}: truncated: tensor {name} ends at byte {8 + n + end} "
                                  f"but the file has {size} bytes")
        entries[name] = _Entry(file, dtype, shape, 8 + n + begin, 8 + n + end)
    return entries


def _shard_map(model_dir: Path) -> dict[str, Path] | None:
    """HF name -> shard file from the index, or None when there is no index."""
    index = model_dir / INDEX_FILE
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        items = [(str(k), str(v)) for k, v in weight_map.items()]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {one_line(e)})") from None
    return {name: model_dir / shard for name, shard in items}


class SafetensorsCheckpoint:
    """TensorSource over the safetensors files of a HF model directory."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        shard_of = _shard_map(self.model_dir)
        if shard_of is None:
            single = self.model_dir / SINGLE_FILE
            files = [single] if single.is_file() else sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")
        else:
            files = sorted(set(shard_of.values()))
            for shard in files:
                if not shard.is_file():
                    raise CheckpointError(f"{self.model_dir / INDEX_FILE}: points to missing shard {shard.name}")
        self._entries: dict[str, _Entry] = {}
        for file in files:
            for name, entry in read_header(file).items():
                if shard_of is None or shard_of.get(name) == file:
                    self._entries[name] = entry
        if shard_of is not None:
            for name, shard in shard_of.items():
                if name not in self._entries:
                    raise CheckpointError(f"{shard}: tensor {name} listed in {INDEX_FILE} is not in this shard")
        self._maps: dict[Path, np.memmap] = {}

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> str:
        """The safetensors dtype string of a tensor (F32, BF16, F8_E4M3, ...)."""
        return self._entry(name).dtype

    def dtype_name(self) -> str | None:
        """The most common tensor dtype, as a ModelConfig.source_dtype string."""
        counts = Counter(e.dtype for e in self._entries.values())
        return DTYPE_NAMES.get(counts.most_common(1)[0][0]) if counts else None

    def get(self, name: str) -> np.ndarray:
        e = self._entry(name)
        if e.dtype not in DTYPES:
            raise CheckpointError(f"{e.file}: tensor {name} has unsupported dtype {e.dtype} "
                                  f"(supported: {', '.join(DTYPES)})")
        if e.file not in self._maps:
            self._maps[e.file] = np.memmap(e.file, dtype=np.uint8, mode="r")
        raw = self._maps[e.file][e.begin:e.end].view(DTYPES[e.dtype]).reshape(e.shape)
        if e.dtype == "BF16":
            return from_bf16_bits(raw)
        return np.array(raw, dtype=np.float32)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"{name}: missing from checkpoint {self.model_dir}") from None

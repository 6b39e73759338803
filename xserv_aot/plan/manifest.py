"""The plan on disk: manifest.json + weights.bin + tokenizer files + kernels/. Plain data; see docs/plan-format.md."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xserv_aot.config import BuildConfig, ConfigError
from xserv_aot.model_config import ModelConfig
from xserv_aot import fp8
from xserv_aot.dtypes import FP8, ITEMSIZE
from xserv_aot.plan.integrity import (PlanError, check_file, check_kv_cache, check_layout, inside,
                                      verify_chunks)
from xserv_aot.plan.tensor_parallel import local_model
from xserv_aot.plan.op_records import Linear, Op, OpRecordError, buffer_names, op_from_dict

SCHEMA_VERSION = 2            # 2: launch records carry their arguments (docs/plan-format.md)
ALIGN = 256


@dataclass
class TensorInfo:
    offset: int
    shape: list[int]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    def to_dict(self) -> dict:
        return {"offset": self.offset, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class Bucket:
    name: str
    kind: str              # decode | prefill
    num_tokens: int
    num_seqs: int
    ops: tuple[Op, ...]
    max_context: int = 0   # > 0: only for steps whose sequences' contexts are all <= this (a decode megakernel copy)

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "num_tokens": self.num_tokens, "num_seqs": self.num_seqs,
                **({"max_context": self.max_context} if self.max_context else {}),
                "ops": [op.to_dict() for op in self.ops]}

    @classmethod
    def from_dict(cls, d: dict, known_buffers) -> "Bucket":
        """Validated: every op a known op with exactly its fields, naming buffers the plan has (OpRecordError)."""
        unknown = set(d) - {"name", "kind", "num_tokens", "num_seqs", "max_context", "ops"}
        if unknown:
            raise OpRecordError(f"bucket {d.get('name')!r}: unknown field {sorted(unknown)[0]!r}")
        ops = tuple(op_from_dict(op, f"bucket {d['name']} op {i}") for i, op in enumerate(d["ops"]))
        for i, op in enumerate(ops):
            missing = [n for n in buffer_names(op) if n not in known_buffers]
            if missing:
                raise OpRecordError(f"bucket {d['name']} op {i} ({op.op}): names {missing[0]!r}, which the plan "
                                    f"has neither as an arena buffer nor as a weight")
        return cls(d["name"], d["kind"], int(d["num_tokens"]), int(d["num_seqs"]), ops, int(d.get("max_context", 0)))


def place(end: int, shape: list[int], dtype: str, align: int = ALIGN) -> tuple[TensorInfo, int]:
    """A buffer at the first aligned offset from `end`; returns (its info, the new end, rounded up to align)."""
    info = TensorInfo(-(-int(end) // align) * align, [int(s) for s in shape], dtype)
    return info, info.offset + -(-info.nbytes // align) * align


def layout(buffers: dict[str, tuple[list[int], str]], align: int = ALIGN) -> tuple[dict[str, TensorInfo], int]:
    """Place buffers back to back at aligned offsets, in the given order. Returns (table, total size)."""
    table, off = {}, 0
    for name, (shape, dtype) in buffers.items():
        table[name], off = place(off, shape, dtype, align)
    return table, off


def check_linear_weights(op: Linear, weights: dict[str, TensorInfo]) -> None:
    """A linear's weight dtype agrees with its quant field, and FP8 scales have the scheme's shape."""
    w = weights.get(op.weight)
    if w is None:
        return                                   # an arena buffer; Bucket.from_dict checked the name
    if (w.dtype == FP8) != (op.quant is not None):
        raise PlanError(f"linear {op.weight}: weight dtype {w.dtype} does not fit quant {op.quant!r}")
    if op.quant is not None:
        want = fp8.weight_scale_shape(op.quant, op.n, op.k)
        scale = weights.get(op.weight_scale)
        if scale is None or scale.dtype != "float32" or scale.shape != want:
            got = f"{scale.shape} {scale.dtype}" if scale else "missing"
            raise PlanError(f"linear {op.weight}: scale {op.weight_scale} is {got}, {op.quant} needs {want} float32")


class Plan:
    def __init__(self, plan_dir: Path, manifest: dict):
        self.dir = Path(plan_dir)
        self.manifest = manifest
        self.model = ModelConfig.from_dict(manifest["model"])
        self.build = BuildConfig.from_dict(manifest["build"])
        w = manifest["weights"]
        self.tensor_parallel = self.build.tensor_parallel
        # one entry per rank: {file, size, fingerprint, chunks}; empty for dummy weights
        self.weight_files = w["files"] if "files" in w else [w] if w.get("file") else []
        if self.weight_files and len(self.weight_files) != self.tensor_parallel:
            raise ConfigError(f"{len(self.weight_files)} weights files for tensor_parallel {self.tensor_parallel}")
        self.weights_file = self.weight_files[0]["file"] if self.weight_files else None
        self.sharding = w.get("sharding")
        self.dummy_seed = w.get("dummy_seed")
        self.weights = {k: TensorInfo(**v) for k, v in w["tensors"].items()}
        self.arena = {k: TensorInfo(**v) for k, v in manifest["arena"]["buffers"].items()}
        self.arena_size = int(manifest["arena"]["size"])
        self.kv_cache = manifest["kv_cache"]
        known = self.arena.keys() | self.weights.keys()
        self.buckets = [Bucket.from_dict(b, known) for b in manifest["buckets"]]
        self.kernels = manifest.get("kernels") or {}
        self.generation_defaults: dict = manifest.get("generation_defaults") or {}   # request field -> default
        self.quantization: dict | None = manifest.get("quantization")          # docs/plan-format.md "FP8"
        for f in self.weight_files:
            inside(self.dir, f["file"], "weights")
        check_layout(self.weights, int(w["size"]), layout)
        for bucket in self.buckets:
            for op in bucket.ops:
                if isinstance(op, Linear):
                    check_linear_weights(op, self.weights)
        check_kv_cache(self.kv_cache, local_model(self.model, self.tensor_parallel), self.build, ITEMSIZE)

    @classmethod
    def load(cls, plan_dir: Path | str, verify: str = "full") -> "Plan":
        """verify: "full" (every weights chunk and kernel file against its hash) | "none" (layout checks only)."""
        plan_dir = Path(plan_dir)
        path = plan_dir / "manifest.json"
        if not path.is_file():
            raise PlanError(f"{plan_dir}: not a plan (no manifest.json); build one with `xserv-aot compile`")
        try:
            manifest = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(f"{path}: corrupt manifest ({e})") from None
        version = manifest.get("schema_version") if isinstance(manifest, dict) else None
        if version != SCHEMA_VERSION:
            made_by = manifest.get("xserv_aot_version", "an unknown version")
            raise PlanError(f"{plan_dir}: plan from another version (schema version {version}, written by xserv-aot "
                            f"{made_by}; this xserv-aot reads schema version {SCHEMA_VERSION}); recompile the plan")
        try:
            plan = cls(plan_dir, manifest)
        except (OpRecordError, ConfigError) as e:
            raise PlanError(f"{path}: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            if isinstance(e, PlanError):
                raise PlanError(f"{path}: {e}") from None
            raise PlanError(f"{path}: malformed manifest ({type(e).__name__}: {e})") from None
        if verify not in ("none", "full"):
            raise ValueError(f"verify must be 'none' or 'full', got {verify!r}")
        if verify == "full":
            plan.verify_weights()
            plan.kernel_files()
        return plan

    def verify_weights(self) -> None:
        """Every byte of every weights file against its chunk hashes, chunks hashed in parallel."""
        for w in self.weight_files:
            path = inside(self.dir, w["file"], "weights")
            if not path.is_file():
                raise PlanError(f"{self.dir / w['file']}: weights file is missing")
            if path.stat().st_size != w["size"]:
                raise PlanError(f"{path}: weights file is {path.stat().st_size} bytes, the plan expects {w['size']}")
            chunks = w.get("chunks")
            if not chunks:
                raise PlanError(f"{self.dir}: plan has no weight chunk hashes (compiled by an older xserv-aot); "
                                f"recompile")
            verify_chunks(path, chunks["sha256"], int(chunks["size"]), self.weights)

    def kernel_files(self) -> dict[str, Path]:
        """kernel file name -> path, each checked inside the plan and against its hash (before any dlopen)."""
        files = {name: check_file(self.dir, c, f"cubin {name}") for name, c in (self.kernels.get("cubins") or {}).items()}
        lib = self.kernels.get("gemm_library")
        if lib:
            files["gemm_library"] = check_file(self.dir, lib, "GEMM library")
        return files

    def weights_bytes(self, rank: int = 0) -> np.memmap | None:
        """Rank `rank`'s weights file (every rank's has the same table); None for dummy weights."""
        if not self.weight_files:
            return None
        return np.memmap(inside(self.dir, self.weight_files[rank]["file"], "weights"), dtype=np.uint8, mode="r")

    @property
    def fp8_schemes(self) -> dict[str, str]:
        """plan weight name -> FP8 scheme of the plan's FP8 weights."""
        return dict((self.quantization or {}).get("schemes") or {})

    @property
    def has_tokenizer(self) -> bool:
        return (self.dir / "tokenizer.json").is_file()

    @property
    def decode_buckets(self) -> list[Bucket]:
        return [b for b in self.buckets if b.kind == "decode"]

    def bucket_for(self, num_tokens: int, num_seqs: int, max_context: int = 0) -> Bucket:
        """Smallest bucket that holds the batch: decode buckets for 1-token-per-seq batches, else prefill; of two
        the same size, the one limited to contexts <= max_context (the batch's longest) if there is one."""
        fits = [b for b in self.buckets if b.num_tokens >= num_tokens and b.num_seqs >= num_seqs
                and (not b.max_context or b.max_context >= max_context)]
        if num_tokens != num_seqs:
            fits = [b for b in fits if b.kind == "prefill"] or fits
        if not fits:
            raise ValueError(f"no bucket holds {num_tokens} tokens / {num_seqs} sequences "
                             f"(max {self.build.prefill_chunk} tokens, {self.build.max_num_seqs} sequences)")
        return min(fits, key=lambda b: (b.num_tokens, b.num_seqs, not b.max_context, b.max_context))

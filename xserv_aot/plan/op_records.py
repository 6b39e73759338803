"""Typed, immutable op records (docs/plan-format.md "Ops"): one frozen dataclass per op, built from the manifest
and validated when a plan is loaded; the CUDA kernel chosen for an op sits next to it (`cuda`), never inside it."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import ClassVar

from xserv_aot.fp8 import SCHEMES
from xserv_aot.plan.tensor_maps import TensorMapError, check_tensor_map


class OpRecordError(ValueError):
    """An op entry that is not a valid op record; one line."""


@dataclass(frozen=True)
class LaunchRecord:
    """One launch (docs/plan-format.md "Launch records"): a kernel with its geometry, or a host-library entry point
    (library set, no geometry; the launcher appends the stream). args: one tuple per C parameter."""
    fn: str
    args: tuple[tuple, ...]
    grid: tuple[int, int, int] | None = None
    block: tuple[int, int, int] | None = None
    smem: int = 0
    library: str | None = None
    pdl: bool = False                    # launched under programmatic dependent launch (kernel records only)

    def to_dict(self) -> dict:
        args = [list(a) for a in self.args]
        if self.library:
            return {"fn": self.fn, "library": self.library, "args": args}
        d = {"fn": self.fn, "grid": list(self.grid), "block": list(self.block), "smem": self.smem, "args": args}
        return {**d, "pdl": True} if self.pdl else d

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "LaunchRecord":
        keys = {"fn", "library", "args"} if d.get("library") else {"fn", "grid", "block", "smem", "args"}
        if not isinstance(d, dict) or set(d) - {"pdl"} != keys or d.get("pdl", True) is not True or (
                "pdl" in d and d.get("library")):
            raise OpRecordError(f"{where}: bad launch record (fields {sorted(d) if isinstance(d, dict) else d})")
        geometry = {} if d.get("library") else {"grid": tuple(d["grid"]), "block": tuple(d["block"]),
                                                "smem": int(d["smem"]), "pdl": "pdl" in d}
        args = tuple(tuple(a) for a in d["args"])
        for a in args:
            if a and a[0] == "tmap":
                try:
                    check_tensor_map(a[1] if len(a) == 2 else None)
                except TensorMapError as e:
                    raise OpRecordError(f"{where}: launch {d['fn']}: {e}") from None
        return cls(d["fn"], args, library=d.get("library"), **geometry)


@dataclass(frozen=True)
class KernelChoice:
    """What plan.kernel_build chose for one op; launch holds the records runtime/cuda/launch.py replays."""
    kernel: str                          # "fused_into_previous": the previous op computes this one
    launch: tuple[LaunchRecord, ...] = ()
    fused_silu_out: str | None = None    # linear: writes silu(gate) * up here (the next silu_mul is fused)
    fused_residual: str | None = None    # linear: adds its output into this buffer (the next add_rmsnorm only norms)
    splits: int | None = None            # split-K partitions (linear), split-KV partitions (decode attention)
    split: int | None = None             # decode attention: keys per split
    gemm_config: int | None = None       # CUTLASS library config index

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        d["launch"] = [rec.to_dict() for rec in self.launch]
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "KernelChoice":
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown or "kernel" not in d:
            raise OpRecordError(f"{where}: bad cuda entry (unknown {sorted(unknown)} / missing kernel)")
        launch = tuple(LaunchRecord.from_dict(r, f"{where} launch {i}") for i, r in enumerate(d.get("launch") or ()))
        return cls(**{**d, "launch": launch})


@dataclass(frozen=True)
class Op:
    OP: ClassVar[str] = ""
    rows: int
    cuda: KernelChoice | None = field(default=None, kw_only=True)

    @property
    def op(self) -> str:
        return self.OP

    def to_dict(self) -> dict:
        """Optional fields (those with a default) are written only when set, so older plans read the same."""
        d = {"op": self.OP, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                               if f.name != "cuda" and not (f.default is None and getattr(self, f.name) is None)}}
        if self.cuda is not None:
            d["cuda"] = self.cuda.to_dict()
        return d


@dataclass(frozen=True)
class ResolveInputIds(Op):
    """Overlapped steps: ids[i] = sampled[prev_rows[i]] where prev_rows[i] >= 0 (the previous step's device
    sample), else ids[i] unchanged."""
    OP = "resolve_input_ids"
    ids: str
    prev_rows: str
    sampled: str


@dataclass(frozen=True)
class Embedding(Op):
    OP = "embedding"
    ids: str
    table: str
    out: str


@dataclass(frozen=True)
class RmsNorm(Op):
    OP = "rmsnorm"
    inp: str
    weight: str
    out: str
    eps: float


@dataclass(frozen=True)
class AddRmsNorm(Op):
    OP = "add_rmsnorm"
    residual: str
    delta: str
    weight: str
    out: str
    eps: float


@dataclass(frozen=True)
class Linear(Op):
    """out[:rows, :n] = inp[:rows, :k] @ weight^T (+ bias), fp32 accumulation. FP8 (docs/plan-format.md "FP8"):
    quant "fp8_channel" | "fp8_block128" with weight float8_e4m3fn and weight_scale its float32 scales; inp_scale
    None: W8A16 (bf16 inp); set: W8A8 (inp float8_e4m3fn from a quantize_fp8 op, inp_scale its scales)."""
    OP = "linear"
    inp: str
    weight: str
    bias: str | None
    out: str
    n: int
    k: int
    weight_scale: str | None = None
    quant: str | None = None
    inp_scale: str | None = None

    def __post_init__(self):
        if (self.quant is None) != (self.weight_scale is None) or (self.inp_scale and self.quant is None):
            raise OpRecordError(f"linear {self.weight}: quant, weight_scale and inp_scale must come together "
                                f"(quant {self.quant!r}, weight_scale {self.weight_scale!r}, inp_scale {self.inp_scale!r})")
        if self.quant is not None and self.quant not in SCHEMES:
            raise OpRecordError(f"linear {self.weight}: unknown quant {self.quant!r} (known: {', '.join(SCHEMES)})")


@dataclass(frozen=True)
class QuantizeFp8(Op):
    """Per row m and K-group g of `group` columns (the last may be shorter): s = max(max|inp[m, g]|, 1e-12) / 448,
    out[m, g] = e4m3(inp[m, g] / s), scale[m, g_index] = s (float32)."""
    OP = "quantize_fp8"
    inp: str
    out: str
    scale: str
    k: int
    group: int


@dataclass(frozen=True)
class QkNormRopeCache(Op):
    OP = "qk_norm_rope_cache"
    qkv: str
    positions: str
    slot_mapping: str
    q_norm: str | None
    k_norm: str | None
    cos: str
    sin: str
    q_out: str
    kv_cache: str
    layer: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


@dataclass(frozen=True)
class Attention(Op):
    OP = "attention"
    q: str
    kv_cache: str
    layer: int
    query_start_loc: str
    seq_lens: str
    block_tables: str
    out: str
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


@dataclass(frozen=True)
class SiluMul(Op):
    OP = "silu_mul"
    inp: str
    out: str
    inter: int


@dataclass(frozen=True)
class GatherRows(Op):
    OP = "gather_rows"
    inp: str
    indices: str
    out: str


@dataclass(frozen=True)
class ApplyTokenBitmask(Op):
    """Grammar masks: rows with bitmask_rows[r] != 0 get logits[r, i] = -inf unless bit i % 32 of
    bitmask[r, i // 32] is set; the others pass through (no mask was staged for them)."""
    OP = "apply_token_bitmask"
    logits: str
    bitmask: str
    bitmask_rows: str
    n: int


@dataclass(frozen=True)
class Sample(Op):
    OP = "sample"
    logits: str
    temperature: str
    top_k: str
    top_p: str
    seeds: str
    sample_offsets: str
    out: str               # int32 token ids; NONFINITE_ID (-1, runtime.batch) for a row of NaN/Inf logits


@dataclass(frozen=True)
class AllReduce(Op):
    """Collective over the plan's `ranks` (tensor parallel): every rank's buf[:rows] becomes the sum of all ranks'."""
    OP = "all_reduce"
    buf: str
    ranks: int


@dataclass(frozen=True)
class AllGather(Op):
    """Collective: out[i, r*n:(r+1)*n] = inp[i, :n] of rank r, for i < rows, on every rank."""
    OP = "all_gather"
    inp: str
    out: str
    n: int
    ranks: int


OP_TYPES: dict[str, type[Op]] = {c.OP: c for c in (ResolveInputIds, Embedding, RmsNorm, AddRmsNorm, Linear,
                                                   QuantizeFp8, QkNormRopeCache, Attention, SiluMul, GatherRows, ApplyTokenBitmask,
                                                   Sample, AllReduce, AllGather)}
COLLECTIVES = (AllReduce, AllGather)
_CHECKS = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
           float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
           str: lambda v: isinstance(v, str), str | None: lambda v: v is None or isinstance(v, str)}


def op_from_dict(d: dict, where: str = "op") -> Op:
    """A manifest op entry -> its record; OpRecordError (one line) for an unknown op, field or value type."""
    if not isinstance(d, dict):
        raise OpRecordError(f"{where}: not an object")
    cls = OP_TYPES.get(d.get("op"))
    if cls is None:
        raise OpRecordError(f"{where}: unknown op {d.get('op')!r} (known: {', '.join(OP_TYPES)})")
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.name != "cuda"]
    names = [f.name for f in fields]
    optional = {f.name for f in fields if f.default is None}
    extra = sorted(set(d) - set(names) - {"op", "cuda"})
    if extra:
        raise OpRecordError(f"{where} ({cls.OP}): unknown field {extra[0]!r}")
    for name in names:
        if name not in d and name in optional:
            continue
        if name not in d:
            raise OpRecordError(f"{where} ({cls.OP}): missing field {name!r}")
        if not _CHECKS[hints[name]](d[name]):
            raise OpRecordError(f"{where} ({cls.OP}): field {name!r} = {d[name]!r} is not {hints[name]}")
    cuda = KernelChoice.from_dict(d["cuda"], where) if d.get("cuda") is not None else None
    return cls(**{n: d[n] for n in names if n in d}, cuda=cuda)


NOT_BUFFERS = ("kv_cache", "quant")


def read_later(ops: list[Op], start: int, buf: str) -> bool:
    """Whether an op from ops[start] on reads buf before one writes it (an op writes its `out` field)."""
    for op in ops[start:]:
        fields = {f: v for f, v in vars(op).items() if f != "cuda"}
        if buf in [v for f, v in fields.items() if f != "out"]:
            return True
        if fields.get("out") == buf:
            return False
    return False


def buffer_names(op: Op) -> list[str]:
    """Arena buffers and weights an op names (its str fields but the KV cache and a linear's quant scheme)."""
    hints = typing.get_type_hints(type(op))
    return [getattr(op, f.name) for f in dataclasses.fields(op)
            if hints[f.name] in (str, str | None) and f.name not in NOT_BUFFERS and getattr(op, f.name) is not None]

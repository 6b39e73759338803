"""Tensor parallelism (docs/plan-format.md "Tensor parallel plans"): which slice of every weight each rank holds.

Rank r of N holds: its q heads [r*nh/N, (r+1)*nh/N) with their kv heads (a kv head is replicated on N/nkv ranks
when N > nkv), its slice of the intermediate dimension, vocab rows [r*V/N, (r+1)*V/N) of lm_head, and a full copy
of the embedding table, norms and rope tables. Column-parallel weights (qkv, gate_up) keep their fused layout per
rank ([q_r; k_r; v_r], [gate_r; up_r]); row-parallel weights (o_proj, down) are split along their input columns.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from xserv_aot.config import ConfigError
from xserv_aot.model_config import ModelConfig

EMBEDDING = "replicated"     # the lookup table is copied on every rank (no collective); lm_head is vocab-parallel


@dataclass(frozen=True)
class Segment:
    """One fused block along the split axis: `size` in the full tensor, `local` per rank, starting (inside the
    block) at starts[r] on rank r."""
    name: str
    size: int
    local: int
    starts: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "size": self.size, "local": self.local, "starts": list(self.starts)}


@dataclass(frozen=True)
class ShardSpec:
    style: str                            # replicated | column | row | vocab
    dim: int | None = None                # axis split: 0 output rows, 1 input columns
    segments: tuple[Segment, ...] = ()
    source: str | None = None             # plan tensor the shards are cut from, when not the same name

    def to_dict(self) -> dict:
        d = {"style": self.style, "dim": self.dim, "segments": [s.to_dict() for s in self.segments]}
        return {**d, "source": self.source} if self.source else d

    @classmethod
    def from_dict(cls, d: dict) -> "ShardSpec":
        segs = tuple(Segment(s["name"], s["size"], s["local"], tuple(s["starts"])) for s in d["segments"])
        return cls(d["style"], d["dim"], segs, d.get("source"))

    def local_shape(self, shape: list[int]) -> list[int]:
        if self.dim is None:
            return list(shape)
        out = list(shape)
        out[self.dim] = sum(s.local for s in self.segments)
        return out

    def shard(self, full: np.ndarray, rank: int) -> np.ndarray:
        """Rank `rank`'s part of the full tensor."""
        if self.dim is None:
            return full
        parts, base = [], 0
        for s in self.segments:
            lo = base + s.starts[rank]
            parts.append(full[lo:lo + s.local] if self.dim == 0 else full[:, lo:lo + s.local])
            base += s.size
        return np.ascontiguousarray(np.concatenate(parts, axis=self.dim))


@dataclass(frozen=True)
class Copy2D:
    """Bytes: `height` rows of `width` from src (+ src_offset, row pitch src_pitch) to dst likewise."""
    src_offset: int
    src_pitch: int
    dst_offset: int
    dst_pitch: int
    width: int
    height: int


def shard_copies(spec: ShardSpec, shape: list[int], itemsize: int, rank: int) -> list[Copy2D]:
    """The 2-D copies that cut rank `rank`'s part out of the full row-major tensor (what spec.shard does), for a
    device that holds the full tensor (runtime/cuda/dummy_upload.py)."""
    row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize            # bytes of one dim-0 row
    if spec.dim is None:
        total = int(shape[0]) * row
        return [Copy2D(0, total, 0, total, total, 1)]
    out, base, done = [], 0, 0
    local = sum(s.local for s in spec.segments)
    for s in spec.segments:
        lo = base + s.starts[rank]
        if spec.dim == 0:
            out.append(Copy2D(lo * row, s.local * row, done * row, s.local * row, s.local * row, 1))
        else:
            out.append(Copy2D(lo * itemsize, shape[1] * itemsize, done * itemsize, local * itemsize,
                              s.local * itemsize, shape[0]))
        base, done = base + s.size, done + s.local
    return out


def check_divisible(m: ModelConfig, tp: int) -> None:
    """One-line ConfigError naming the first dimension that tp ranks cannot split."""
    dims = [("num_heads", m.num_heads), ("intermediate_size", m.intermediate_size), ("vocab_size", m.vocab_size)]
    for name, value in dims:
        if value % tp:
            raise ConfigError(f"tensor_parallel {tp} does not divide {name} {value}")
    if m.num_kv_heads % tp and tp % m.num_kv_heads:
        raise ConfigError(f"tensor_parallel {tp} neither divides nor is a multiple of num_kv_heads {m.num_kv_heads}")


def local_model(m: ModelConfig, tp: int) -> ModelConfig:
    """The per-rank shapes (heads, kv heads, intermediate size); vocab stays full (the embedding is replicated).
    m itself when tp == 1."""
    if tp == 1:
        return m
    check_divisible(m, tp)
    return dataclasses.replace(m, num_heads=m.num_heads // tp, num_kv_heads=max(1, m.num_kv_heads // tp),
                               intermediate_size=m.intermediate_size // tp)


def rank_model(manifest: dict) -> dict:
    """A manifest's model dict with one rank's heads, kv heads and intermediate size (its own when unsharded)."""
    tp = manifest["build"].get("tensor_parallel", 1)
    return manifest["model"] if tp == 1 else local_model(ModelConfig.from_dict(manifest["model"]), tp).to_dict()


def kv_head_starts(m: ModelConfig, tp: int) -> list[int]:
    """First kv head of each rank: rank r's q heads start at r*nh/tp, whose group is kv head r*nkv/tp (rounded down
    when tp > nkv: each kv head then serves tp/nkv ranks)."""
    return [r * m.num_kv_heads // tp for r in range(tp)]


def tensor_sharding(m: ModelConfig, tp: int, names: list[str]) -> dict[str, ShardSpec]:
    """ShardSpec of every plan tensor in `names` (weight_specs order, rope tables), plus lm_head."""
    loc = local_model(m, tp)
    hd, ranks = m.head_dim, range(tp)

    def even(name, size, local):
        return Segment(name, size, local, tuple(r * local for r in ranks))

    q = even("q", m.q_size, loc.q_size)
    kv = [Segment(n, m.kv_size, loc.kv_size, tuple(s * hd for s in kv_head_starts(m, tp))) for n in ("k", "v")]
    gate_up = (even("gate", m.intermediate_size, loc.intermediate_size),
               even("up", m.intermediate_size, loc.intermediate_size))
    by_suffix = {"qkv": ShardSpec("column", 0, (q, *kv)), "qkv_bias": ShardSpec("column", 0, (q, *kv)),
                 "o_proj": ShardSpec("row", 1, (q,)), "gate_up": ShardSpec("column", 0, gate_up),
                 "down": ShardSpec("row", 1, (even("inter", m.intermediate_size, loc.intermediate_size),))}
    out = {n: by_suffix.get(n.rsplit(".", 1)[-1], ShardSpec("replicated")) for n in names}
    vocab = (even("vocab", m.vocab_size, m.vocab_size // tp),)
    out["lm_head"] = ShardSpec("vocab", 0, vocab, source="embed_tokens" if m.tie_word_embeddings else None)
    return out


def targets_of(name: str, sharding: dict[str, ShardSpec]) -> list[str]:
    """The plan tensors cut from full tensor `name`: itself, then a tied lm_head right after embed_tokens."""
    return [name] + [n for n, s in sharding.items() if s.source == name]


def rank_shards(tensors: Iterator[tuple[str, np.ndarray, bool]], sharding: dict[str, ShardSpec],
                tp: int) -> Iterator[tuple[str, list[np.ndarray], bool]]:
    """Full plan tensors -> (name, [part of rank 0, ..., rank tp-1], is_rope)."""
    for name, arr, rope in tensors:
        for target in targets_of(name, sharding):
            yield target, [sharding[target].shard(arr, r) for r in range(tp)], rope


def local_shapes(full: dict[str, tuple[list[int], str]],
                 sharding: dict[str, ShardSpec]) -> dict[str, tuple[list[int], str]]:
    """Full (shape, dtype) of every plan tensor -> one rank's, in the order rank_shards writes them."""
    return {t: (sharding[t].local_shape(shape), dtype) for name, (shape, dtype) in full.items()
            for t in targets_of(name, sharding)}


def manifest_section(m: ModelConfig, tp: int) -> dict:
    """The manifest's tensor_parallel entry (the per-tensor sharding sits in weights.sharding)."""
    return {"ranks": tp, "embedding": EMBEDDING, "lm_head": "vocab", "num_kv_heads": local_model(m, tp).num_kv_heads,
            "kv_head_starts": kv_head_starts(m, tp), "collectives": "all_reduce after o_proj and down (row-parallel); "
            "all_gather of logits_shard into logits before sample"}

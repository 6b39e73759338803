"""Weights in the plan's layout: which HF tensors feed each plan tensor, RoPE tables, and writing weights.bin."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from xserv_aot.model_config import ModelConfig
from xserv_aot.dtypes import encode
from xserv_aot.errors import XservError
from xserv_aot.plan.integrity import CHUNK_BYTES, ChunkHasher
from xserv_aot.plan.manifest import ALIGN, TensorInfo


class WeightError(XservError, ValueError):
    """A checkpoint tensor that does not fit the model config; the message is one line."""


def weight_specs(m: ModelConfig) -> dict[str, tuple[list[int], list[str]]]:
    """plan name -> (shape, HF source tensors concatenated along dim 0)."""
    h, i, q, kv, hd = m.hidden_size, m.intermediate_size, m.q_size, m.kv_size, m.head_dim
    specs: dict[str, tuple[list[int], list[str]]] = {"embed_tokens": ([m.vocab_size, h], ["model.embed_tokens.weight"])}
    for li in range(m.num_layers):
        a, p = f"model.layers.{li}.self_attn.", f"model.layers.{li}."
        specs[f"layers.{li}.input_norm"] = ([h], [p + "input_layernorm.weight"])
        specs[f"layers.{li}.qkv"] = ([q + 2 * kv, h], [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"])
        if m.qkv_bias:
            specs[f"layers.{li}.qkv_bias"] = ([q + 2 * kv], [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"])
        if m.qk_norm:
            specs[f"layers.{li}.q_norm"] = ([hd], [a + "q_norm.weight"])
            specs[f"layers.{li}.k_norm"] = ([hd], [a + "k_norm.weight"])
        specs[f"layers.{li}.o_proj"] = ([h, q], [a + "o_proj.weight"])
        specs[f"layers.{li}.post_attn_norm"] = ([h], [p + "post_attention_layernorm.weight"])
        specs[f"layers.{li}.gate_up"] = ([2 * i, h], [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        specs[f"layers.{li}.down"] = ([h, i], [p + "mlp.down_proj.weight"])
    specs["final_norm"] = ([h], ["model.norm.weight"])
    if not m.tie_word_embeddings:
        specs["lm_head"] = ([m.vocab_size, h], ["lm_head.weight"])
    return specs


def rope_inv_freq(m: ModelConfig) -> np.ndarray:
    hd = m.head_dim
    inv = 1.0 / (m.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    rs = m.rope_scaling
    if rs and rs.get("rope_type") == "llama3":
        factor, low, high = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv = np.where(medium, smoothed, scaled)
    return inv


def rope_tables(m: ModelConfig, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_seq_len, head_dim/2] float32 (angles in float32 like HF)."""
    inv = rope_inv_freq(m).astype(np.float32)
    ang = np.arange(max_seq_len, dtype=np.float32)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)       # derived buffers some checkpoints carry; recomputed from the config


def finite_or_fail(name: str, arr: np.ndarray) -> np.ndarray:
    if not np.isfinite(arr).all():
        bad = np.flatnonzero(~np.isfinite(arr.ravel()))
        raise WeightError(f"{name}: {len(bad)} NaN/Inf values (first at flat index {bad[0]}: {arr.ravel()[bad[0]]}); "
                          f"the checkpoint is corrupt")
    return arr


def _label(source, name: str) -> str:
    origin = getattr(source, "origin", None)
    return f"{name} ({origin(name)})" if origin and origin(name) != name else name


def check_unused(m: ModelConfig, source, used: set[str]) -> None:
    """Every checkpoint tensor must feed the plan: one the model does not use means the config is wrong."""
    for name in source.names():
        if name in used or name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and m.tie_word_embeddings and \
                np.array_equal(source.get(name), source.get("model.embed_tokens.weight")):
            continue                                 # a tied head saved as a copy of the embedding
        raise WeightError(f"checkpoint tensor {_label(source, name)} is not used by the {m.arch} model its config "
                          f"describes (an unsupported feature such as attention or MLP biases?); refusing to drop it")


def plan_tensors(m: ModelConfig, source, max_seq_len: int) -> Iterator[tuple[str, np.ndarray, bool]]:
    """Yield (plan name, float32 array, is_rope_table) in plan order, checking every source shape and value, and
    that no checkpoint tensor is left unused."""
    specs = weight_specs(m)
    check_unused(m, source, {src for _, parts in specs.values() for src in parts})
    for name, (shape, parts) in specs.items():
        arrays = [finite_or_fail(_label(source, src), np.asarray(source.get(src), dtype=np.float32)) for src in parts]
        arr = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
        if list(arr.shape) != shape:
            got = " + ".join(str(list(a.shape)) for a in arrays)
            raise WeightError(f"{', '.join(parts)}: shape {got} does not fit the config (expected {shape} in total)")
        yield name, arr, False
    cos, sin = rope_tables(m, max_seq_len)
    yield "rope_cos", cos, True
    yield "rope_sin", sin, True


class WeightsFile:
    """A weights file being written: tensors streamed at aligned offsets, with its table and chunk hashes."""

    def __init__(self, path: Path, chunk: int = CHUNK_BYTES):
        self.f, self.table, self.off, self.h = open(path, "wb"), {}, 0, ChunkHasher(chunk)

    def add(self, name: str, arr: np.ndarray, dtype: str) -> None:
        raw = encode(arr, dtype).tobytes()
        pad = b"\0" * (-(-len(raw) // ALIGN) * ALIGN - len(raw))
        for data in (raw, pad):
            self.f.write(data)
            self.h.update(data)
        self.table[name] = TensorInfo(self.off, list(arr.shape), dtype)
        self.off += len(raw) + len(pad)

    def close(self) -> tuple[dict[str, TensorInfo], int, list[str]]:
        self.f.close()
        return self.table, self.off, self.h.finish()


def write_weights(path: Path, tensors: Iterator[tuple[str, np.ndarray, bool]], dtypes: dict[str, str],
                  on_tensor: Callable[[str], None] | None = None, chunk: int = CHUNK_BYTES
                  ) -> tuple[dict[str, TensorInfo], int, list[str]]:
    """Stream tensors into weights.bin at aligned offsets, each in dtypes[name]. Returns (table, size, sha256 of
    each `chunk` bytes)."""
    out = WeightsFile(path, chunk)
    try:
        for name, arr, _ in tensors:
            out.add(name, arr, dtypes[name])
            if on_tensor:
                on_tensor(name)
    finally:
        result = out.close()
    return result


def write_rank_weights(paths: list[Path], shards: Iterator[tuple[str, list[np.ndarray], bool]], dtypes: dict[str, str],
                       on_tensor: Callable[[str], None] | None = None, chunk: int = CHUNK_BYTES
                       ) -> list[tuple[dict[str, TensorInfo], int, list[str]]]:
    """One weights file per rank from (name, [part of each rank], is_rope); every rank's table is the same."""
    files = [WeightsFile(p, chunk) for p in paths]
    try:
        for name, parts, _ in shards:
            for f, arr in zip(files, parts):
                f.add(name, arr, dtypes[name])
            if on_tensor:
                on_tensor(name)
    finally:
        results = [f.close() for f in files]
    return results

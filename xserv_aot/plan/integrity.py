"""What a plan's manifest promises about its files, checked before anything is used: every path stays inside the
plan directory, weights.bin matches its per-chunk sha256 hashes (verified in parallel), the weights table is the
layout its own shapes imply, the KV cache shape is the model's, and kernel files match their hashes."""
from __future__ import annotations

import concurrent.futures
import hashlib
import math
import os
from pathlib import Path

from xserv_aot.errors import XservError

CHUNK_BYTES = 1 << 26                                # weights.bin is hashed in 64 MiB chunks
READ_BYTES = 1 << 23


class PlanError(XservError, ValueError):
    """A plan directory that cannot be used; the message is one line."""


class ChunkHasher:
    """sha256 of each CHUNK_BYTES-long slice of a byte stream fed in pieces of any size."""

    def __init__(self, chunk: int = CHUNK_BYTES):
        self.chunk, self.digests, self._h, self._filled = chunk, [], hashlib.sha256(), 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.chunk - self._filled)
            self._h.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk:
                self._roll()

    def _roll(self) -> None:
        self.digests.append(self._h.hexdigest())
        self._h, self._filled = hashlib.sha256(), 0

    def finish(self) -> list[str]:
        if self._filled:
            self._roll()
        return self.digests


def fingerprint(digests: list[str]) -> str:
    """The plan's weights identity: sha256 over the chunk hashes."""
    return "sha256:" + hashlib.sha256("".join(digests).encode()).hexdigest()


def _hash_range(fd: int, begin: int, end: int) -> str:
    h = hashlib.sha256()
    off = begin
    while off < end:
        data = os.pread(fd, min(READ_BYTES, end - off), off)   # pread and sha256 release the GIL
        if not data:
            break
        h.update(data)
        off += len(data)
    return h.hexdigest()


def chunk_hashes(path: Path, chunk: int = CHUNK_BYTES, workers: int | None = None) -> list[str]:
    size = Path(path).stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers or min(32, os.cpu_count() or 1)) as pool:
            return list(pool.map(lambda i: _hash_range(fd, i * chunk, min(size, (i + 1) * chunk)),
                                 range(math.ceil(size / chunk))))
    finally:
        os.close(fd)


def verify_chunks(path: Path, expected: list[str], chunk: int, tensors: dict) -> None:
    """Raise naming the first chunk (and a tensor in it) whose bytes differ from the manifest's hash."""
    got = chunk_hashes(path, chunk)
    if len(got) != len(expected):
        raise PlanError(f"{path}: {len(got)} chunks, the manifest lists {len(expected)}")
    for i, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            begin, end = i * chunk, (i + 1) * chunk
            names = [n for n, t in tensors.items() if t.offset < end and t.offset + t.nbytes > begin]
            raise PlanError(f"{path}: bytes {begin}..{min(end, path.stat().st_size)} do not match the plan's "
                                 f"chunk hash {i} (tensors {', '.join(names[:4]) or '-'}; file changed since compile)")


def check_layout(tensors: dict, size: int, layout) -> None:
    """Offsets and the total must be exactly what `layout` gives for the table's own shapes, in its order."""
    expected, total = layout({n: (t.shape, t.dtype) for n, t in tensors.items()})
    for name, t in tensors.items():
        if t.offset != expected[name].offset:
            raise PlanError(f"weights table: tensor {name} at offset {t.offset}, but its shapes place it at "
                                 f"{expected[name].offset}")
    if total != size:
        raise PlanError(f"weights table: tensors need {total} bytes, the manifest says {size}")


def inside(plan_dir: Path, rel: str, what: str) -> Path:
    """plan_dir / rel, refused unless it resolves inside plan_dir (no absolute paths, `..` or links out)."""
    root = Path(plan_dir).resolve()
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute():
        raise PlanError(f"{plan_dir}: {what} path {rel!r} must be relative to the plan directory")
    path = (root / rel).resolve()
    if not path.is_relative_to(root):
        raise PlanError(f"{plan_dir}: {what} path {rel!r} leaves the plan directory")
    return path


def file_hash(path: Path) -> str:
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def check_file(plan_dir: Path, entry: dict, what: str) -> Path:
    """The file an entry {file, hash} names, after checking it is inside the plan and matches its hash."""
    path = inside(plan_dir, entry.get("file"), what)
    if not path.is_file():
        raise PlanError(f"{path}: {what} is missing")
    if file_hash(path) != entry.get("hash"):
        raise PlanError(f"{path}: {what} does not match the plan's hash (file changed since compile)")
    return path


def check_kv_cache(kv: dict, model, build, itemsize: dict) -> None:
    """model: one rank's (its num_kv_heads)."""
    from xserv_aot.kv_cache import check_scales, kv_dtype
    expected = [model.num_layers, 2, build.num_blocks, build.block_size, model.num_kv_heads, model.head_dim]
    shape, dtype = kv.get("shape"), kv_dtype(build)
    if shape != expected or kv.get("dtype") != dtype:
        raise PlanError(f"kv_cache: shape {shape} {kv.get('dtype')} does not match the model and build "
                             f"config ({expected} {dtype})")
    if kv.get("size") != math.prod(expected) * itemsize[dtype]:
        raise PlanError(f"kv_cache: size {kv.get('size')} does not match shape {expected} {dtype}")
    check_scales(kv, model.num_layers)

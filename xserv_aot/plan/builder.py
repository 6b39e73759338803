"""`xserv-aot compile`: checkpoint + build config -> plan directory, written atomically."""
from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from xserv_aot import __version__, kv_cache
from xserv_aot.config import BuildConfig, ConfigError
from xserv_aot.model_config import ModelConfig, read_hf_config
from xserv_aot.plan.generation_config import read_generation_defaults
from xserv_aot.plan.integrity import CHUNK_BYTES, fingerprint
from xserv_aot.plan.manifest import SCHEMA_VERSION, Plan, layout
from xserv_aot.plan.ops import arena_buffers, bucket_ops, bucket_shapes
from xserv_aot.plan.tensor_parallel import (check_divisible, local_model, local_shapes, manifest_section,
                                            rank_shards, tensor_sharding)
from xserv_aot.plan import fp8_calibrate, quantize
from xserv_aot.plan.weights import plan_tensors, weight_specs, write_rank_weights, write_weights

Progress = Callable[[str, int, int], None]   # (stage, done, total)


def read_source(source: Path, dummy: bool):
    """-> (ModelConfig, TensorSource | None, format). A .json file is a bare HF config (dummy weights only)."""
    source = Path(source)
    if not source.exists():
        raise ConfigError(f"{source}: no such file or directory")
    if source.suffix == ".json" and source.is_file():
        if not dummy:
            raise ConfigError(f"{source}: a bare config has no weights; pass --dummy-weights")
        return read_hf_config(source), None, "config"
    if dummy and source.is_dir():
        return read_hf_config(source), None, "config"
    from xserv_aot.checkpoint import open_checkpoint
    return open_checkpoint(source)


def source_tokenizer(source: Path, fmt: str):
    """The checkpoint's Tokenizer (a GGUF's own, or tokenizer.json beside the weights), None without one."""
    from xserv_aot.tokenizer import Tokenizer
    src_dir = source if source.is_dir() else source.parent
    if fmt == "gguf":
        return Tokenizer.from_gguf(source)
    if (src_dir / "tokenizer.json").is_file():
        return Tokenizer.from_dir(src_dir)
    return None


def save_tokenizer(source: Path, fmt: str, out: Path) -> bool:
    tok = source_tokenizer(source, fmt)
    if tok is not None:
        tok.save(out)
    return tok is not None


def full_tensor_shapes(m: ModelConfig, b: BuildConfig, schemes: dict[str, str] | None = None
                       ) -> dict[str, tuple[list[int], str]]:
    """(shape, dtype) of every plan tensor of the unsharded model, in plan order; schemes: its FP8 weights."""
    bufs = quantize.tensor_table(m, b, schemes or {})
    half = [b.max_seq_len, m.head_dim // 2]
    bufs["rope_cos"], bufs["rope_sin"] = (half, "float32"), (half, "float32")
    return bufs


def sharding_of(m: ModelConfig, b: BuildConfig) -> dict | None:
    """tensor name -> ShardSpec under tensor parallelism; None for a one-rank plan."""
    if b.tensor_parallel == 1:
        return None
    return tensor_sharding(m, b.tensor_parallel, list(full_tensor_shapes(m, b)))


def dummy_table(m: ModelConfig, b: BuildConfig, schemes: dict[str, str] | None = None) -> tuple[dict, int]:
    shapes, sharding = full_tensor_shapes(m, b, schemes), sharding_of(m, b)
    return layout(local_shapes(shapes, sharding) if sharding else shapes)


def compile_plan(source: Path, out: Path, build: BuildConfig, *, dummy_weights: bool = False, dummy_seed: int = 0,
                 force: bool = False, progress: Progress | None = None, generation_config: str = "auto") -> Plan:
    """generation_config: auto | vllm | PATH (plan/generation_config.py)."""
    source, out = Path(source), Path(out)
    build.validate()
    defaults = read_generation_defaults(source, generation_config)
    model, tensors, fmt = read_source(source, dummy_weights)
    if build.tensor_parallel > 1:
        check_divisible(model, build.tensor_parallel)
    stored, scales = stored_fp8(model, tensors)
    schemes = quantize.weight_schemes(model, build, stored)
    if schemes:
        check_fp8_build(build)
    if build.fp8_scale != "amax" and dummy_weights:
        raise ConfigError(f"fp8_scale {build.fp8_scale} fits scales to real weights; --dummy-weights has none "
                          f"(use amax)")
    calibration = None
    if schemes and fp8_calibrate.needs_calibration(build.fp8_rounding, build.fp8_scale):
        what = fp8_calibrate.setting(build.fp8_rounding, build.fp8_scale)
        fp8_calibrate.check_calibratable(source, stored, dummy_weights, what)
        calibration = fp8_calibrate.calibration_tokens(source, source_tokenizer(source, fmt), what)
    if build.max_seq_len > model.max_position_embeddings:
        raise ConfigError(f"max_seq_len {build.max_seq_len} exceeds the model's max_position_embeddings "
                          f"{model.max_position_embeddings}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with target_lock(out):
        check_target(source, out, force)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            manifest = _build(source, tmp, model, tensors, fmt, build, dummy_weights, dummy_seed, progress,
                              schemes, scales, calibration)
            manifest["generation_defaults"] = defaults
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            _replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return Plan.load(out, verify="none")


def stored_fp8(model: ModelConfig, tensors) -> tuple[dict[str, str], dict]:
    """A pre-quantized checkpoint's FP8 plan weights: (plan name -> scheme, plan name -> scales)."""
    if tensors is None or not hasattr(tensors, "plan_fp8"):
        return {}, {}
    return tensors.plan_fp8({k: v for k, v in weight_specs(model).items() if quantize.is_linear(k)})


def check_fp8_build(build: BuildConfig) -> None:
    quantize.check_target(build.target)
    if build.tensor_parallel > 1:
        raise ConfigError("FP8 weights with tensor_parallel > 1 are not supported yet; compile with tensor_parallel 1")


@contextlib.contextmanager
def target_lock(out: Path):
    """Exclusive, non-blocking lock on `.NAME.lock` next to the target; while held, any `.NAME.tmp-*` or
    `.NAME.old-*` directory is left over from a compile that died, and is removed."""
    path = out.with_name(f".{out.name}.lock")
    busy = ConfigError(f"{out}: another compile is writing this plan right now")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy from None
        if not path.exists() or os.stat(path).st_ino != os.fstat(fd).st_ino:
            raise busy                               # locked a file the previous holder had just unlinked
        try:
            for stale in out.parent.glob(f".{glob.escape(out.name)}.*-*"):
                if stale.is_dir() and stale.name.startswith((f".{out.name}.tmp-", f".{out.name}.old-")):
                    shutil.rmtree(stale, ignore_errors=True)
            yield
        finally:
            path.unlink()                            # still holding the lock
    finally:
        os.close(fd)


def check_target(source: Path, out: Path, force: bool) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise ConfigError(f"{out}: already exists (pass --force to replace it)")
    if not out.is_dir() or out.is_symlink() or not (out / "manifest.json").is_file():
        raise ConfigError(f"{out}: exists and is not a plan (no manifest.json); --force only replaces plans")
    src, dst = source.resolve(), out.resolve()
    if src == dst or src.is_relative_to(dst):
        raise ConfigError(f"{out}: holds the source model {source}; refusing to replace it")


def weights_file(name: str, size: int, chunks: list[str]) -> dict:
    """A weights file's manifest entry: its sha256 per CHUNK_BYTES chunk, fingerprint of those (plan-format.md)."""
    return {"file": name, "size": size, "fingerprint": fingerprint(chunks),
            "chunks": {"size": CHUNK_BYTES, "sha256": chunks}}


def weight_stream(model: ModelConfig, tensors, build: BuildConfig, schemes: dict, scales: dict,
                  calibration: list[list[int]] | None):
    """The plan's weights in order: FP8 ones rounded to nearest, or with calibration tokens calibrated
    (fp8_calibrate: GPTQ rounding, refitted scales)."""
    full = plan_tensors(model, tensors, build.max_seq_len)
    if calibration:
        return fp8_calibrate.calibrated_stream(full, model, schemes, calibration, build.fp8_scale,
                                               rounding=build.fp8_rounding, rounds=build.fp8_refit_rounds)
    return quantize.quantized_stream(full, schemes, model.tie_word_embeddings, scales, build.fp8_scale)


def _build(source, tmp, model, tensors, fmt, build, dummy, seed, progress, schemes, scales, calibration) -> dict:
    specs, tp, sharding = weight_specs(model), build.tensor_parallel, sharding_of(model, build)
    shapes = full_tensor_shapes(model, build, schemes)
    dtypes = {name: dt for name, (_, dt) in (local_shapes(shapes, sharding) if sharding else shapes).items()}
    if dummy:
        table, size = dummy_table(model, build, schemes)
        weights = {"file": None, "dummy_seed": seed, "size": size, "fingerprint": f"dummy:{seed}",
                   "tensors": {k: v.to_dict() for k, v in table.items()}}
    else:
        total, done = len(specs) + 2, [0]

        def tick(name):
            done[0] += 1
            if progress:
                progress("weights", done[0], total)

        full = weight_stream(model, tensors, build, schemes, scales, calibration)
        if sharding:
            names = [f"weights.rank{r}.bin" for r in range(tp)]
            written = write_rank_weights([tmp / n for n in names], rank_shards(full, sharding, tp), dtypes,
                                         tick, CHUNK_BYTES)
            table, size = written[0][0], written[0][1]         # every rank's table (and size) is the same
            files = [weights_file(n, sz, chunks) for n, (_, sz, chunks) in zip(names, written)]
            joint = fingerprint([f["fingerprint"] for f in files])
            weights = {"size": size, "fingerprint": f"sha256-ranks:{joint}", "files": files}
        else:
            table, size, chunks = write_weights(tmp / "weights.bin", full, dtypes, tick, CHUNK_BYTES)
            weights = weights_file("weights.bin", size, chunks)
        weights["tensors"] = {k: v.to_dict() for k, v in table.items()}
    if sharding:
        weights["sharding"] = {k: v.to_dict() for k, v in sharding.items()}
    has_tok = save_tokenizer(source, fmt, tmp) if fmt != "config" else False
    arena, arena_size = layout(arena_buffers(model, build, quantized=bool(schemes)))
    kv_heads = local_model(model, tp).num_kv_heads
    kv_shape = [model.num_layers, 2, build.num_blocks, build.block_size, kv_heads, model.head_dim]
    kv_section = {"shape": kv_shape, "dtype": kv_cache.kv_dtype(build),
                  "size": kv_cache.pool_bytes(kv_shape, kv_cache.kv_dtype(build))}
    if kv_cache.is_fp8(kv_section):
        kv_section["scales"] = kv_scales(model, build, tensors, dummy)
    buckets = [{"name": n, "kind": k, "num_tokens": t, "num_seqs": s,
                "ops": [op.to_dict() for op in bucket_ops(model, t, s, tp, quant=schemes,
                                                                 w8a16_max_rows=build.fp8_w8a16_max_rows)]}
               for n, k, t, s in bucket_shapes(build)]
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "xserv_aot_version": __version__,
        "source": {"path": str(source), "format": fmt, "tokenizer": has_tok},
        "model": model.to_dict(),
        "build": build.to_dict(),
        "weights": weights,
        "arena": {"size": arena_size, "buffers": {k: v.to_dict() for k, v in arena.items()}},
        "kv_cache": kv_section,
        "buckets": buckets,
        "kernels": {"target": build.target},
    }
    if tp > 1:
        manifest["tensor_parallel"] = manifest_section(model, tp)
    if schemes:
        rounding = fp8_calibrate.rounding_record(calibration, build.fp8_rounding, build.fp8_scale,
                                                 build.fp8_refit_rounds)
        manifest["quantization"] = quantize.manifest_section(schemes, scales, getattr(tensors, "ignored_inputs", []),
                                                             rounding, build.fp8_scale)
    if kv_cache.is_fp8(kv_section) and build.kv_cache_scales == "calibrate":
        if not has_tok:
            raise ConfigError("kv_cache_scales calibrate needs the model's tokenizer (tokenizer.json or GGUF)")
        from xserv_aot.plan.kv_calibrate import calibrate
        kv_section["scales"] = calibrate(tmp, manifest)
    if build.target != "cpu":
        from xserv_aot.plan.kernel_build import build_kernels
        manifest["kernels"] = build_kernels(manifest, tmp, build.target, progress=progress)
    return manifest


def kv_scales(model: ModelConfig, build: BuildConfig, tensors, dummy: bool) -> dict | None:
    """The per-layer scales of an FP8 KV pool: the checkpoint's (checkpoint/kv_scales.py), else DEFAULT_SCALE;
    None for kv_cache_scales calibrate (plan/kv_calibrate.py, run by _build once the weights are written)."""
    if build.kv_cache_scales == "calibrate":
        if dummy or tensors is None:
            raise ConfigError("kv_cache_scales calibrate needs real weights (a --dummy-weights plan has nothing to "
                              "calibrate on)")
        return None                                          # _build measures them once the weights are written
    found = getattr(tensors, "kv_scales", lambda layers: None)(model.num_layers)
    if found is not None:
        return kv_cache.scales_section(*found, "checkpoint")
    unit = [kv_cache.DEFAULT_SCALE] * model.num_layers
    return kv_cache.scales_section(unit, unit, "default")


def _replace_dir(tmp: Path, out: Path) -> None:
    """Swap tmp into place: out is either the old plan or the new one, never a mix."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)

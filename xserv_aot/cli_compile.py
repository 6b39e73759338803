"""The work of `xserv-aot compile` (its options are declared in cli.py): the build config from a JSON file with the
command-line options over it, the default target and decode buckets, the KV pool sized from --kv-memory, and the
compile itself under a progress bar."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Optional

import typer

from xserv_aot.errors import UsageError, one_line


def read_json_file(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except OSError as e:
        raise UsageError(f"{path}: cannot read the {what} ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: the {what} is not valid JSON ({one_line(e)})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{path}: the {what} must be a JSON object")
    return value


def build_settings(base: dict, given: dict) -> dict:
    """base (the build config file's settings, updated in place) with every option that was given over it; target
    cpu (with a note) when none is set and cuda-python is missing; decode buckets from --max-num-seqs when none are
    set."""
    base.update({k: v for k, v in given.items() if v is not None})
    if "target" not in base:
        from xserv_aot.runtime.select import CUDA_EXTRA_HINT, cuda_python_available
        if not cuda_python_available():
            base["target"] = "cpu"
            typer.secho(f"note: cuda-python is not installed, so this plan targets the CPU (--target cpu); "
                        f"{CUDA_EXTRA_HINT} for GPU plans", fg="yellow", err=True)
    max_num_seqs = given["max_num_seqs"]
    if max_num_seqs and not given["decode_buckets"] and "decode_buckets" not in base:
        base["decode_buckets"] = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_num_seqs] + [max_num_seqs]
    return base


def kv_blocks_for_memory(model: Path, build, gib: float, dummy: bool) -> int:
    """KV blocks that fit `gib` GiB: a block of an fp8_e4m3 pool takes half the bytes of a bfloat16 one."""
    from xserv_aot.dtypes import ITEMSIZE
    from xserv_aot.kv_cache import kv_dtype
    from xserv_aot.plan.builder import read_source

    m, _, _ = read_source(model, dummy)
    per_block = m.num_layers * 2 * build.block_size * m.num_kv_heads * m.head_dim * ITEMSIZE[kv_dtype(build)]
    return max(1, int(gib * 2**30) // per_block)


def run_compile(model: Path, out: Path, base: dict, given: dict, kv_memory_gib: Optional[float], dummy_weights: bool,
                seed: int, force: bool, generation_config: str) -> None:
    """base: the --build-config file's settings ({} without one); given: the build options of the command line
    (None where not given)."""
    from rich.progress import Progress

    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan

    build = BuildConfig.from_dict(build_settings(base, given)).validate()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # unwind: the temp directory is removed
    if kv_memory_gib is not None:
        build.num_blocks = kv_blocks_for_memory(model, build, kv_memory_gib, dummy_weights)
    with Progress(transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int):
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        plan = compile_plan(model, out, build, dummy_weights=dummy_weights, dummy_seed=seed, force=force,
                            progress=progress, generation_config=generation_config)
    typer.echo(f"wrote plan {out} ({plan.model.arch}, {len(plan.buckets)} buckets, "
               f"weights {plan.manifest['weights']['size'] / 2**20:.1f} MiB, KV pool {plan.build.num_blocks} blocks)")

"""`xserv-aot profile --nsys / --ncu`: the Nsight command lines, and ncu's report read back beside the plan's counts
and the event-timed step.

Both re-run `xserv-aot profile` under the tool (`python -m xserv_aot.cli`, so a PYTHONPATH checkout works). nsys
traces the usual per-op + graph profile of a bucket with NVTX ranges (`--trace cuda,nvtx`).

ncu runs one eager step of the bucket (`--one-step`: profile.run_one_step) with the profiler on only for the ops
ncu_report.profiled_ops picks (`--layers N`: the first N decoder layers and the ops outside them: embedding, final
norm, head, sampling; the child brackets them with cuProfilerStart/Stop, `--profile-from-start off`), with
`--clock-control none --cache-control all --nvtx` and ncu_report.NCU_METRICS, which take one replay pass per kernel
(all ~330 kernels of a decode_64 step of Qwen3-8B: 15 s for the whole process on the H200). `--all-metrics` adds
EXTRA_METRICS (DRAM %, SM %, occupancy): more passes, and before each further pass ncu restores the memory the kernel
may write, which the 8B plan's 110 GB of weights and KV pool make slow (last session: > 150 s for one step); keep
--layers small with it. The report (.ncu-rep) is read back twice with `--import ... --csv --page details
--print-units base --print-metric-name name` (one row per kernel and metric: "ID", ..., "Kernel Name", ...,
"Metric Name", "Metric Unit", "Metric Value"), then with `--print-nvtx-rename kernel` (each kernel named
"RANGE/KERNEL" by its innermost NVTX push/pop range: the op's name, op_name); kernels are matched to the plan by
the first read's real names and paired with their ranges by ID.

After ncu, a second child of the same command line, not under ncu (events_command), times the same step with CUDA
events inside one graph replay (profile.op_times) and writes the times to a JSON file: ncu_report.format_ncu sets
them beside ncu's. Not in ncu's child: under ncu every launch is intercepted even with the profiler off, which on
the H200 made each op of a decode_1 graph replay take ~90 us (2026-12-01, docs/benchmarks/2026-12-01-session3-h200.md).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from xserv_aot.errors import UsageError, XservError
from xserv_aot.runtime.ncu_report import (DEFAULT_LAYERS, EXTRA_METRICS, NCU_METRICS, format_ncu, parse_kernel_names,
                                          parse_ncu_csv)

NCU_OPTIONS = ("--clock-control", "none", "--cache-control", "all", "--profile-from-start", "off", "--nvtx")


def _self_command(plan_dir: Path, bucket: str, context: int) -> list[str]:
    return [sys.executable, "-m", "xserv_aot.cli", "profile", str(plan_dir), "--bucket", bucket,
            "--context", str(context), "--nvtx"]


def nsys_command(plan_dir: Path, bucket: str, context: int, out: Path) -> list[str]:
    return ["nsys", "profile", "--trace", "cuda,nvtx", "--output", str(out), "--force-overwrite", "true",
            *_self_command(plan_dir, bucket, context)]


def ncu_command(plan_dir: Path, bucket: str, context: int, report: Path,
                layers: int = DEFAULT_LAYERS, kernel: str | None = None, all_metrics: bool = False) -> list[str]:
    metrics = NCU_METRICS + (EXTRA_METRICS if all_metrics else ())
    cmd = ["ncu", *NCU_OPTIONS, "--metrics", ",".join(metrics), "--export", str(report), "--force-overwrite"]
    if kernel:
        cmd += ["--kernel-name", f"regex:{kernel}"]
    return cmd + _self_command(plan_dir, bucket, context) + ["--one-step", "--layers", str(layers)]


def events_command(plan_dir: Path, bucket: str, context: int, events: Path, layers: int = DEFAULT_LAYERS) -> list[str]:
    """The event-timed run of the same step, outside ncu (its profiler calls are no-ops there)."""
    return _self_command(plan_dir, bucket, context) + ["--one-step", "--layers", str(layers), "--events-out",
                                                        str(events)]


def ncu_import_command(report: Path, nvtx_names: bool = False) -> list[str]:
    cmd = ["ncu", "--import", str(report), "--csv", "--page", "details", "--print-units", "base",
           "--print-metric-name", "name"]
    return cmd + ["--print-nvtx-rename", "kernel"] if nvtx_names else cmd


def report_path(out: Path) -> Path:
    """Where ncu --export puts a report: ".ncu-rep" appended unless there."""
    return out if out.name.endswith(".ncu-rep") else out.with_name(out.name + ".ncu-rep")


class ToolError(XservError, RuntimeError):
    """Nsight missing from PATH or failing; one line."""


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        other = "--ncu" if name == "nsys" else "--nsys"
        raise ToolError(f"{name} is not on PATH (install Nsight {'Systems' if name == 'nsys' else 'Compute'}, "
                           f"or use {other} or plain `xserv-aot profile` with CUDA events)")
    return path


def _plan_bucket(plan_dir: Path, bucket: str):
    from xserv_aot.plan.manifest import Plan

    plan = Plan.load(plan_dir, verify="none")
    bk = next((b for b in plan.buckets if b.name == bucket), None)
    if bk is None:
        raise UsageError(f"no bucket {bucket!r} (have: {', '.join(b.name for b in plan.buckets)})")
    return plan, bk


def _run(cmd: list[str], tool: str, capture: bool = False) -> str:
    import subprocess

    r = subprocess.run(cmd, stdout=subprocess.PIPE if capture else None, text=True)
    if r.returncode != 0:
        raise ToolError(f"{tool} exited with status {r.returncode}: {' '.join(cmd)}")
    return r.stdout or ""


def run_nsys(plan_dir: Path, bucket: str, context: int, out: Path | None) -> str:
    require_tool("nsys")
    _plan_bucket(plan_dir, bucket)
    out = Path(out) if out is not None else Path(f"xserv-{bucket}")
    _run(nsys_command(plan_dir, bucket, context, out), "nsys")
    report = out if out.suffix == ".nsys-rep" else out.with_name(out.name + ".nsys-rep")
    return f"nsys report: {report}"


def run_ncu(plan_dir: Path, bucket: str, context: int, kernel: str | None, layers: int | None = None,
            out: Path | None = None, all_metrics: bool = False) -> str:
    """ncu on one step (ncu_command), its report read back (ncu_import_command, twice) and format_ncu's table;
    the report stays at --out (report_path), else in a temporary directory removed after. layers: None for
    DEFAULT_LAYERS."""
    import tempfile

    require_tool("ncu")
    layers = DEFAULT_LAYERS if layers is None else layers
    plan, bk = _plan_bucket(plan_dir, bucket)
    with tempfile.TemporaryDirectory() as d:
        report = report_path(Path(out)) if out is not None else Path(d) / f"{bucket}.ncu-rep"
        report.parent.mkdir(parents=True, exist_ok=True)
        events_path = Path(d) / "events.json"
        _run(ncu_command(plan_dir, bucket, context, report, layers, kernel, all_metrics), "ncu")
        try:
            _run(events_command(plan_dir, bucket, context, events_path, layers), "the event-timed step")
        except ToolError:
            pass                                     # the table says it has no event times

        kernels = parse_ncu_csv(_run(ncu_import_command(report), "ncu --import", capture=True))
        try:
            names = parse_kernel_names(_run(ncu_import_command(report, nvtx_names=True), "ncu --import", True))
        except (ToolError, ValueError):
            names = {}
        events = json.loads(events_path.read_text()) if events_path.is_file() else None
    table = format_ncu(plan, bk, context, kernels, kernel, layers, events, names)
    return table + (f"\nncu report: {report}" if out is not None else "")

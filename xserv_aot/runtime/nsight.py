"""`xserv-aot profile --nsys / --ncu`: the Nsight command lines, and ncu's CSV read back beside the plan's counts.

Both re-run `xserv-aot profile` under the tool (`python -m xserv_aot.cli`, so a PYTHONPATH checkout works):
nsys traces the usual per-op + graph profile of a bucket with NVTX ranges (`--trace cuda,nvtx`); ncu profiles one
eager step of the bucket (`--one-step`: the kernels between cuProfilerStart/Stop only, `--profile-from-start off`)
with `--clock-control none` and the metrics below, written as CSV (`--csv --page details --print-units base`,
one row per kernel and metric: "ID", ..., "Kernel Name", ..., "Metric Name", "Metric Unit", "Metric Value").
"""
from __future__ import annotations

import csv
import io
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from xserv_aot.plan.op_records import LaunchRecord

TIME, DRAM_READ, DRAM_WRITE = "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum"
DRAM_PCT = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
SM_PCT = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
NCU_METRICS = (TIME, DRAM_READ, DRAM_WRITE, DRAM_PCT, SM_PCT, OCCUPANCY)
LIBRARY_KERNELS = {"gemm_library": "cutlass"}      # a library call's kernels: names containing this
UNITS = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3, "second": 1.0,
         "s": 1.0, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "%": 1.0, "": 1.0}


def _self_command(plan_dir: Path, bucket: str, context: int) -> list[str]:
    return [sys.executable, "-m", "xserv_aot.cli", "profile", str(plan_dir), "--bucket", bucket,
            "--context", str(context), "--nvtx"]


def nsys_command(plan_dir: Path, bucket: str, context: int, out: Path) -> list[str]:
    return ["nsys", "profile", "--trace", "cuda,nvtx", "--output", str(out), "--force-overwrite", "true",
            *_self_command(plan_dir, bucket, context)]


def ncu_command(plan_dir: Path, bucket: str, context: int, csv_path: Path, kernel: str | None = None) -> list[str]:
    cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--nvtx",
           "--metrics", ",".join(NCU_METRICS), "--csv", "--page", "details", "--print-units", "base",
           "--log-file", str(csv_path)]
    if kernel:
        cmd += ["--kernel-name", f"regex:{kernel}"]
    return cmd + _self_command(plan_dir, bucket, context) + ["--one-step"]


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        other = "--ncu" if name == "nsys" else "--nsys"
        raise RuntimeError(f"{name} is not on PATH (install Nsight {'Systems' if name == 'nsys' else 'Compute'}, "
                           f"or use {other} or plain `xserv-aot profile` with CUDA events)")
    return path


@dataclass
class KernelMetrics:
    id: int
    name: str
    metrics: dict[str, float] = field(default_factory=dict)      # base units: seconds, bytes, percent

    @property
    def dram_gb_per_s(self) -> float:
        t = self.metrics.get(TIME, 0.0)
        return (self.metrics.get(DRAM_READ, 0.0) + self.metrics.get(DRAM_WRITE, 0.0)) / t / 1e9 if t > 0 else 0.0


def _number(text: str, unit: str) -> float:
    if unit not in UNITS:
        raise ValueError(f"ncu CSV: unknown unit {unit!r}")
    return float(text.replace(",", "")) * UNITS[unit]


def parse_ncu_csv(text: str) -> list[KernelMetrics]:
    """Kernels in launch order; lines before the CSV header (==PROF== messages, program output) are skipped."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError("ncu CSV: no header row (no kernel was profiled?)")
    kernels: dict[int, KernelMetrics] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not row.get("ID", "").strip().isdigit():
            continue
        k = kernels.setdefault(int(row["ID"]), KernelMetrics(int(row["ID"]), row["Kernel Name"]))
        k.metrics[row["Metric Name"]] = _number(row["Metric Value"], row.get("Metric Unit") or "")
    return [kernels[i] for i in sorted(kernels)]


def plan_launches(bucket) -> list[tuple[int, object, LaunchRecord]]:
    """(op index, op, launch record) for every launch of the bucket, in order (an op may have several)."""
    return [(i, op, rec) for i, op in enumerate(bucket.ops) if op.cuda for rec in op.cuda.launch]


def kernel_base_name(name: str) -> str:
    """ncu's demangled name without return type and parameters: "void f<T>(int)" -> "f<T>"; extern "C" names
    are unchanged."""
    return name.removeprefix("void ").split("(", 1)[0].strip()


def launch_matches(rec: LaunchRecord, kernel_name: str) -> bool:
    """A kernel record by its function name; a library call by its library's kernel names (LIBRARY_KERNELS)."""
    if rec.library:
        return LIBRARY_KERNELS.get(rec.library, rec.library) in kernel_name
    return kernel_base_name(kernel_name) == rec.fn


def match_kernels(kernels: list[KernelMetrics], bucket, kernel_filter: str | None = None) -> list[tuple]:
    """[(KernelMetrics, op index | None, op | None, first kernel of that op)], in launch order. A kernel takes the
    next plan launch it matches (skipped launches were filtered out or not profiled); further kernels of the
    library a call just ran (CUTLASS runs more than one for some problems) stay with that call's op; a kernel no
    launch matches gets no op and consumes nothing. kernel_filter: the --kernel regex, applied to kernel records'
    function names (library calls are kept: ncu applies the regex to their real kernel names)."""
    import re
    expected = [x for x in plan_launches(bucket)
                if kernel_filter is None or x[2].library or re.search(kernel_filter, x[2].fn)]
    out, j, seen, last_call = [], 0, set(), None
    for k in kernels:
        if (last_call is not None and launch_matches(last_call[2], k.name)
                and not (j < len(expected) and launch_matches(expected[j][2], k.name))):
            out.append((k, last_call[0], last_call[1], False))
            continue
        at = next((n for n in range(j, len(expected)) if launch_matches(expected[n][2], k.name)), None)
        if at is None:
            out.append((k, None, None, False))
            continue
        i, op, rec = expected[at]
        out.append((k, i, op, i not in seen))
        seen.add(i)
        j, last_call = at + 1, expected[at] if rec.library else None
    return out


def format_ncu(plan, bucket, context: int, kernels: list[KernelMetrics], kernel_filter: str | None = None) -> str:
    from xserv_aot.plan.roofline import bucket_costs, ceilings_for

    c = ceilings_for(plan.build.target)
    costs = {i: (b, f) for i, _, b, f in bucket_costs(plan, bucket, context)}
    lines = [f"ncu, one eager step of {bucket.name} at context {context} (--clock-control none); plan bytes and FLOPs "
             f"per op (on its first kernel), ceilings {c.read_bytes_per_s / 1e12:.1f} TB/s, {c.flops_per_s / 1e12:.0f} TFLOP/s",
             f"{'op':>4} {'kernel':40s} {'us':>8} {'DRAM GB/s':>9} {'DRAM %':>6} {'SM %':>6} {'occ %':>6} "
             f"{'plan MB':>8} {'plan GFLOP':>10} {'plan GB/s':>9}"]
    for k, i, op, first in match_kernels(kernels, bucket, kernel_filter):
        m, t = k.metrics, k.metrics.get(TIME, 0.0)
        nbytes, flops = costs.get(i, (0, 0)) if first else (0, 0)
        plan_cols = (f"{nbytes / 1e6:8.2f} {flops / 1e9:10.3f} {nbytes / t / 1e9 if t > 0 else 0:9.0f}" if first
                     else f"{'':8} {'':10} {'':9}")
        lines.append(f"{'' if i is None else i:>4} {k.name[:40]:40s} {t * 1e6:8.2f} {k.dram_gb_per_s:9.0f} "
                     f"{m.get(DRAM_PCT, 0):6.1f} {m.get(SM_PCT, 0):6.1f} {m.get(OCCUPANCY, 0):6.1f} {plan_cols}")
    return "\n".join(lines)


def _plan_bucket(plan_dir: Path, bucket: str):
    from xserv_aot.plan.manifest import Plan

    plan = Plan.load(plan_dir, verify="none")
    bk = next((b for b in plan.buckets if b.name == bucket), None)
    if bk is None:
        raise ValueError(f"no bucket {bucket!r} (have: {', '.join(b.name for b in plan.buckets)})")
    return plan, bk


def _run(cmd: list[str], tool: str) -> None:
    import subprocess

    rc = subprocess.run(cmd).returncode
    if rc != 0:
        raise RuntimeError(f"{tool} exited with status {rc}: {' '.join(cmd)}")


def run_nsys(plan_dir: Path, bucket: str, context: int, out: Path | None) -> str:
    require_tool("nsys")
    _plan_bucket(plan_dir, bucket)
    out = Path(out) if out is not None else Path(f"xserv-{bucket}")
    _run(nsys_command(plan_dir, bucket, context, out), "nsys")
    report = out if out.suffix == ".nsys-rep" else out.with_name(out.name + ".nsys-rep")
    return f"nsys report: {report}"


def run_ncu(plan_dir: Path, bucket: str, context: int, kernel: str | None) -> str:
    import tempfile

    require_tool("ncu")
    plan, bk = _plan_bucket(plan_dir, bucket)
    with tempfile.TemporaryDirectory() as d:
        csv_path = Path(d) / "ncu.csv"
        _run(ncu_command(plan_dir, bucket, context, csv_path, kernel), "ncu")
        kernels = parse_ncu_csv(csv_path.read_text())
    return format_ncu(plan, bk, context, kernels, kernel)

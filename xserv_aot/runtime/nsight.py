"""`xserv-aot profile --nsys / --ncu`: the Nsight command lines, and ncu's report read back beside the plan's counts
and the event-timed step.

Both re-run `xserv-aot profile` under the tool (`python -m xserv_aot.cli`, so a PYTHONPATH checkout works). nsys
traces the usual per-op + graph profile of a bucket with NVTX ranges (`--trace cuda,nvtx`).

ncu runs one eager step of the bucket (`--one-step`: profile.run_one_step) with the profiler on only for the ops
profiled_ops picks (`--layers N`: the first N decoder layers and the ops outside the layers: embedding, final norm,
head, sampling; the child brackets them with cuProfilerStart/Stop, `--profile-from-start off`), so an 8B model's
~300 kernels cost ~25 kernel replays. `--clock-control none --cache-control all --nvtx`, the metrics below, into an
.ncu-rep report, read back twice with `--import ... --csv --page details --print-units base --print-metric-name name`
(one row per kernel and metric: "ID", ..., "Kernel Name", ..., "Metric Name", "Metric Unit", "Metric Value"), then with
`--print-nvtx-rename kernel` (each kernel named by its innermost NVTX push/pop range: the op's name, op_name).

Before the profiled step, with the profiler off, the child times the same step with CUDA events inside one graph
replay (profile.op_times) and writes the times to a JSON file; the table sets ncu's DRAM GB/s beside plan bytes /
event time and their ratio. They are two runs and can differ:
- ncu flushes the caches before each replayed kernel (--cache-control all), so every byte comes from DRAM and the
  kernel runs alone; in the graph replay an op whose inputs are still in L2 (an activation just written, a weight
  that fits in the 50 MB L2 when the op before did not evict it) reads them from L2, so its event-timed GB/s can
  exceed what DRAM gave ncu;
- ncu times the kernel alone (gpu__time_duration); the event interval also holds the node-to-node launch latency
  (about a microsecond: 10% of a 10 us kernel) and every kernel of the op (split-K reductions; the ratio sums the
  op's kernels);
- plan bytes are a floor (inputs once, outputs once); DRAM bytes are what the kernels moved.
The agreement line counts the ops of >= AGREE_MIN_BYTES of plan bytes (smaller ones are latency, not bandwidth).
"""
from __future__ import annotations

import csv
import io
import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from xserv_aot.errors import UsageError, XservError
from xserv_aot.plan.op_records import LaunchRecord
from xserv_aot.plan.roofline import launches, op_layer, op_name

TIME, DRAM_READ, DRAM_WRITE = "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum"
DRAM_PCT = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
SM_PCT = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
NCU_METRICS = (TIME, DRAM_READ, DRAM_WRITE, DRAM_PCT, SM_PCT, OCCUPANCY)
NCU_OPTIONS = ("--clock-control", "none", "--cache-control", "all", "--profile-from-start", "off", "--nvtx")
DEFAULT_LAYERS = 2                                   # decode_64 of Qwen3-8B: ~25 kernels under ncu
AGREE_MIN_BYTES, AGREE_TOLERANCE = 4e6, 0.10
LIBRARY_KERNELS = {"gemm_library": "cutlass"}      # a library call's kernels: names containing this
UNITS = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3, "second": 1.0,
         "s": 1.0, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "%": 1.0, "": 1.0}
TIMING = {"graph": "events inside one graph replay", "eager": "events between eager launches"}


def _self_command(plan_dir: Path, bucket: str, context: int) -> list[str]:
    return [sys.executable, "-m", "xserv_aot.cli", "profile", str(plan_dir), "--bucket", bucket,
            "--context", str(context), "--nvtx"]


def nsys_command(plan_dir: Path, bucket: str, context: int, out: Path) -> list[str]:
    return ["nsys", "profile", "--trace", "cuda,nvtx", "--output", str(out), "--force-overwrite", "true",
            *_self_command(plan_dir, bucket, context)]


def ncu_command(plan_dir: Path, bucket: str, context: int, report: Path, events: Path,
                layers: int = DEFAULT_LAYERS, kernel: str | None = None) -> list[str]:
    cmd = ["ncu", *NCU_OPTIONS, "--metrics", ",".join(NCU_METRICS), "--export", str(report), "--force-overwrite"]
    if kernel:
        cmd += ["--kernel-name", f"regex:{kernel}"]
    return cmd + _self_command(plan_dir, bucket, context) + ["--one-step", "--layers", str(layers),
                                                            "--events-out", str(events)]


def ncu_import_command(report: Path, nvtx_names: bool = False) -> list[str]:
    cmd = ["ncu", "--import", str(report), "--csv", "--page", "details", "--print-units", "base",
           "--print-metric-name", "name"]
    return cmd + ["--print-nvtx-rename", "kernel"] if nvtx_names else cmd


def report_path(out: Path) -> Path:
    """Where ncu --export puts a report: ".ncu-rep" appended unless there."""
    return out if out.name.endswith(".ncu-rep") else out.with_name(out.name + ".ncu-rep")


def profiled_ops(bucket, layers: int) -> set[int]:
    """The launching ops `--layers N` profiles: those of decoder layers 0..N-1 and those outside the layers
    (embedding, final norm, head, sampling); every launching op for 0."""
    return {i for i, op in enumerate(bucket.ops) if launches(op)
            and (layers == 0 or op_layer(op) is None or op_layer(op) < layers)}


class ToolError(XservError, RuntimeError):
    """Nsight missing from PATH or failing; one line."""


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        other = "--ncu" if name == "nsys" else "--nsys"
        raise ToolError(f"{name} is not on PATH (install Nsight {'Systems' if name == 'nsys' else 'Compute'}, "
                           f"or use {other} or plain `xserv-aot profile` with CUDA events)")
    return path


@dataclass
class KernelMetrics:
    id: int
    name: str
    metrics: dict[str, float] = field(default_factory=dict)      # base units: seconds, bytes, percent

    @property
    def dram_bytes(self) -> float:
        return self.metrics.get(DRAM_READ, 0.0) + self.metrics.get(DRAM_WRITE, 0.0)

    @property
    def dram_gb_per_s(self) -> float:
        t = self.metrics.get(TIME, 0.0)
        return self.dram_bytes / t / 1e9 if t > 0 else 0.0


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", ""))
        return True
    except ValueError:
        return False


def _number(text: str, unit: str) -> float:
    if unit not in UNITS:
        raise ValueError(f"ncu CSV: unknown unit {unit!r}")
    return float(text.replace(",", "")) * UNITS[unit]


def _csv_rows(text: str):
    """The rows of ncu's details CSV; lines before its header (==PROF== messages, program output) are skipped."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError("ncu CSV: no header row (no kernel was profiled?)")
    return [r for r in csv.DictReader(io.StringIO("\n".join(lines[start:]))) if r.get("ID", "").strip().isdigit()]


def parse_ncu_csv(text: str) -> list[KernelMetrics]:
    """Kernels in launch order, with the NCU_METRICS ncu gave a number for, in base units (rows of other sections
    and "n/a" values are left out)."""
    kernels: dict[int, KernelMetrics] = {}
    for row in _csv_rows(text):
        k = kernels.setdefault(int(row["ID"]), KernelMetrics(int(row["ID"]), row["Kernel Name"]))
        if row["Metric Name"] in NCU_METRICS and _is_number(row["Metric Value"]):
            k.metrics[row["Metric Name"]] = _number(row["Metric Value"], row.get("Metric Unit") or "")
    return [kernels[i] for i in sorted(kernels)]


def parse_kernel_names(text: str) -> dict[int, str]:
    """{ID: Kernel Name}: with --print-nvtx-rename kernel, the innermost NVTX range of each kernel."""
    return {int(r["ID"]): r["Kernel Name"] for r in _csv_rows(text)}


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


def match_kernels(kernels: list[KernelMetrics], bucket, kernel_filter: str | None = None,
                  ops: set[int] | None = None) -> list[tuple]:
    """[(KernelMetrics, op index | None, op | None, first kernel of that op)], in launch order. A kernel takes the
    next plan launch it matches (skipped launches were filtered out or not profiled); further kernels of the
    library a call just ran (CUTLASS runs more than one for some problems) stay with that call's op; a kernel no
    launch matches gets no op and consumes nothing. kernel_filter: the --kernel regex, applied to kernel records'
    function names (library calls are kept: ncu applies the regex to their real kernel names); ops: the op indices
    profiled (profiled_ops), None for all."""
    expected = [x for x in plan_launches(bucket) if (ops is None or x[0] in ops)
                and (kernel_filter is None or x[2].library or re.search(kernel_filter, x[2].fn))]
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


def op_dram(matched: list[tuple]) -> dict[int, tuple[float, float]]:
    """{op index: (DRAM bytes, ncu seconds)} summed over the op's profiled kernels."""
    out: dict[int, tuple[float, float]] = {}
    for k, i, _, _ in matched:
        if i is not None:
            b, t = out.get(i, (0.0, 0.0))
            out[i] = (b + k.dram_bytes, t + k.metrics.get(TIME, 0.0))
    return out


def agreement(ratios: list[float]) -> str:
    ok = sum(abs(r - 1) <= AGREE_TOLERANCE for r in ratios)
    spread = f" (ncu/event {min(ratios):.2f} - {max(ratios):.2f})" if ratios else ""
    return (f"agreement: {ok} of {len(ratios)} ops of >= {AGREE_MIN_BYTES / 1e6:.0f} MB of plan bytes have ncu "
            f"DRAM GB/s within {AGREE_TOLERANCE:.0%} of the event-timed GB/s{spread}")


def format_ncu(plan, bucket, context: int, kernels: list[KernelMetrics], kernel_filter: str | None = None,
               layers: int = 0, events: dict | None = None, nvtx_names: dict[int, str] | None = None) -> str:
    """One row per profiled kernel: ncu's time, DRAM GB/s (read + write bytes / time), DRAM and SM throughput and
    occupancy; on an op's first kernel the plan's bytes and FLOPs, the op's event time (events: run_one_step's JSON)
    and plan bytes / event time, and the ratio of the op's ncu DRAM GB/s (all its kernels) to that; the kernel's
    NVTX range (nvtx_names). Then the agreement and NVTX lines."""
    from xserv_aot.plan.roofline import bucket_costs, ceilings_for

    c = ceilings_for(plan.build.target)
    costs = {i: (b, f) for i, _, b, f in bucket_costs(plan, bucket, context)}
    ev_ms = {int(i): ms for i, ms in (events or {}).get("ops", {}).items()}
    nvtx_names = nvtx_names or {}
    matched = match_kernels(kernels, bucket, kernel_filter, profiled_ops(bucket, layers))
    dram = op_dram(matched)
    lines = [f"ncu, one eager step of {bucket.name} at context {context} (--clock-control none --cache-control all; "
             f"{f'layers 0-{layers - 1} and the ops outside the layers' if layers else 'every layer'}); plan bytes, "
             f"FLOPs and event times per op on its first kernel; ceilings {c.read_bytes_per_s / 1e12:.1f} TB/s, "
             f"{c.flops_per_s / 1e12:.0f} TFLOP/s",
             f"{'op':>4} {'kernel':36s} {'us':>8} {'DRAM GB/s':>9} {'DRAM %':>6} {'SM %':>6} {'occ %':>6} "
             f"{'plan MB':>8} {'GFLOP':>8} {'ev us':>8} {'ev GB/s':>8} {'ncu/ev':>6} nvtx range"]
    ratios, named = [], 0
    for k, i, op, first in matched:
        m, t = k.metrics, k.metrics.get(TIME, 0.0)
        cols = f"{'':8} {'':8} {'':8} {'':8} {'':6}"
        if first:
            nbytes, flops = costs.get(i, (0, 0))
            ms = ev_ms.get(i)
            ev_gbs = nbytes / (ms * 1e-3) / 1e9 if ms else 0.0
            b, tk = dram[i]
            ratio = b / tk / 1e9 / ev_gbs if ev_gbs > 0 and tk > 0 else None
            if ratio is not None and nbytes >= AGREE_MIN_BYTES:
                ratios.append(ratio)
            cols = (f"{nbytes / 1e6:8.2f} {flops / 1e9:8.3f} {ms * 1e3 if ms else 0:8.2f} {ev_gbs:8.0f} "
                    f"{ratio if ratio is not None else 0:6.2f}")
        rng = nvtx_names.get(k.id, k.name)
        named += i is not None and op_name(bucket.name, i, op) in rng
        lines.append(f"{'' if i is None else i:>4} {k.name[:36]:36s} {t * 1e6:8.2f} {k.dram_gb_per_s:9.0f} "
                     f"{m.get(DRAM_PCT, 0):6.1f} {m.get(SM_PCT, 0):6.1f} {m.get(OCCUPANCY, 0):6.1f} {cols} "
                     f"{rng if rng != k.name else '-'}")
    lines.append(agreement(ratios) + (f"; events: {TIMING[events['timing']]}" if events else
                                      "; no event times (the profiled child wrote none)"))
    lines.append(f"nvtx: {named} of {len(matched)} profiled kernels carry their op's NVTX range"
                 if nvtx_names else "nvtx: ncu gave no NVTX range names (--print-nvtx-rename kernel)")
    return "\n".join(lines)


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
            out: Path | None = None) -> str:
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
        _run(ncu_command(plan_dir, bucket, context, report, events_path, layers, kernel), "ncu")
        kernels = parse_ncu_csv(_run(ncu_import_command(report), "ncu --import", capture=True))
        try:
            names = parse_kernel_names(_run(ncu_import_command(report, nvtx_names=True), "ncu --import", True))
        except (ToolError, ValueError):
            names = {}
        events = json.loads(events_path.read_text()) if events_path.is_file() else None
    table = format_ncu(plan, bk, context, kernels, kernel, layers, events, names)
    return table + (f"\nncu report: {report}" if out is not None else "")

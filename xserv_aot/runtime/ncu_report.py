"""ncu's report read back beside the plan: `ncu --import --csv --page details` parsed, its kernels matched to
the plan's launch records, the ops `--layers N` profiles, and the `profile --ncu` table with the event-timed GB/s
of the same ops (profile.op_times: CUDA events inside one graph replay of the step) and their ratio to ncu's.

ncu's DRAM GB/s and plan bytes / event time are two runs and can differ:
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
import re
from dataclasses import dataclass, field

from xserv_aot.plan.op_records import LaunchRecord
from xserv_aot.plan.roofline import launches, op_layer, op_name

TIME, DRAM_READ, DRAM_WRITE = "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum"
DRAM_PCT = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
SM_PCT = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
NCU_METRICS = (TIME, DRAM_READ, DRAM_WRITE)            # one replay pass per kernel
EXTRA_METRICS = (DRAM_PCT, SM_PCT, OCCUPANCY)           # --all-metrics: more passes, each saving and restoring the
                                                        # memory the kernel may write (slow with a large KV pool)
DEFAULT_LAYERS = 2                          # decode_64 of Qwen3-8B: 23 of its 331 kernels
AGREE_MIN_BYTES, AGREE_TOLERANCE = 4e6, 0.10
LIBRARY_KERNELS = {"gemm_library": "cutlass"}      # a library call's kernels: names containing this
UNITS = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3, "second": 1.0,
         "s": 1.0, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "%": 1.0, "": 1.0}
TIMING = {"graph": "events inside one graph replay", "eager": "events between eager launches"}


def op_layers(bucket) -> list[int | None]:
    """Each op's decoder layer (roofline.op_layer); an op without one between two ops of the same layer (silu_mul
    between gate_up and down) is of that layer."""
    own = [op_layer(op) for op in bucket.ops]
    return [x if x is not None or i in (0, len(own) - 1) or own[i - 1] != own[i + 1] else own[i - 1]
            for i, x in enumerate(own)]


def profiled_ops(bucket, layers: int) -> set[int]:
    """The launching ops `--layers N` profiles: those of decoder layers 0..N-1 and those outside the layers
    (embedding, final norm, head, sampling); every launching op for 0."""
    return {i for i, (op, layer) in enumerate(zip(bucket.ops, op_layers(bucket))) if launches(op)
            and (layers == 0 or layer is None or layer < layers)}


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
    """Kernels in launch order, with the NCU_METRICS and EXTRA_METRICS ncu gave a number for, in base units (rows
    of other sections and "n/a" values are left out)."""
    kernels: dict[int, KernelMetrics] = {}
    for row in _csv_rows(text):
        k = kernels.setdefault(int(row["ID"]), KernelMetrics(int(row["ID"]), row["Kernel Name"]))
        if row["Metric Name"] in NCU_METRICS + EXTRA_METRICS and _is_number(row["Metric Value"]):
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


def _pct(metrics: dict, name: str) -> str:
    return f"{metrics[name]:6.1f}" if name in metrics else f"{'-':>6}"


def range_name(renamed: str, kernel: str) -> str:
    """The NVTX range of a kernel from its --print-nvtx-rename name ("RANGE/KERNEL" on ncu 2025.3); "-" when ncu
    left the kernel's name as it was (no range)."""
    if renamed == kernel:
        return "-"
    return renamed.removesuffix("/" + kernel)


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
        if i is not None:
            want = op_name(bucket.name, i, op)
            named += range_name(rng, k.name) == want or rng.startswith(want + "/")
        lines.append(f"{'' if i is None else i:>4} {k.name[:36]:36s} {t * 1e6:8.2f} {k.dram_gb_per_s:9.0f} "
                     f"{_pct(m, DRAM_PCT)} {_pct(m, SM_PCT)} {_pct(m, OCCUPANCY)} {cols} {range_name(rng, k.name)}")
    lines.append(agreement(ratios) + (f"; events: {TIMING[events['timing']]}" if events else
                                      "; no event times (the event-timed run wrote none)"))
    lines.append(f"nvtx: {named} of {len(matched)} profiled kernels carry their op's NVTX range"
                 if nvtx_names else "nvtx: ncu gave no NVTX range names (--print-nvtx-rename kernel)")
    return "\n".join(lines)

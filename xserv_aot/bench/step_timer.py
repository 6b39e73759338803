"""Per-step timing of a live engine, from inside the engine core process: a runner wrapper that records when each
step was launched and waited for, and (on a CUDA runner) how long the GPU worked on it and sat idle before it.

StepTimer(inner, step_log=path) keeps the runner contract (run / launch / wait / reset_kv / plan / overlaps), so
the engine overlaps steps exactly as it does with `inner`; pass it as the engine core's runner_wrapper, e.g.
`functools.partial(StepTimer, step_log=path)` (picklable). Each step's row in the StepLog (bench/instant_runner.py),
in completion order: COLUMNS. GPU columns come from CUDA events recorded on the runner's stream around the step
(`inner.dev`), NaN without one: gpu_ms = the step's start event to its end event (stage copy, graph, result copy),
gpu_idle_ms = the previous step's end event to this one's start event (the GPU waited for the host).

EmulatedDevice(inner, ...) is the CPU stand-in for a GPU: an InstantRunner behind a launch/wait pair that
completes each step `step_ms(num_tokens)` after the later of its launch and the previous step's completion (one
stream), so a CPU run shows whether the host path hides behind the device time (overlapped) or adds to it.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from xserv_aot.bench.instant_runner import InstantRunner, StepLog
from xserv_aot.runtime.batch import BatchDescription, StepResult

COLUMNS = ("launch_start", "launch_end", "wait_start", "wait_end", "num_tokens", "num_seqs", "gpu_ms", "gpu_idle_ms")
NUM_EVENTS = 8                            # event pairs in the ring (steps in flight are at most 2)


class StepTimer:
    def __init__(self, inner, *, step_log: Path):
        self.inner, self.plan = inner, inner.plan
        self.overlaps = bool(getattr(inner, "overlaps", False))
        self.log = StepLog(Path(step_log))
        self.dev = getattr(inner, "dev", None)
        self._events = [(self.dev.event(), self.dev.event()) for _ in range(NUM_EVENTS)] if self.dev else []
        self._k = 0
        self._last_end = None                 # end event of the last completed step

    def launch(self, batch: BatchDescription) -> tuple:
        t0 = time.perf_counter()
        pair = None
        if self._events:
            pair, self._k = self._events[self._k], (self._k + 1) % NUM_EVENTS
            self.dev.record(pair[0])
        handle = self.inner.launch(batch) if hasattr(self.inner, "launch") else self.inner.run(batch)
        if pair is not None:
            self.dev.record(pair[1])
        return handle, pair, t0, time.perf_counter(), batch.num_tokens, batch.num_seqs

    def wait(self, timed: tuple) -> StepResult:
        handle, pair, t0, t1, num_tokens, num_seqs = timed
        t2 = time.perf_counter()
        result = self.inner.wait(handle) if hasattr(self.inner, "wait") else handle
        t3 = time.perf_counter()
        gpu_ms = idle_ms = float("nan")
        if pair is not None:
            gpu_ms = self.dev.elapsed_ms(pair[0], pair[1])
            if self._last_end is not None:
                idle_ms = self.dev.elapsed_ms(self._last_end, pair[0])
            self._last_end = pair[1]
        self.log.record(t0, t1, t2, t3, num_tokens, num_seqs, gpu_ms, idle_ms)
        return result

    def run(self, batch: BatchDescription) -> StepResult:
        return self.wait(self.launch(batch))

    def reset_kv(self) -> None:
        self.inner.reset_kv()


class EmulatedDevice:
    """InstantRunner tokens, delivered as if by one GPU stream: step time decode_ms for decode steps (one token per
    sequence) and decode_ms + prefill_ms_per_token * num_tokens for the others."""

    def __init__(self, inner, *, decode_ms: float = 12.0, prefill_ms_per_token: float = 0.025):
        self.plan = inner.plan
        self.overlaps = True
        self._instant = InstantRunner(inner.plan)
        self.decode_ms, self.prefill_ms_per_token = decode_ms, prefill_ms_per_token
        self._free_at = 0.0                   # perf_counter time the emulated stream finishes its last step

    def step_ms(self, batch: BatchDescription) -> float:
        if batch.num_tokens == batch.num_seqs:
            return self.decode_ms
        return self.decode_ms + self.prefill_ms_per_token * batch.num_tokens

    def launch(self, batch: BatchDescription) -> tuple:
        self._free_at = max(self._free_at, time.perf_counter()) + self.step_ms(batch) / 1e3
        return self._free_at, self._instant.run(batch)

    def wait(self, handle: tuple) -> StepResult:
        due, result = handle
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return result

    def run(self, batch: BatchDescription) -> StepResult:
        return self.wait(self.launch(batch))

    def reset_kv(self) -> None:
        pass


def timed_emulated(inner, *, step_log: Path, decode_ms: float = 12.0) -> StepTimer:
    """runner_wrapper for a CPU run: a StepTimer around an EmulatedDevice (picklable with functools.partial)."""
    return StepTimer(EmulatedDevice(inner, decode_ms=decode_ms), step_log=step_log)


def summarize(rows: np.ndarray, max_num_seqs: int) -> dict:
    """StepLog rows (COLUMNS) -> where the time of a step went, for full decode steps (>= 90% of max_num_seqs, one
    token each), smaller decode steps, steps with prompt tokens, and all; ms medians. interval: launch to next
    launch; host: interval - wait; gaps_over_100ms: launch-to-launch intervals over 100 ms (the engine idle)."""
    r = {c: rows[:, i] for i, c in enumerate(COLUMNS)}
    order = np.argsort(r["launch_start"])
    r = {c: v[order] for c, v in r.items()}
    interval = np.append(np.diff(r["launch_start"]), np.nan) * 1e3
    wait = (r["wait_end"] - r["wait_start"]) * 1e3
    decode = (r["num_tokens"] == r["num_seqs"]) & (r["num_seqs"] >= 0.9 * max_num_seqs)
    other = r["num_tokens"] != r["num_seqs"]
    partial = (r["num_tokens"] == r["num_seqs"]) & ~decode
    out = {"steps": int(len(order)), "wall_s": float(r["wait_end"][-1] - r["launch_start"][0]) if len(order) else 0.0}
    if len(order):
        out["gpu_busy_fraction"] = float(np.nansum(r["gpu_ms"]) / 1e3 / out["wall_s"]) if out["wall_s"] else None
    for name, sel in (("full_decode", decode), ("partial_decode", partial), ("mixed_or_prefill", other),
                      ("all", np.ones(len(order), bool))):
        sel = sel & ~np.isnan(interval)
        med = lambda v: float(np.nanmedian(v[sel])) if sel.any() and not np.isnan(v[sel]).all() else None
        out[name] = {"steps": int(sel.sum()), "interval_ms": med(interval), "wait_ms": med(wait),
                     "host_ms": med(interval - wait), "gpu_ms": med(r["gpu_ms"]), "gpu_idle_ms": med(r["gpu_idle_ms"]),
                     "interval_p90_ms": float(np.percentile(interval[sel], 90)) if sel.any() else None,
                     "sum_interval_s": float(np.sum(interval[sel]) / 1e3), "tokens": int(r["num_tokens"][sel].sum())}
    gaps = interval[interval > 100.0]
    out["gaps_over_100ms"] = {"count": int(gaps.size), "sum_s": float(gaps.sum() / 1e3)}
    worst = np.argsort(-np.nan_to_num(interval, nan=-1.0))[:10]
    out["longest_intervals"] = [{"step": int(i), "interval_ms": float(interval[i]), "wait_ms": float(wait[i]),
                                 "num_tokens": int(r["num_tokens"][i]), "num_seqs": int(r["num_seqs"][i]),
                                 "gpu_ms": float(r["gpu_ms"][i]), "gpu_idle_ms": float(r["gpu_idle_ms"][i])}
                                for i in worst if not np.isnan(interval[i])]
    return out

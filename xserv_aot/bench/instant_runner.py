"""A runner test double that returns tokens at once, to measure everything around the model: the engine's host
work per step (schedule, stage, postprocess) and the server's (detokenize, stream).

It honours the runner contract (runtime/batch.py: run(batch) -> StepResult) and never touches the model: every
sequence gets the same token (`token_id`, not EOS), and logits are zeros when asked for. With `step_log` (a file
made by `StepLog.create`), each run() records (time.perf_counter(), num_seqs) in that memory-mapped file, so the
numbers can be read from another process (the one that drives the clients) whatever process the runner lives in.
With hold_first_step, the first run() waits until StepLog.release() (from any process), so that all the clients'
requests can queue up and the batch then steps at full size. Pass it to the engine as a factory, e.g.
`functools.partial(InstantRunner, step_log=path)` (picklable).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from xserv_aot.runtime.batch import BatchDescription, StepResult


class StepLog:
    """float64 [capacity + 2, width] on disk (width >= 3): row 0 = (steps recorded, capacity, width), row 1 =
    (released, waiting), row k + 2 = step k's values, zero-padded (InstantRunner: time, num_seqs)."""

    def __init__(self, path: Path, mode: str = "r+"):
        width = int(np.fromfile(path, dtype=np.float64, count=3)[2])
        self.data = np.memmap(path, dtype=np.float64, mode=mode).reshape(-1, width)

    @classmethod
    def create(cls, path: Path, capacity: int = 1 << 16, width: int = 3) -> "StepLog":
        if width < 3:
            raise ValueError(f"a step log row holds at least 3 values, got {width}")
        head = np.zeros((capacity + 2, width), dtype=np.float64)
        head[0, :3] = (0, capacity, width)
        head.tofile(path)
        return cls(path)

    def record(self, *values: float) -> None:
        k = int(self.data[0, 0])
        if k < self.data[0, 1]:
            self.data[k + 2, :len(values)] = values
            self.data[0, 0] = k + 1

    def rows(self) -> np.ndarray:
        """[steps recorded, width] copy."""
        return np.array(self.data[2:int(self.data[0, 0]) + 2])

    def steps(self) -> tuple[np.ndarray, np.ndarray]:
        rows = self.rows()
        return rows[:, 0], rows[:, 1].astype(np.int64)

    def wait_for_release(self) -> None:
        self.data[1, 1] = 1.0
        while not self.data[1, 0]:
            time.sleep(0.001)

    @property
    def held(self) -> bool:
        """A runner is waiting in wait_for_release()."""
        return bool(self.data[1, 1]) and not self.data[1, 0]

    def release(self) -> None:
        self.data[1, 0] = 1.0


class InstantRunner:
    def __init__(self, plan, *, token_id: int | None = None, step_log: Path | None = None,
                 hold_first_step: bool = False):
        self.plan = plan
        b, m = plan.build, plan.model
        eos = set(getattr(m, "eos_token_ids", None) or [])
        token_id = token_id if token_id is not None else next(i for i in range(m.vocab_size) if i not in eos)
        self._ids = np.full(b.max_num_seqs, token_id, dtype=np.int32)
        self._logits = np.zeros((b.max_num_seqs, m.vocab_size), dtype=np.float32)
        self.log = StepLog(Path(step_log)) if step_log is not None else None
        self.num_steps = 0
        if hold_first_step and self.log is None:
            raise ValueError("hold_first_step needs a step_log (the release comes through it)")
        self._hold = hold_first_step

    def run(self, batch: BatchDescription) -> StepResult:
        n = batch.num_seqs
        if self._hold:
            self._hold = False
            self.log.wait_for_release()
        if self.log is not None:
            self.log.record(time.perf_counter(), n)
        self.num_steps += 1
        return StepResult(self._ids[:n], self._logits[:n] if batch.need_logits else None)

    def reset_kv(self) -> None:
        pass

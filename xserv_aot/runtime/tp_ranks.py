"""Tensor-parallel rank processes: one process per rank (per GPU). Rank 0 is this process: it owns the engine and
the scheduler, and its TensorParallelRunner is the engine's runner. Ranks 1.. are follower processes that run every
batch description rank 0 sends them on their own shard, in the same order, and answer when the step is done.

Backend-agnostic: CUDA ranks combine their shards with NCCL inside their bucket graphs (the pipes carry only batches
and acknowledgements); NumPy ranks exchange their collective parts through the same pipes (PipeComm, star through
rank 0, every process summing the parts in rank order), which is how the protocol is tested on the CPU.

Messages (rank 0 -> follower): ("run", batch) | ("reset_kv",) | ("close",); follower -> rank 0: ("ready",) once,
("done",) per request, ("error", text) instead of either; during a NumPy step ("part", array) / ("parts", list).
The batch is the engine's BatchDescription as is (prev_rows included). Overlapped steps (launch/wait): launch sends
step N+1 to the followers and launches it on rank 0 before wait reads step N's result and its followers' "done"s
(answered in order, one per run); a follower runs its steps one after another, each resolving its pending ids from
its own sampled_ids (the same on every rank: every rank samples the same gathered logits).
A follower that fails, exits or does not answer within step_timeout_s fails the whole group: every follower is
stopped and every later call raises RankFailure (the engine then fails for good; no half-alive server). On CUDA a
follower that dies or hangs mid-step leaves rank 0's stream waiting in NCCL, so the watchdog ends the process with
the error (a step past step_timeout_s counts as hung).
"""
from __future__ import annotations

import collections
import multiprocessing as mp
import multiprocessing.connection
import atexit
import os
import signal
import sys
import threading
import time
from pathlib import Path

from xserv_aot.plan.manifest import Plan
from xserv_aot.plan.nccl_records import ENV
from xserv_aot.runtime.batch import BatchDescription, StepResult


class RankFailure(RuntimeError):
    """A rank of a tensor-parallel group failed, exited or hung; one line naming the rank."""


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def receive(conn, rank: int, timeout: float | None = None) -> tuple:
    """The next message from `rank`; RankFailure when it exited, failed or sent nothing within timeout."""
    try:
        if timeout is not None and not conn.poll(timeout):
            raise RankFailure(f"rank {rank} sent nothing for {timeout:g} s (hung?)")
        msg = conn.recv()
    except (EOFError, OSError):
        raise RankFailure(f"rank {rank} exited") from None
    if msg[0] == "error":
        raise RankFailure(f"rank {rank} failed: {msg[1]}")
    return msg


def expect(conn, kind: str, rank: int, timeout: float | None = None):
    """The next message from `rank`, which must be `kind`; its payload (RankFailure otherwise)."""
    msg = receive(conn, rank, timeout)
    if msg[0] != kind:
        raise RankFailure(f"rank {rank} sent {msg[0]!r}, expected {kind!r}")
    return msg[1] if len(msg) > 1 else None


class PipeComm:
    """allgather over the rank pipes: rank 0 collects every follower's part, then sends the full list back.
    Under overlapped steps a follower's "done" for the previous step may come before its first part of the next:
    rank 0 counts it in early_done (TensorParallelRunner reads those first)."""

    def __init__(self, rank: int, conns: list, timeout: float | None = None):
        self.rank, self.conns, self.timeout = rank, conns, timeout    # rank 0: one conn per follower, else [rank 0]
        self.early_done = [0] * len(conns)

    def _part(self, rank: int, conn):
        while (msg := receive(conn, rank, self.timeout))[0] == "done":
            self.early_done[rank - 1] += 1
        if msg[0] != "part":
            raise RankFailure(f"rank {rank} sent {msg[0]!r}, expected 'part'")
        return msg[1]

    def allgather(self, part):
        if self.rank:
            self.conns[0].send(("part", part))
            return expect(self.conns[0], "parts", 0)
        parts = [part] + [self._part(r, c) for r, c in enumerate(self.conns, 1)]
        for c in self.conns:
            c.send(("parts", parts))
        return parts


def rank_runner(plan: Plan, rank: int, backend: str, comm: PipeComm | None, nccl_id: bytes | None):
    """comm: the NumPy ranks' pipes (None on CUDA: NCCL inside the graphs)."""
    if backend == "cpu":
        from xserv_aot.runtime.numpy_backend import NumpyRunner
        return NumpyRunner(plan, rank, comm)
    from xserv_aot.runtime.cuda.runner import CudaRunner
    return CudaRunner(plan, device=rank, rank=rank, nccl_id=nccl_id)


def follower_main(conn, plan_dir: str, rank: int, backend: str, nccl_id: bytes | None) -> None:
    os.environ.update(ENV)
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C reaches the process group: rank 0 decides, then closes
    try:
        comm = PipeComm(rank, [conn]) if backend == "cpu" else None
        runner = rank_runner(Plan.load(plan_dir, verify="none"), rank, backend, comm, nccl_id)
        conn.send(("ready",))
        while (msg := conn.recv())[0] != "close":
            if msg[0] == "run":
                runner.run(msg[1])
            else:
                runner.reset_kv()
            conn.send(("done",))
    except EOFError:
        return                                   # rank 0 is gone
    except BaseException as e:
        try:
            conn.send(("error", _one_line(e)))
        except OSError:
            pass
        sys.exit(1)


class TensorParallelRunner:
    """The engine's runner for a plan of tensor_parallel > 1: rank 0 here, followers in their own processes."""

    def __init__(self, plan: Plan, backend: str = "cuda", step_timeout_s: float | None = 300.0):
        if plan.tensor_parallel < 2:
            raise ValueError("TensorParallelRunner needs a plan compiled with --tensor-parallel 2 or more")
        os.environ.update(ENV)                   # inherited by every follower; set before NCCL is loaded
        self.plan, self.backend, self.timeout = plan, backend, step_timeout_s
        self.failed: str | None = None
        self._closing, self._step_start = False, None    # _step_start: monotonic time of the oldest step in flight
        self._pending: collections.deque[float] = collections.deque()   # launch times of unanswered requests
        nccl_id = None
        if backend == "cuda":
            from xserv_aot.runtime.cuda.nccl import Nccl
            nccl_id = Nccl().unique_id()
        ctx = mp.get_context("spawn")
        self.conns, self.procs, self.own, self.comm = [], [], None, None
        try:
            for r in range(1, plan.tensor_parallel):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=follower_main, args=(child, str(Path(plan.dir).resolve()), r, backend, nccl_id),
                                name=f"xserv-rank{r}", daemon=True)
                p.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(p)
            self.comm = PipeComm(0, self.conns, step_timeout_s) if backend == "cpu" else None
            self.own = rank_runner(plan, 0, backend, self.comm, nccl_id)
            for r, c in enumerate(self.conns, 1):
                expect(c, "ready", r)
        except BaseException as e:
            self._stop_followers(polite=False)
            raise RankFailure(f"tensor-parallel group did not start: {e}") from None
        self._watchdog = threading.Thread(target=self._watch, name="xserv-tp-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(self.close)              # before multiprocessing's own exit handler stops the followers

    def _watch(self) -> None:
        """A follower that exits fails the group. On CUDA also a step past step_timeout_s: rank 0 may be waiting
        in NCCL for a dead or hung rank, so the process ends with the error (after killing the followers)."""
        cuda = self.backend == "cuda"
        while True:
            ready = multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=1.0 if cuda else None)
            if self._closing:
                return
            if ready:
                dead = next(r for r, p in enumerate(self.procs, 1) if p.sentinel in ready)
                self.failed = self.failed or f"rank {dead} exited (exit code {self.procs[dead - 1].exitcode})"
            elif self.timeout is not None and self._step_start is not None \
                    and time.monotonic() - self._step_start > self.timeout:
                self.failed = self.failed or f"a step took more than {self.timeout:g} s (a rank hung?)"
            else:
                continue
            for p in self.procs:                 # the pipes belong to the engine thread: stop the rest by signal
                p.kill()
            if cuda:
                print(f"error: tensor-parallel group failed: {self.failed}", file=sys.stderr, flush=True)
                os._exit(1)
            return

    def _check(self) -> None:
        if self.failed is not None:
            raise self._fail(self.failed)

    def _fail(self, msg: str) -> RankFailure:
        self.failed = self.failed or msg
        self._stop_followers(polite=False)
        return RankFailure(f"tensor-parallel group failed: {self.failed}")

    @property
    def overlaps(self) -> bool:
        """Overlapped steps by default where rank 0's runner has them (CUDA plans with prev_rows)."""
        return bool(getattr(self.own, "overlaps", False))

    def _guarded(self, body):
        """body(); any failure fails the whole group (the ranks are out of step for good)."""
        self._check()
        try:
            return body()
        except RankFailure as e:
            raise self._fail(str(e)) from None
        except Exception as e:                   # rank 0 failed mid-step
            raise self._fail(f"rank 0 failed: {_one_line(e)}") from None

    def _send_all(self, msg: tuple) -> None:
        self._pending.append(time.monotonic())
        self._step_start = self._pending[0]
        for r, c in enumerate(self.conns, 1):
            try:
                c.send(msg)
            except OSError:
                raise RankFailure(f"rank {r} exited") from None

    def _done_all(self) -> None:
        """Every follower's answer to the oldest request still pending."""
        early = self.comm.early_done if self.comm is not None else [0] * len(self.conns)
        for r, c in enumerate(self.conns, 1):
            if early[r - 1]:
                early[r - 1] -= 1
            else:
                expect(c, "done", r, self.timeout)
        self._pending.popleft()
        self._step_start = self._pending[0] if self._pending else None

    def launch(self, batch: BatchDescription):
        """Send the step to every follower and launch it on rank 0; wait(handle) reads its result."""
        self.plan.bucket_for(batch.num_tokens, batch.num_seqs, batch.max_context)  # a batch no bucket holds fails here

        def body():
            self._send_all(("run", batch))
            return self.own.launch(batch)
        return self._guarded(body)

    def wait(self, handle) -> StepResult:
        """Steps are waited for in the order they were launched."""
        def body():
            result = self.own.wait(handle)
            self._done_all()
            return result
        return self._guarded(body)

    def run(self, batch: BatchDescription) -> StepResult:
        return self.wait(self.launch(batch))

    def reset_kv(self) -> None:
        def body():
            if self._pending:
                raise RuntimeError("reset_kv with a step still in flight")
            self._send_all(("reset_kv",))
            self.own.reset_kv()
            self._done_all()
        self._guarded(body)

    def _stop_followers(self, polite: bool = True) -> None:
        """polite: ask each follower to close and wait for it a while; else (a failed group) kill them now."""
        self._closing = True
        for c in self.conns if polite else ():
            try:
                c.send(("close",))
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=10 if polite else 0)
            if p.is_alive():
                p.kill()
                p.join()

    def close(self) -> None:
        """Idempotent: stop the followers, then rank 0's own runner; later calls raise RankFailure."""
        self.failed = self.failed or "runner closed"
        self._stop_followers()
        own, self.own = self.own, None
        if own is not None and hasattr(own, "close"):
            own.close()

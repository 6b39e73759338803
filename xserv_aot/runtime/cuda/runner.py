"""CudaRunner: executes a plan's buckets on one GPU by replaying one CUDA Graph per bucket.

Start: one device allocation each for weights (uploaded, or filled on the device for dummy-weight plans), arena
and KV pool; cubins (+ CUTLASS library) loaded; every bucket run once eagerly, then captured (decode buckets
largest first, then prefill). Step: stage the batch into pinned memory, one H2D copy of the input region,
graph replay, D2H of the sampled ids (and logits when asked), one event. No allocation in the steady state.
launch/wait split a step so the engine can stage step N+1 while step N runs (overlapped steps): two pinned
staging/result buffers alternate, and a buffer is reused only after the event of the step that last used it.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from xserv_aot.dtypes import STORAGE, decode
from xserv_aot.errors import XservError
from xserv_aot.plan.megakernel_plan import MK_PREFIX
from xserv_aot.plan.ops import INPUT_BUFFERS
from xserv_aot.plan.roofline import op_name
from xserv_aot.runtime.batch import BatchDescription, StepResult, stage_inputs
from xserv_aot.runtime.cuda.driver import Device, Launch
from xserv_aot.runtime.cuda.launch import Buffers, op_launches
from xserv_aot.runtime.nvtx import ranges


class CudaRunnerError(XservError, ValueError):
    """A plan or batch the CUDA runner cannot execute; one line."""


class CudaRunner:
    def __init__(self, plan, capture: bool = True, log: Callable[[str], None] | None = None, device: int = 0,
                 rank: int = 0, nccl_id: bytes | None = None, nvtx: bool = False):
        """rank, nccl_id: this process's rank of a tensor-parallel plan and the group's NCCL unique id
        (runtime/tp_ranks.py; NOT RUN on a multi-GPU machine yet). nvtx: NVTX ranges around stage / replay / finish
        of every step and around every op of an eager step."""
        if plan.build.dtype != "bfloat16" or not plan.kernels.get("cubins"):
            raise CudaRunnerError(f"{plan.dir}: plan has no CUDA kernels (target {plan.build.target!r}, dtype "
                                  f"{plan.build.dtype!r}); recompile with --target sm_90a --dtype bfloat16")
        self.plan, self.rank, self.nccl_id = plan, rank, nccl_id
        self.log = log or (lambda msg: None)
        self.nvtx = ranges(nvtx)
        self.op_names = {bk.name: [op_name(bk.name, i, op) for i, op in enumerate(bk.ops)]
                         for bk in plan.buckets} if nvtx else {}
        self.dev = dev = Device(device)
        t0 = time.perf_counter()
        self.weights_ptr = dev.alloc(int(plan.manifest["weights"]["size"]))
        self.arena_ptr = dev.alloc(plan.arena_size)
        self.kv_bytes = int(plan.kv_cache["size"])
        self.kv_ptr = dev.alloc(self.kv_bytes)
        dev.memset(self.arena_ptr, 0, plan.arena_size)
        dev.memset(self.kv_ptr, 0, self.kv_bytes)
        self.buf = Buffers(plan, self.weights_ptr, self.arena_ptr, self.kv_ptr)
        self._load_kernels()
        self._load_weights()
        dev.sync()
        self.log(f"cuda: {dev.name}: weights {plan.manifest['weights']['size'] / 2**30:.2f} GiB, arena "
                 f"{plan.arena_size / 2**20:.1f} MiB, kv {self.kv_bytes / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f}s")
        self._setup_staging()
        self.launches = {bk.name: [op_launches(op, self.buf, self.func, self.libraries) for op in bk.ops]
                         for bk in plan.buckets}
        self.buckets = {bk.name: bk for bk in plan.buckets}
        self.graphs: dict[str, object] = {}
        for bk in plan.buckets:                  # eager warm-up: module load, CUTLASS init, first-touch
            self.run_eager(bk.name, self.padding_batch())
        if capture:
            self.capture_all()

    # ---- setup ---------------------------------------------------------------------------------------------
    def _load_kernels(self) -> None:
        k, files = self.plan.kernels, self.plan.kernel_files()       # inside the plan, hashes checked
        self.modules = {name: self.dev.load_module(files[name].read_bytes()) for name in k["cubins"]}
        smem = {}
        for bk in self.plan.buckets:
            for op in bk.ops:
                for rec in op.cuda.launch if op.cuda else ():
                    if not rec.library:
                        smem[rec.fn] = max(smem.get(rec.fn, 0), rec.smem)
        self._smem = smem
        persistent = max((rec.grid[0] for bk in self.plan.buckets for op in bk.ops for rec in
                          (op.cuda.launch if op.cuda else ()) if rec.fn.startswith(MK_PREFIX)), default=0)
        if persistent > self.dev.num_sms:
            raise CudaRunnerError(f"{self.plan.dir}: the decode megakernel needs {persistent} resident blocks, "
                                  f"{self.dev.name} has {self.dev.num_sms} SMs; recompile with megakernel_sms "
                                  f"{self.dev.num_sms} (or 0)")
        self._funcs: dict[str, object] = {}
        self.libraries = {}
        lib = k.get("gemm_library")
        if lib:
            from xserv_aot.runtime.cuda.cutlass_gemm import CutlassGemm
            self.libraries["gemm_library"] = CutlassGemm(files["gemm_library"])
        if self.plan.tensor_parallel > 1:
            from xserv_aot.runtime.cuda.nccl import Nccl
            if self.nccl_id is None:
                raise CudaRunnerError(f"{self.plan.dir}: a tensor-parallel plan runs one rank per process "
                                      "(runtime/tp_ranks.TensorParallelRunner)")
            self.libraries["nccl"] = nccl = Nccl()
            nccl.init_rank(self.plan.tensor_parallel, self.nccl_id, self.rank)

    def func(self, name: str):
        if name not in self._funcs:
            src = self.plan.kernels["functions"].get(name)
            if src is None:
                raise CudaRunnerError(f"kernel {name!r} is not in any cubin of the plan")
            self._funcs[name] = self.dev.function(self.modules[src], name, self._smem.get(name, 0),
                                                  self.plan.build.smem_carveout)
        return self._funcs[name]

    def _load_weights(self) -> None:
        raw = self.plan.weights_bytes(self.rank)
        if raw is not None:
            chunk = 1 << 28
            host = self.dev.alloc_host(chunk)
            for off in range(0, raw.shape[0], chunk):
                n = min(chunk, raw.shape[0] - off)
                host[:n] = raw[off:off + n]
                self.dev.htod_async(self.weights_ptr + off, host.ctypes.data, n)
                self.dev.sync()
            return
        from xserv_aot.runtime.cuda.dummy_upload import upload_dummy_weights
        upload_dummy_weights(self.dev, self.plan, self.func("fill_normal_bf16"), self.weights_ptr, self.rank,
                             func=self.func)

    def _setup_staging(self) -> None:
        arena = self.plan.arena
        inputs = [n for n in INPUT_BUFFERS if n in arena]        # plans before prev_rows / bitmask_rows lack them
        self.overlaps = "prev_rows" in arena
        lo = min(arena[n].offset for n in inputs)
        hi = max(arena[n].offset + arena[n].nbytes for n in inputs)
        others = [n for n, i in arena.items() if n not in inputs and i.offset < hi and i.offset + i.nbytes > lo]
        if others:
            raise CudaRunnerError(f"arena input buffers are not contiguous (overlap {others[0]!r})")
        self.in_lo, self.in_bytes = lo, hi - lo
        self.pinned_ins, self.views_k, self.pinned_ids_k, self.pinned_bitmask_k = [], [], [], []
        B, V = self.plan.build.max_num_seqs, self.plan.model.vocab_size
        W = arena["token_bitmask"].shape[1] if "token_bitmask" in arena else 1
        for _ in range(2):
            pinned = self.dev.alloc_host(self.in_bytes)
            views = {}
            for n in inputs:
                i = arena[n]
                views[n] = pinned[i.offset - lo: i.offset - lo + i.nbytes].view(STORAGE[i.dtype]).reshape(i.shape)
            self.pinned_ins.append(pinned)
            self.views_k.append(views)
            self.pinned_ids_k.append(self.dev.alloc_host(4 * B, np.int32)[:B])
            self.pinned_bitmask_k.append(self.dev.alloc_host(4 * B * W, np.int32)[:B * W].reshape(B, W))
        self.events = [self.dev.event(), self.dev.event()]
        self._buf_used = [False, False]
        self._next = 0
        self.pinned_logits = self.dev.alloc_host(4 * B * V, np.float32)[:B * V].reshape(B, V)
        W = self.plan.arena["token_bitmask"].shape[1] if "token_bitmask" in self.plan.arena else 1
        self.pinned_bitmask = self.dev.alloc_host(4 * B * W, np.int32)[:B * W].reshape(B, W)

    # ---- staging -------------------------------------------------------------------------------------------
    @staticmethod
    def padding_batch() -> BatchDescription:
        """One token row covered by no sequence: every kernel runs, nothing is written to the KV cache."""
        return BatchDescription(input_ids=[0], positions=[0], slot_mapping=[-1], query_start_loc=[0, 0],
                                seq_lens=[0], block_tables=[[0]]).fill_sampling_defaults()

    def stage(self, batch: BatchDescription, bk, k: int = 0) -> None:
        """Fill staging buffer k and enqueue its H2D copy (grammar masks: only when a row has one, ns rows)."""
        try:
            stage_inputs(batch, self.views_k[k], bk.num_tokens, bk.num_seqs)
        except ValueError as e:
            raise CudaRunnerError(f"bucket {bk.name}: {e}") from None
        if len(batch.bitmask_rows):
            ns, pinned = batch.num_seqs, self.pinned_bitmask_k[k]
            pinned[:ns] = batch.token_bitmask
            self.dev.htod_async(self.buf("token_bitmask"), pinned.ctypes.data, pinned[:ns].nbytes)
        self.dev.htod_async(self.arena_ptr + self.in_lo, self.pinned_ins[k].ctypes.data, self.in_bytes)

    def _start(self, batch: BatchDescription, k: int) -> tuple:
        """Enqueue the D2H of the results into buffer k and its event; the handle wait() takes."""
        ns = batch.num_seqs
        self.dev.dtoh_async(self.pinned_ids_k[k].ctypes.data, self.buf("sampled_ids"), 4 * ns)
        if batch.need_logits:
            V = self.plan.model.vocab_size
            self.dev.dtoh_async(self.pinned_logits.ctypes.data, self.buf("logits"), 4 * ns * V)
        self.dev.record(self.events[k])
        self._buf_used[k] = True
        return k, ns, batch.need_logits

    def wait(self, handle: tuple) -> StepResult:
        k, ns, need_logits = handle
        with self.nvtx.range("finish"):
            self.dev.wait_event(self.events[k])
            logits = self.pinned_logits[:ns].copy() if need_logits else None
            return StepResult(sampled_ids=self.pinned_ids_k[k][:ns].copy(), logits=logits)

    def _take_buffer(self) -> int:
        k, self._next = self._next, self._next ^ 1
        if self._buf_used[k]:
            self.dev.wait_event(self.events[k])          # the step that last used buffer k is done with it
        return k

    # ---- execution -----------------------------------------------------------------------------------------
    def enqueue(self, name: str) -> None:
        stream = self.dev.stream
        if self.nvtx.enabled:
            return self._enqueue_ranged(name)
        for launches in self.launches[name]:
            for ln in launches:
                ln(stream)

    def _enqueue_ranged(self, name: str) -> None:
        stream, nv = self.dev.stream, self.nvtx
        for launches, label in zip(self.launches[name], self.op_names[name]):
            if launches:
                with nv.range(label):
                    for ln in launches:
                        ln(stream)

    def capture_all(self) -> None:
        order = sorted(self.plan.decode_buckets, key=lambda b: -b.num_tokens)
        order += [b for b in self.plan.buckets if b.kind != "decode"]
        free0 = self.dev.mem_info()[0]
        t0 = time.perf_counter()
        for bk in order:
            self.graphs[bk.name] = self.dev.capture(lambda s, n=bk.name: self.enqueue(n))
            self.dev.graph_launch(self.graphs[bk.name])
            self.dev.sync()
        used = free0 - self.dev.mem_info()[0]
        self.log(f"cuda: captured {len(order)} graphs in {time.perf_counter() - t0:.2f}s, "
                 f"graph memory {used / 2**20:.1f} MiB")

    def bucket_for(self, batch: BatchDescription):
        try:
            return self.plan.bucket_for(batch.num_tokens, batch.num_seqs, batch.max_context)
        except ValueError as e:
            raise CudaRunnerError(str(e)) from None

    def launch(self, batch: BatchDescription) -> tuple:
        """Stage and enqueue one step without waiting for it (wait(handle) gets its result)."""
        bk, nv = self.bucket_for(batch), self.nvtx
        k = self._take_buffer()
        with nv.range("stage"):
            self.stage(batch, bk, k)
        gexec = self.graphs.get(bk.name)
        with nv.range(f"{'eager' if gexec is None else 'replay'} {bk.name}"):
            if gexec is None:
                self.enqueue(bk.name)
            else:
                self.dev.graph_launch(gexec)
        return self._start(batch, k)

    def run(self, batch: BatchDescription) -> StepResult:
        return self.wait(self.launch(batch))

    def run_eager(self, name: str, batch: BatchDescription) -> StepResult:
        bk = self.buckets[name]
        k = self._take_buffer()
        self.stage(batch, bk, k)
        with self.nvtx.range(f"eager {name}"):
            self.enqueue(name)
        return self.wait(self._start(batch, k))

    def read_buffer(self, name: str) -> np.ndarray:
        """Copy an arena buffer back (tests, debugging); bfloat16 comes back as float32."""
        info = self.plan.arena[name]
        return decode(self.dev.dtoh(self.buf(name), info.shape, STORAGE[info.dtype]), info.dtype)

    def reset_kv(self) -> None:
        self.dev.memset(self.kv_ptr, 0, self.kv_bytes)
        self.dev.sync()

    def close(self) -> None:
        self.dev.sync()
        if "nccl" in self.libraries:
            self.libraries["nccl"].close()
        self.dev.close()

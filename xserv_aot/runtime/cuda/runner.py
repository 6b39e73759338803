"""CudaRunner: executes a plan's buckets on one GPU by replaying one CUDA Graph per bucket.

Start: one device allocation each for weights (uploaded, or filled on the device for dummy-weight plans), arena
and KV pool; cubins (+ CUTLASS library) loaded; every bucket run once eagerly, then captured (decode buckets
largest first, then prefill). Step: stage the batch into pinned memory, one H2D copy of the input region,
graph replay, D2H of the sampled ids (and logits when asked), one sync. No allocation in the steady state.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from xserv_aot.dtypes import STORAGE
from xserv_aot.plan.ops import INPUT_BUFFERS
from xserv_aot.runtime.batch import BatchDescription, StepResult
from xserv_aot.runtime.cuda.driver import Device, Launch
from xserv_aot.runtime.cuda.launch import Buffers, op_launches


class CudaRunnerError(ValueError):
    """A plan or batch the CUDA runner cannot execute; one line."""


class CudaRunner:
    def __init__(self, plan, capture: bool = True, log: Callable[[str], None] | None = None, device: int = 0):
        if plan.build.dtype != "bfloat16" or not plan.kernels.get("cubins"):
            raise CudaRunnerError(f"{plan.dir}: plan has no CUDA kernels (target {plan.build.target!r}, dtype "
                                  f"{plan.build.dtype!r}); recompile with --target sm_90a --dtype bfloat16")
        self.plan = plan
        self.log = log or (lambda msg: None)
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
        self.launches = {bk.name: [op_launches(op, self.buf, self.func, self.gemm) for op in bk.ops]
                         for bk in plan.buckets}
        self.buckets = {bk.name: bk for bk in plan.buckets}
        self.graphs: dict[str, object] = {}
        for bk in plan.buckets:                  # eager warm-up: module load, CUTLASS init, first-touch
            self.run_eager(bk.name, self.padding_batch())
        if capture:
            self.capture_all()

    # ---- setup ---------------------------------------------------------------------------------------------
    def _load_kernels(self) -> None:
        k = self.plan.kernels
        self.modules = {name: self.dev.load_module((self.plan.dir / c["file"]).read_bytes())
                        for name, c in k["cubins"].items()}
        smem = {}
        for bk in self.plan.buckets:
            for op in bk.ops:
                for spec in op.get("launch") or []:
                    smem[spec["fn"]] = max(smem.get(spec["fn"], 0), int(spec["smem"]))
        self._smem = smem
        self._funcs: dict[str, object] = {}
        self.gemm = None
        lib = k.get("gemm_library")
        if lib:
            from xserv_aot.runtime.cuda.cutlass_gemm import CutlassGemm
            self.gemm = CutlassGemm(self.plan.dir / lib["file"])

    def func(self, name: str):
        if name not in self._funcs:
            src = self.plan.kernels["functions"].get(name)
            if src is None:
                raise CudaRunnerError(f"kernel {name!r} is not in any cubin of the plan")
            self._funcs[name] = self.dev.function(self.modules[src], name, self._smem.get(name, 0))
        return self._funcs[name]

    def _load_weights(self) -> None:
        raw = self.plan.weights_bytes()
        if raw is not None:
            chunk = 1 << 28
            host = self.dev.alloc_host(chunk)
            for off in range(0, raw.shape[0], chunk):
                n = min(chunk, raw.shape[0] - off)
                host[:n] = raw[off:off + n]
                self.dev.htod_async(self.weights_ptr + off, host.ctypes.data, n)
                self.dev.sync()
            return
        fill = self.func("fill_normal_bf16")
        seed = int(self.plan.dummy_seed or 0)
        for idx, (name, info) in enumerate(self.plan.weights.items()):
            ptr = self.weights_ptr + info.offset
            if name in ("rope_cos", "rope_sin"):
                continue
            n = int(np.prod(info.shape))
            mean, std = (1.0, 0.1) if len(info.shape) == 1 else (0.0, float(info.shape[1]) ** -0.5)
            Launch("fill_normal_bf16", fill, (min(-(-n // 256), 65536), 1, 1), (256, 1, 1), 0,
                   [("ptr", ptr), ("u64", n), ("u64", (seed * 1000003 + idx) & (2**64 - 1)), ("f32", mean),
                    ("f32", std)])(self.dev.stream)
        from xserv_aot.plan.weights import rope_tables
        cos, sin = rope_tables(self.plan.model, self.plan.build.max_seq_len)
        self.dev.htod(self.weights_ptr + self.plan.weights["rope_cos"].offset, cos)
        self.dev.htod(self.weights_ptr + self.plan.weights["rope_sin"].offset, sin)

    def _setup_staging(self) -> None:
        arena = self.plan.arena
        inputs = [n for n in INPUT_BUFFERS if n in arena]          # bitmask_rows: absent from older plans
        lo = min(arena[n].offset for n in inputs)
        hi = max(arena[n].offset + arena[n].nbytes for n in inputs)
        others = [n for n, i in arena.items() if n not in inputs and i.offset < hi and i.offset + i.nbytes > lo]
        if others:
            raise CudaRunnerError(f"arena input buffers are not contiguous (overlap {others[0]!r})")
        self.in_lo, self.in_bytes = lo, hi - lo
        self.pinned_in = self.dev.alloc_host(self.in_bytes)
        self.views = {}
        for n in inputs:
            i = arena[n]
            a = self.pinned_in[i.offset - lo: i.offset - lo + i.nbytes].view(STORAGE[i.dtype])
            self.views[n] = a.reshape(i.shape)
        B, V = self.plan.build.max_num_seqs, self.plan.model.vocab_size
        self.pinned_ids = self.dev.alloc_host(4 * B, np.int32)[:B]
        self.pinned_logits = self.dev.alloc_host(4 * B * V, np.float32)[:B * V].reshape(B, V)
        W = self.plan.arena["token_bitmask"].shape[1] if "token_bitmask" in self.plan.arena else 1
        self.pinned_bitmask = self.dev.alloc_host(4 * B * W, np.int32)[:B * W].reshape(B, W)

    # ---- staging -------------------------------------------------------------------------------------------
    @staticmethod
    def padding_batch() -> BatchDescription:
        """One token row covered by no sequence: every kernel runs, nothing is written to the KV cache."""
        return BatchDescription(input_ids=[0], positions=[0], slot_mapping=[-1], query_start_loc=[0, 0],
                                seq_lens=[0], block_tables=[[0]]).fill_sampling_defaults()

    def stage(self, batch: BatchDescription, bk) -> None:
        t, s = bk.num_tokens, bk.num_seqs
        nt, ns = batch.num_tokens, batch.num_seqs
        if nt > t or ns > s:
            raise CudaRunnerError(f"batch of {nt} tokens / {ns} seqs does not fit bucket {bk.name}")
        batch.fill_sampling_defaults()
        v = self.views
        v["input_ids"][:nt] = batch.input_ids
        v["input_ids"][nt:t] = 0
        v["positions"][:nt] = batch.positions
        v["positions"][nt:t] = 0
        v["slot_mapping"][:nt] = batch.slot_mapping
        v["slot_mapping"][nt:t] = -1
        qsl = v["query_start_loc"]
        qsl[:ns + 1] = batch.query_start_loc
        qsl[ns + 1:s + 1] = batch.query_start_loc[-1]
        v["seq_lens"][:ns] = batch.seq_lens
        v["seq_lens"][ns:s] = 0
        bt = v["block_tables"]
        for i, row in enumerate(batch.block_tables):
            if len(row) > bt.shape[1]:
                raise CudaRunnerError(f"block table of seq {i} has {len(row)} blocks (max {bt.shape[1]})")
            bt[i, :len(row)] = row
        li = v["logits_indices"]
        li[:ns] = np.asarray(batch.query_start_loc[1:], dtype=np.int32) - 1
        li[ns:s] = 0
        np.maximum(li[:ns], 0, out=li[:ns])
        v["temperature"][:ns] = batch.temperature
        v["temperature"][ns:s] = 0.0
        v["top_k"][:ns] = batch.top_k
        v["top_k"][ns:s] = 0
        v["top_p"][:ns] = batch.top_p
        v["top_p"][ns:s] = 1.0
        v["seeds"][:ns] = batch.seeds
        v["seeds"][ns:s] = 0
        v["sample_offsets"][:ns] = batch.sample_offsets
        v["sample_offsets"][ns:s] = 0
        if "bitmask_rows" in v:                     # plans compiled before grammar masks have none
            v["bitmask_rows"][:ns] = batch.bitmask_rows or 0
            v["bitmask_rows"][ns:s] = 0
        if batch.bitmask_rows:                      # only when a row has a grammar: ns rows of masks, async
            self.pinned_bitmask[:ns] = batch.token_bitmask
            self.dev.htod_async(self.buf("token_bitmask"), self.pinned_bitmask.ctypes.data,
                                self.pinned_bitmask[:ns].nbytes)
        self.dev.htod_async(self.arena_ptr + self.in_lo, self.pinned_in.ctypes.data, self.in_bytes)

    def _finish(self, batch: BatchDescription) -> StepResult:
        ns = batch.num_seqs
        self.dev.dtoh_async(self.pinned_ids.ctypes.data, self.buf("sampled_ids"), 4 * ns)
        logits = None
        if batch.need_logits:
            V = self.plan.model.vocab_size
            self.dev.dtoh_async(self.pinned_logits.ctypes.data, self.buf("logits"), 4 * ns * V)
        self.dev.sync()
        if batch.need_logits:
            logits = self.pinned_logits[:ns].copy()
        return StepResult(sampled_ids=self.pinned_ids[:ns].copy(), logits=logits)

    # ---- execution -----------------------------------------------------------------------------------------
    def enqueue(self, name: str) -> None:
        stream = self.dev.stream
        for launches in self.launches[name]:
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
            return self.plan.bucket_for(batch.num_tokens, batch.num_seqs)
        except ValueError as e:
            raise CudaRunnerError(str(e)) from None

    def run(self, batch: BatchDescription) -> StepResult:
        bk = self.bucket_for(batch)
        self.stage(batch, bk)
        gexec = self.graphs.get(bk.name)
        if gexec is None:
            self.enqueue(bk.name)
        else:
            self.dev.graph_launch(gexec)
        return self._finish(batch)

    def run_eager(self, name: str, batch: BatchDescription) -> StepResult:
        bk = self.buckets[name]
        self.stage(batch, bk)
        self.enqueue(name)
        return self._finish(batch)

    def read_buffer(self, name: str) -> np.ndarray:
        """Copy an arena buffer back (tests, debugging); bfloat16 comes back as float32."""
        info = self.plan.arena[name]
        raw = self.dev.dtoh(self.buf(name), info.shape, STORAGE[info.dtype])
        if info.dtype == "bfloat16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw

    def reset_kv(self) -> None:
        self.dev.memset(self.kv_ptr, 0, self.kv_bytes)
        self.dev.sync()

    def close(self) -> None:
        self.dev.sync()
        self.dev.close()

"""NumPy backend: executes a plan's op list on the CPU over a paged KV cache. The oracle for the CUDA backend.

A tensor-parallel plan runs as `tensor_parallel` simulated ranks in one process: each rank has its own weights,
arena and KV pool and runs every op on its shard; collectives (all_reduce, all_gather) combine the ranks' buffers
on the host in rank order 0, 1, ... once every rank has reached them (the ranks run in lockstep, op by op).
With `rank` and `comm` it is one rank of a multi-process group (runtime/tp_ranks.py): comm.allgather(part) returns
every rank's part in rank order, and each process combines them the same way.
"""
from __future__ import annotations

import numpy as np

from xserv_aot import fp8, kv_cache
from xserv_aot.dtypes import FP8, decode, round_to, storage_dtype
from xserv_aot.plan.dummy_weights import dummy_plan_tensors
from xserv_aot.plan.manifest import Bucket, Plan
from xserv_aot.plan.op_records import COLLECTIVES, AllGather, AllReduce
from xserv_aot.plan.tensor_parallel import ShardSpec, rank_shards
from xserv_aot.runtime import numpy_ops as ops
from xserv_aot.runtime.batch import BatchDescription, StepResult, stage_inputs

WIDENED = ("bfloat16", FP8)            # arena dtypes held as float32 values on their grid


def load_rank_weights(plan: Plan, ranks: list[int] | None = None) -> list[dict[str, np.ndarray]]:
    """Per rank in `ranks` (default all): plan weight name -> float32 array (bf16 words widened once, at load)."""
    tp = plan.tensor_parallel
    ranks = list(range(tp)) if ranks is None else ranks
    if plan.weights_file is None:      # the plan's dtypes, as the GPU generator writes them; shards cut from full
        full = dummy_plan_tensors(plan)
        if plan.sharding:
            specs = {k: ShardSpec.from_dict(v) for k, v in plan.sharding.items()}
            shards = rank_shards(full, specs, tp)
        else:
            shards = ((name, [arr], rope) for name, arr, rope in full)
        out = [{} for _ in ranks]
        for name, parts, rope in shards:
            for i, rank in enumerate(ranks):
                out[i][name] = round_to(parts[rank], plan.weights[name].dtype)
        return out
    return [_read_weights(plan, rank) for rank in ranks]


def _read_weights(plan: Plan, rank: int) -> dict[str, np.ndarray]:
    raw = plan.weights_bytes(rank)
    out = {}
    for name, info in plan.weights.items():
        dt = storage_dtype(info.dtype)
        words = np.frombuffer(raw, dtype=dt, count=int(np.prod(info.shape)), offset=info.offset)
        out[name] = np.ascontiguousarray(decode(words, info.dtype), dtype=np.float32).reshape(info.shape)
    return out


def load_weights(plan: Plan, rank: int = 0) -> dict[str, np.ndarray]:
    return load_rank_weights(plan, [rank])[0]


class NumpyRunner:
    def __init__(self, plan: Plan, rank: int | None = None, comm=None):
        """rank None: every rank of the plan in this process; else only `rank`, its collectives through comm."""
        if (rank is None) != (comm is None):
            raise ValueError("NumpyRunner: pass both rank and comm (one rank of a group) or neither")
        self.plan, self.comm = plan, comm
        ranks = None if rank is None else [rank]
        self.ranks = [NumpyRank(plan, w) for w in load_rank_weights(plan, ranks)]
        self.w, self.buf, self.kv = self.ranks[0].w, self.ranks[0].buf, self.ranks[0].kv   # the first rank's

    def reset_kv(self) -> None:
        for rank in self.ranks:
            rank.kv[:] = 0

    overlaps = False                     # launch runs the step at once: overlapping gains nothing on the CPU

    def run(self, batch: BatchDescription) -> StepResult:
        bucket = self.plan.bucket_for(batch.num_tokens, batch.num_seqs, batch.max_context)
        for rank in self.ranks:
            stage_inputs(batch, rank.buf, bucket.num_tokens, bucket.num_seqs)
        self.execute(bucket)
        n = batch.num_seqs
        logits = self.buf["logits"][:n].copy() if batch.need_logits else None
        return StepResult(self.buf["sampled_ids"][:n].copy(), logits)

    def launch(self, batch: BatchDescription) -> StepResult:
        """The step runs here and now; its sampled_ids stay in the arena for the next step's resolve_input_ids."""
        return self.run(batch)

    def wait(self, handle: StepResult) -> StepResult:
        return handle

    def execute(self, bucket: Bucket) -> None:
        for op in bucket.ops:
            if isinstance(op, COLLECTIVES):
                self.collective(op)
            else:
                for rank in self.ranks:
                    getattr(rank, "op_" + op.op)(op)

    def parts(self, local: list[np.ndarray], ranks: int) -> list[np.ndarray]:
        """Every rank's part of a collective, in rank order."""
        parts = local if self.comm is None else self.comm.allgather(local[0])
        if len(parts) != ranks:
            raise ValueError(f"collective over {ranks} ranks got {len(parts)} parts")
        return parts

    def collective(self, op) -> None:
        if isinstance(op, AllReduce):
            total = ops.all_reduce(self.parts([rank.buf[op.buf][:op.rows] for rank in self.ranks], op.ranks))
            for rank in self.ranks:
                rank._set(op.buf, op.rows, total)
        elif isinstance(op, AllGather):
            full = ops.all_gather_columns(self.parts([rank.buf[op.inp][:op.rows, :op.n] for rank in self.ranks],
                                                     op.ranks))
            for rank in self.ranks:
                rank._set(op.out, op.rows, full)


class NumpyRank:
    """One rank's weights, arena and KV pool, and the ops that touch only them."""

    def __init__(self, plan: Plan, weights: dict[str, np.ndarray]):
        self.plan, self.w, self.w_real = plan, weights, {}
        self.dtypes = {name: info.dtype for name, info in plan.arena.items()}
        self.buf = {name: np.zeros(info.shape, dtype=np.float32 if info.dtype in WIDENED else storage_dtype(info.dtype))
                    for name, info in plan.arena.items()}
        L, _, nb, bs, nkv, hd = plan.kv_cache["shape"]
        self.kv = np.zeros((L, 2, nb * bs, nkv, hd), dtype=np.float32)   # slot-flattened paged pool
        self.kv_dtype = plan.kv_cache["dtype"]

    # each op reads arena buffers / weights and writes its output rounded to the buffer's dtype
    def _set(self, name: str, rows: int, val: np.ndarray) -> None:
        self.buf[name][:rows] = round_to(val, self.dtypes[name]).reshape(self.buf[name][:rows].shape)

    def op_resolve_input_ids(self, op):
        b, r = self.buf, op.rows
        b[op.ids][:r] = ops.resolve_input_ids(b[op.ids][:r], b[op.prev_rows][:r], b[op.sampled])

    def op_embedding(self, op):
        self._set(op.out, op.rows, ops.embedding(self.buf[op.ids][:op.rows], self.w[op.table]))

    def op_rmsnorm(self, op):
        self._set(op.out, op.rows, ops.rmsnorm(self.buf[op.inp][:op.rows], self.w[op.weight], op.eps))

    def op_add_rmsnorm(self, op):
        r = op.rows
        res, _ = ops.add_rmsnorm(self.buf[op.residual][:r], self.buf[op.delta][:r], self.w[op.weight], op.eps)
        self._set(op.residual, r, res)
        self._set(op.out, r, ops.rmsnorm(self.buf[op.residual][:r], self.w[op.weight], op.eps))

    def op_linear(self, op):
        bias, x, w = self.w[op.bias] if op.bias else None, self.buf[op.inp][:op.rows, :op.k], self.w[op.weight]
        if op.inp_scale:
            groups = fp8.groups(op.k, fp8.act_group(op.quant, op.k))
            out = ops.linear_w8a8(self.packed(op.inp, op.rows, op.k), self.packed(op.inp_scale, op.rows, groups), w,
                                  self.w[op.weight_scale], op.quant, bias)
        elif op.quant:
            out = ops.linear_w8a16(x, self.dequantized(op), bias)
        else:
            out = ops.linear(x, w, bias)
        self._set(op.out, op.rows, out)

    def dequantized(self, op) -> np.ndarray:
        """W_real of an FP8 weight, computed once per weight."""
        if op.weight not in self.w_real:
            self.w_real[op.weight] = fp8.dequantize(self.w[op.weight], self.w[op.weight_scale], op.quant)
        return self.w_real[op.weight]

    def op_quantize_fp8(self, op):
        r, k = op.rows, op.k
        q, scale = ops.quantize_fp8(self.buf[op.inp][:r, :k], op.group)
        self.packed(op.out, r, k)[:] = q
        self.packed(op.scale, r, scale.shape[1])[:] = scale

    def packed(self, name: str, rows: int, cols: int) -> np.ndarray:
        """The [rows, cols] row-major view at the start of a buffer (the W8A8 activations xq / xq_scale)."""
        return self.buf[name].reshape(-1)[:rows * cols].reshape(rows, cols)

    def op_qk_norm_rope_cache(self, op):
        r, layer = op.rows, self.kv[op.layer]
        qn = self.w[op.q_norm] if op.q_norm else None
        kn = self.w[op.k_norm] if op.k_norm else None
        q = ops.qk_norm_rope_cache(self.buf[op.qkv][:r], self.buf[op.positions][:r], self.buf[op.slot_mapping][:r],
                                   qn, kn, self.w[op.cos], self.w[op.sin], layer, op.num_heads, op.num_kv_heads,
                                   op.head_dim, op.eps)
        written = self.buf[op.slot_mapping][:r]
        written = written[written >= 0]
        if kv_cache.is_fp8(self.plan.kv_cache):
            for part, scale in enumerate(kv_cache.layer_scales(self.plan.kv_cache, op.layer)):
                layer[part, written] = kv_cache.stored(layer[part, written], self.plan.build.dtype, scale)
        else:
            layer[:, written] = round_to(layer[:, written], self.kv_dtype)
        self._set(op.q_out, r, q)

    def op_attention(self, op):
        r, s = op.rows, op.num_seqs
        out = ops.attention(self.buf[op.q][:r], self.kv[op.layer], self.buf[op.query_start_loc][: s + 1],
                            self.buf[op.seq_lens][:s], self.buf[op.block_tables][:s], self.plan.build.block_size,
                            op.scale)
        self._set(op.out, r, out)

    def op_silu_mul(self, op):
        self._set(op.out, op.rows, ops.silu_mul(self.buf[op.inp][:op.rows]))

    def op_gather_rows(self, op):
        self._set(op.out, op.rows, ops.gather_rows(self.buf[op.inp], self.buf[op.indices][:op.rows]))

    def op_apply_token_bitmask(self, op):
        r, b = op.rows, self.buf
        b[op.logits][:r] = ops.apply_token_bitmask(b[op.logits][:r], b[op.bitmask][:r], b[op.bitmask_rows][:r])

    def op_sample(self, op):
        r, b = op.rows, self.buf
        b[op.out][:r] = ops.sample(b[op.logits][:r], b[op.temperature][:r], b[op.top_k][:r], b[op.top_p][:r],
                                   b[op.seeds][:r], b[op.sample_offsets][:r])

"""Launch records of the collective ops of a tensor-parallel plan (docs/plan-format.md "Tensor parallel plans"):
NCCL calls as host-library records (library "nccl"; the launcher appends the communicator and the stream), captured
in each rank's CUDA graph like every other launch. NVLink SHARP (NVLS) stays off: NCCL_NVLS_ENABLE=0 in every rank
process (runtime/tp_ranks.py), and nothing calls cuMulticastCreate.
"""
from __future__ import annotations

from xserv_aot.plan.launch_records import i32, launch, library_call, ptr
from xserv_aot.plan.op_records import AllGather, AllReduce, KernelChoice

LIBRARY = "nccl"
NCCL_DTYPES = {"int32": 2, "float32": 7, "bfloat16": 9}   # ncclDataType_t (nccl.h)
NCCL_SUM = 0                                             # ncclRedOp_t ncclSum
GATHER_WORKSPACE = "logits_gathered"                     # [ranks, max_num_seqs, n] float32: ncclAllGather's output
ENV = {"NCCL_NVLS_ENABLE": "0"}                          # set in every rank process before NCCL is loaded


def _p(name: str, kind: str = "ptr") -> dict:
    return {"name": name, "type": kind, "pointee": None}


# parameters as in nccl.h; the last two (comm, stream) are appended by the launcher, not stored in the record
SIGNATURES = {
    "ncclAllReduce": [_p("sendbuff"), _p("recvbuff"), _p("count", "u64"), _p("datatype", "i32"), _p("op", "i32"),
                      _p("comm"), _p("stream")],
    "ncclAllGather": [_p("sendbuff"), _p("recvbuff"), _p("sendcount", "u64"), _p("datatype", "i32"), _p("comm"),
                      _p("stream")],
}


def plan_collective(op: AllReduce | AllGather, arena: dict) -> KernelChoice:
    """all_reduce: one in-place ncclAllReduce (sum) of buf[:rows]. all_gather: ncclAllGather of inp[:rows, :n]
    into the rank-major workspace, then gather_shard_columns lays the ranks' columns side by side in out."""
    if isinstance(op, AllReduce):
        info = arena[op.buf]
        count = op.rows * info["shape"][1]
        rec = library_call(LIBRARY, "ncclAllReduce", [ptr(op.buf), ptr(op.buf), ("u64", count),
                                                      i32(NCCL_DTYPES[info["dtype"]]), i32(NCCL_SUM)])
        return KernelChoice("nccl_all_reduce", (rec,))
    dtype = arena[op.inp]["dtype"]
    if arena[op.inp]["shape"][1] != op.n or dtype != "float32":
        raise ValueError(f"all_gather of {op.inp}: expects float32 rows of {op.n} columns")
    gather = library_call(LIBRARY, "ncclAllGather", [ptr(op.inp), ptr(GATHER_WORKSPACE), ("u64", op.rows * op.n),
                                                     i32(NCCL_DTYPES[dtype])])
    place = launch("gather_shard_columns", [op.rows, op.ranks], [256], 0,
                   [ptr(GATHER_WORKSPACE), ptr(op.out), i32(op.rows), i32(op.n), i32(op.ranks)])
    return KernelChoice("nccl_all_gather", (gather, place))


def add_collectives(manifest: dict, rank_model: dict, signatures: dict, add_buffer) -> dict | None:
    """Tensor-parallel plans: the all_gather workspace (add_buffer(manifest, name, shape, dtype)) and the NCCL
    signatures; returns the kernels section's `collectives` entry (None for an unsharded plan)."""
    tp, b = manifest["build"].get("tensor_parallel", 1), manifest["build"]
    if tp == 1:
        return None
    add_buffer(manifest, GATHER_WORKSPACE, [tp, b["max_num_seqs"], rank_model["vocab_size"] // tp], "float32")
    signatures.update(SIGNATURES)
    return {"library": LIBRARY, "ranks": tp, "env": ENV}

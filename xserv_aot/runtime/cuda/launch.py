"""The one generic launcher: replay a bucket's launch records (plan.kernel_build) as prepared launches.

A record (plan.op_records.LaunchRecord) is a kernel with its grid, block and smem, or a host-library entry point
(the stream is appended); each argument is (kind, value): ("ptr", buffer name | None[, byte offset]),
("kv", layer), ("tmap", spec) (encoded here, once: runtime/cuda/tensor_map.py) or a scalar (i32|u32|u64|i64|f32, value) (docs/plan-format.md, "Launch records").
"""
from __future__ import annotations

import math
from typing import Callable

from xserv_aot.dtypes import ITEMSIZE
from xserv_aot.errors import XservError
from xserv_aot.plan.op_records import Op
from xserv_aot.runtime.cuda.driver import HostCall, Launch


class LaunchError(XservError, ValueError):
    """A launch record whose function or buffers the runtime cannot resolve; one line."""


class Buffers:
    """Name -> device pointer over the three allocations (weights, arena, KV pool)."""

    def __init__(self, plan, weights_ptr: int, arena_ptr: int, kv_ptr: int):
        self.plan, self.w, self.a, self.kv = plan, weights_ptr, arena_ptr, kv_ptr
        kv = plan.kv_cache
        self.layer_bytes = math.prod(kv["shape"][1:]) * ITEMSIZE[kv["dtype"]]

    def __call__(self, name: str | None) -> int:
        if name is None:
            return 0
        if name in self.plan.arena:
            return self.a + self.plan.arena[name].offset
        if name in self.plan.weights:
            return self.w + self.plan.weights[name].offset
        raise LaunchError(f"launch names buffer {name!r}, which is neither an arena buffer nor a weight")

    def kv_layer(self, layer: int) -> int:
        return self.kv + int(layer) * self.layer_bytes

    def resolve(self, arg) -> tuple[str, object]:
        """One record argument -> (C type, value) with device pointers filled in."""
        kind, value = arg[0], arg[1]
        if kind == "ptr":
            base = self(value)
            return "ptr", base + int(arg[2]) if len(arg) > 2 and base else base
        if kind == "kv":
            return "ptr", self.kv_layer(value)
        if kind == "tmap":
            from xserv_aot.runtime.cuda.tensor_map import encode
            return "tmap", encode(value, self(value["buffer"]))
        return kind, value


def op_launches(op: Op, buf: Buffers, funcs: Callable[[str], object], libraries: dict | None = None) -> list:
    """Prepared launches (Launch / HostCall) for one op, in order; empty for ops fused into a neighbour. A kernel
    runs under programmatic dependent launch where its record says pdl (the planner marks them: build.pdl)."""
    if op.cuda is None:
        raise LaunchError(f"op {op.op} has no CUDA launch in the plan; recompile the plan for a GPU target")
    out = []
    for rec in op.cuda.launch:
        args = [buf.resolve(a) for a in rec.args]
        if rec.library:
            if not libraries or rec.library not in libraries:
                raise LaunchError(f"launch {rec.fn} needs the plan's {rec.library}, which was not loaded")
            out.append(HostCall(rec.fn, libraries[rec.library].entry(rec.fn, args)))
        else:
            out.append(Launch(rec.fn, funcs(rec.fn), rec.grid, rec.block, rec.smem, args, rec.pdl))
    return out

"""Turn a bucket's annotated ops (kernel + launch geometry from plan.kernel_build) into prepared launches.

Argument lists here mirror the kernel signatures in kernels/*.cu one for one.
"""
from __future__ import annotations

from typing import Callable

from xserv_aot.runtime.cuda.driver import HostCall, Launch


class LaunchError(ValueError):
    """An op whose kernel or buffers the runtime cannot resolve; one line."""


class Buffers:
    """Name -> device pointer over the three allocations (weights, arena, KV pool)."""

    def __init__(self, plan, weights_ptr: int, arena_ptr: int, kv_ptr: int):
        self.plan, self.w, self.a, self.kv = plan, weights_ptr, arena_ptr, kv_ptr
        m, b = plan.model, plan.build
        self.num_slots = b.num_blocks * b.block_size
        self.layer_bytes = 2 * self.num_slots * m.num_kv_heads * m.head_dim * 2

    def __call__(self, name: str | None) -> int:
        if name is None:
            return 0
        if name in self.plan.arena:
            return self.a + self.plan.arena[name].offset
        if name in self.plan.weights:
            return self.w + self.plan.weights[name].offset
        raise LaunchError(f"op names buffer {name!r}, which is neither an arena buffer nor a weight")

    def kv_layer(self, layer: int) -> int:
        return self.kv + int(layer) * self.layer_bytes

    def shape(self, name: str) -> list[int]:
        info = self.plan.arena.get(name) or self.plan.weights.get(name)
        return info.shape


def op_launches(op: dict, buf: Buffers, funcs: Callable[[str], object], gemm=None) -> list:
    """Prepared launches (Launch / HostCall) for one op, in order; empty for ops fused into a neighbour."""
    plan = buf.plan
    m, b = plan.model, plan.build
    kind = op["op"]
    specs = op.get("launch")
    if specs is None:
        raise LaunchError(f"op {kind} has no CUDA launch in the plan; recompile the plan for a GPU target")
    rows = int(op.get("rows", 0))
    P, I32, F32 = "ptr", "i32", "f32"

    if kind == "linear" and op.get("kernel") == "cutlass":
        if gemm is None:
            raise LaunchError("plan uses the CUTLASS GEMM library but it was not loaded")
        cfg, a, w, c, bias = int(op["gemm_config"]), buf(op["inp"]), buf(op["weight"]), buf(op["out"]), buf(op.get("bias"))
        n, k = int(op["n"]), int(op["k"])
        return [HostCall(f"cutlass[{cfg}]", lambda s: gemm.gemm(cfg, a, w, c, bias or None, rows, n, k, s))]

    def args_for(fn: str) -> list[tuple[str, object]]:
        if kind == "embedding":
            return [(P, buf(op["ids"])), (P, buf(op["table"])), (P, buf(op["out"])), (I32, m.hidden_size),
                    (I32, m.vocab_size)]
        if kind == "rmsnorm":
            return [(P, buf(op["inp"])), (P, buf(op["weight"])), (P, buf(op["out"])), (I32, m.hidden_size),
                    (F32, op["eps"])]
        if kind == "add_rmsnorm":
            return [(P, buf(op["residual"])), (P, buf(op["delta"])), (P, buf(op["weight"])), (P, buf(op["out"])),
                    (I32, m.hidden_size), (F32, op["eps"])]
        if kind == "silu_mul":
            return [(P, buf(op["inp"])), (P, buf(op["out"])), (I32, rows), (I32, op["inter"])]
        if kind == "gather_rows":
            return [(P, buf(op["inp"])), (P, buf(op["indices"])), (P, buf(op["out"])), (I32, m.hidden_size),
                    (I32, buf.shape(op["inp"])[0])]
        if kind == "linear":
            n, k = int(op["n"]), int(op["k"])
            if fn == "gemm_64x64_splitk":
                return [(P, buf(op["inp"])), (P, buf(op["weight"])), (P, 0), (P, buf("gemm_splitk_ws")),
                        (I32, rows), (I32, n), (I32, k)]
            if fn == "splitk_reduce":
                out_f32 = int(plan.arena[op["out"]].dtype == "float32")
                return [(P, buf("gemm_splitk_ws")), (P, buf(op.get("bias"))), (P, buf(op["out"])), (I32, rows),
                        (I32, n), (I32, op["splits"]), (I32, out_f32)]
            if fn.startswith("gemv_gate") or (fn.startswith("skinny") and "_gate_" in fn):
                return [(P, buf(op["inp"])), (P, buf(op["weight"])), (P, buf(op["fused_silu_out"])), (I32, rows),
                        (I32, n // 2), (I32, k)]
            return [(P, buf(op["inp"])), (P, buf(op["weight"])), (P, buf(op.get("bias"))), (P, buf(op["out"])),
                    (I32, rows), (I32, n), (I32, k)]
        if kind == "qk_norm_rope_cache":
            return [(P, buf(op["qkv"])), (P, buf(op["positions"])), (P, buf(op["slot_mapping"])),
                    (P, buf(op.get("q_norm"))), (P, buf(op.get("k_norm"))), (P, buf(op["cos"])), (P, buf(op["sin"])),
                    (P, buf(op["q_out"])), (P, buf.kv_layer(op["layer"])), (I32, m.num_heads), (I32, m.num_kv_heads),
                    (F32, op["eps"]), (I32, buf.num_slots)]
        if kind == "attention":
            common = [(P, buf(op["q"])), (P, buf.kv_layer(op["layer"])), (P, buf(op["query_start_loc"])),
                      (P, buf(op["seq_lens"])), (P, buf(op["block_tables"]))]
            max_blocks = buf.shape(op["block_tables"])[1]
            if fn.startswith("attn_decode"):
                return common + [(P, buf("attn_part_o")), (P, buf("attn_part_ml")), (P, buf("attn_counters")),
                                 (P, buf(op["out"])), (I32, rows), (I32, m.num_heads), (I32, m.num_kv_heads),
                                 (I32, b.block_size), (I32, max_blocks), (I32, buf.num_slots), (F32, op["scale"]),
                                 (I32, op["splits"])]
            return common + [(P, buf(op["out"])), (I32, rows), (I32, op["num_seqs"]), (I32, m.num_heads),
                             (I32, m.num_kv_heads), (I32, b.block_size), (I32, max_blocks), (I32, buf.num_slots),
                             (F32, op["scale"])]
        if kind == "apply_token_bitmask":
            return [(P, buf(op["logits"])), (P, buf(op["bitmask"])), (P, buf(op["bitmask_rows"])), (I32, op["n"])]
        if kind == "sample":
            return [(P, buf(op["logits"])), (P, buf(op["temperature"])), (P, buf(op["top_k"])), (P, buf(op["top_p"])),
                    (P, buf(op["seeds"])), (P, buf(op["sample_offsets"])), (P, buf(op["out"])),
                    (P, buf("sample_scaled")), (I32, m.vocab_size)]
        raise LaunchError(f"op {kind!r} has no CUDA argument list")

    out = []
    for spec in specs:
        fn = spec["fn"]
        out.append(Launch(fn, funcs(fn), tuple(spec["grid"]), tuple(spec["block"]), int(spec["smem"]), args_for(fn)))
    return out

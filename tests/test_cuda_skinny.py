"""kernels/gemm_skinny.cu (decode linears of 3..64 rows) against runtime/numpy_ops.py on fresh random inputs.

Outputs are poisoned with NaN first: a pass means every element was written, and ||out - ref|| / ||ref|| <= 1e-2
(computed in float64). The routing test (no GPU) checks which kernels plan.kernel_build picks.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import bf, lib, rng  # noqa: F401  (fixtures)
from xserv_aot.plan import kernel_build as kb
from xserv_aot.plan.op_records import Linear
from xserv_aot.runtime import numpy_ops as ref

TOL = 1e-2


def check(out, want):
    out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
    assert out.shape == want.shape
    assert np.isfinite(out).all(), f"{(~np.isfinite(out)).sum()} NaN / unwritten elements"
    err = np.linalg.norm(out - want) / max(np.linalg.norm(want), 1e-30)
    assert err <= TOL, f"relative error {err:.2e}"


def skinny_op(M, N, K, out_dtype, bn=None, gate=False):
    """(the linear, the kernel plan_skinny chose); bn forces the block width instead of the routing rule."""
    op = Linear(rows=M, n=N, k=K, inp="x", weight="w", bias="b", out="out")
    return op, kb.plan_skinny(op, "f32" if out_dtype == "float32" else "bf16", "silu_out" if gate else None, bn)


def run_linear(lib, choice, x, w, b, out_dtype):
    (spec,) = choice.launch
    M, N = spec.args[4][1], spec.args[5][1]
    out = lib.empty((M, N), out_dtype)
    lib.launch_record(spec, {"x": x, "w": w, "b": b, "out": out})
    return out.numpy()


CASES = [  # M, N, K, out dtype, bias, block width
    (3, 1000, 576, "bfloat16", True, 32),
    (4, 30, 64, "bfloat16", True, 32),             # N < one block, fewer K steps than warps
    (8, 1002, 584, "float32", False, 64),          # K not a multiple of 32
    (13, 6144, 4096, "bfloat16", True, 32),        # qkv (with a bias, as Qwen2)
    (32, 4096, 4096, "bfloat16", False, 32),       # o_proj
    (37, 4096, 12288, "bfloat16", False, 32),      # down, M not a multiple of 8
    (64, 6144, 4096, "bfloat16", False, 32),
    (64, 4096, 12288, "float32", True, 64),
    (16, 24576, 4096, "bfloat16", False, 64),      # gate_up, unfused
    (64, 1000, 576, "float32", True, 32),
    (5, 151936, 4096, "float32", False, 64),       # lm_head
]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,out_dtype,bias,bn", CASES)
def test_skinny_linear(lib, rng, M, N, K, out_dtype, bias, bn):
    x = bf(rng.standard_normal((M, K), dtype=np.float32))
    w = bf(rng.standard_normal((N, K), dtype=np.float32) * np.float32(K ** -0.5))
    b = bf(rng.standard_normal(N)) if bias else None
    _, op = skinny_op(M, N, K, out_dtype, bn)
    assert op.kernel.startswith(f"skinny{bn}_")
    dx, dw = lib.to_device(x, "bfloat16"), lib.to_device(w, "bfloat16")
    db = lib.to_device(b, "bfloat16") if bias else None
    out = run_linear(lib, op, dx, dw, db, out_dtype)
    check(out, ref.linear(x, w, b))
    np.testing.assert_array_equal(run_linear(lib, op, dx, dw, db, out_dtype), out)   # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("M,inter,K,bn", [(3, 768, 576, 32), (21, 1000, 584, 64), (64, 12288, 4096, 64),
                                          (8, 12288, 4096, 32)])
def test_skinny_gate_silu(lib, rng, M, inter, K, bn):
    x = bf(rng.standard_normal((M, K), dtype=np.float32))
    w = bf(rng.standard_normal((2 * inter, K), dtype=np.float32) * np.float32(K ** -0.5))
    _, op = skinny_op(M, 2 * inter, K, "bfloat16", bn, gate=True)
    (spec,) = op.launch
    assert "_gate_" in spec.fn
    out = lib.empty((M, inter), "bfloat16")
    lib.launch_record(spec, {"x": lib.to_device(x, "bfloat16"), "w": lib.to_device(w, "bfloat16"), "silu_out": out})
    check(out.numpy(), ref.silu_mul(bf(ref.linear(x, w))))


@pytest.mark.parametrize("rows,kind,want", [(1, "decode", "gemv_m1_bf16"), (2, "decode", "gemv_m2_bf16"),
                                            (3, "decode", "skinny32_m8_bf16"), (33, "decode", "skinny32_m64_bf16"),
                                            (64, "prefill", "gemm_64x64_splitk")])
def test_routing_by_rows(rows, kind, want):
    op = Linear(rows=rows, n=4096, k=4096, inp="x", weight="w", bias=None, out="y")
    assert kb.plan_linear(op, "bfloat16", None, None, kind == "decode").kernel == want
    wide = kb.plan_linear(Linear(rows=16, n=151936, k=4096, inp="x", weight="w", bias=None, out="y"), "float32", None,
                          None, True)
    assert wide.kernel == "skinny64_m16_f32" and wide.launch[0].grid[0] * 64 >= 151936


def test_skinny_smem_fits_the_rings_and_the_partial_sums():
    from xserv_aot.plan.kernel_constants import SK_RT, SK_STAGES, SK_WARPS, skinny_smem
    for mt in (8, 16, 32, 64):
        assert skinny_smem(mt) >= SK_WARPS * SK_STAGES * SK_RT * 16 * 128          # every warp's weight ring
        assert skinny_smem(mt) >= SK_WARPS * SK_RT * (mt // 8) * 4 * 32 * 4 <= 227 * 1024

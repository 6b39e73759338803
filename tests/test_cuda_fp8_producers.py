"""quantize_fp8 folded into the kernels that produce its input (build setting fp8_quantize_in_producer:
rmsnorm_q / add_rmsnorm_q / silu_mul_q in kernels/elementwise.cu) on the GPU, bit-exact against the plain kernels
and NumPy's quantize_fp8 of their bf16 output (fresh inputs, seed printed on failure, outputs poisoned); the plan
routing test at the end needs no GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import bf, lib, rng  # noqa: F401  (fixtures)
from xserv_aot import fp8
from xserv_aot.runtime import numpy_ops


@pytest.mark.gpu
@pytest.mark.parametrize("rows,H,group", [(5, 4096, 128), (64, 4096, 4096), (3, 576, 128), (7, 576, 576)])
@pytest.mark.parametrize("kind", ["rmsnorm", "add_rmsnorm"])
def test_norms_quantizing_their_output(lib, rng, rows, H, group, kind):
    """rmsnorm_q / add_rmsnorm_q: the plain kernel's bytes (out, residual) and quantize_fp8 of out bit-exact
    (NumPy's quantize_fp8 of the bf16 output)."""
    from xserv_aot.plan.elementwise_plan import norm_threads
    from xserv_aot.plan.launch_records import f32, i32, launch, ptr
    x = bf(rng.standard_normal((rows, H), dtype=np.float32) * np.exp(rng.uniform(-2, 2, (rows, 1))).astype(np.float32))
    d, w = bf(rng.standard_normal((rows, H), dtype=np.float32)), bf(rng.uniform(0.5, 1.5, H).astype(np.float32))
    groups = fp8.groups(H, group)
    outs = {}
    for fn in (kind, kind + "_q"):
        bufs = {"x": lib.to_device(x, "bfloat16"), "d": lib.to_device(d, "bfloat16"), "w": lib.to_device(w, "bfloat16"),
                "out": lib.empty((rows, H), "bfloat16"), "xq": lib.empty((rows, H), "float8_e4m3fn"),
                "xs": lib.empty((rows, groups), "float32")}
        for k in ("out", "xq", "xs"):
            lib.dev.memset(bufs[k].ptr, 0xFF, bufs[k].nbytes)
        head = [ptr("x")] if kind == "rmsnorm" else [ptr("x"), ptr("d")]
        q = fn.endswith("_q")
        args = head + [ptr("w"), ptr("out")] + ([ptr("xq"), ptr("xs")] if q else []) + [i32(H), f32(1e-6)] + \
            ([i32(group)] if q else [])
        lib.launch_record(launch(fn, [rows], [norm_threads(H)], 0, args), bufs)
        outs[fn] = {k: bufs[k].numpy() for k in ("out", "x", "xq", "xs")}
    plain, fused = outs[kind], outs[kind + "_q"]
    np.testing.assert_array_equal(fused["out"], plain["out"])
    np.testing.assert_array_equal(fused["x"], plain["x"])
    want_q, want_s = numpy_ops.quantize_fp8(plain["out"].astype(np.float32), group)
    np.testing.assert_array_equal(fused["xs"], want_s)
    np.testing.assert_array_equal(fused["xq"].astype(np.float32), want_q)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,inter", [(5, 12288), (64, 768), (1, 128)])
def test_silu_mul_quantizing_its_output(lib, rng, rows, inter):
    from xserv_aot.plan.launch_records import i32, launch, ptr
    g = bf(rng.standard_normal((rows, 2 * inter), dtype=np.float32) * 3)
    outs = {}
    for fn in ("silu_mul", "silu_mul_q"):
        bufs = {"g": lib.to_device(g, "bfloat16"), "out": lib.empty((rows, inter), "bfloat16"),
                "xq": lib.empty((rows, inter), "float8_e4m3fn"), "xs": lib.empty((rows, inter // 128), "float32")}
        for k in ("out", "xq", "xs"):
            lib.dev.memset(bufs[k].ptr, 0xFF, bufs[k].nbytes)
        q = fn == "silu_mul_q"
        grid = [min(-(-(rows * inter // 8) // 256), 4096)]
        lib.launch_record(launch(fn, grid, [256], 0, [ptr("g"), ptr("out")] + ([ptr("xq"), ptr("xs")] if q else []) +
                                 [i32(rows), i32(inter)]), bufs)
        outs[fn] = {k: bufs[k].numpy() for k in ("out", "xq", "xs")}
    np.testing.assert_array_equal(outs["silu_mul_q"]["out"], outs["silu_mul"]["out"])
    want_q, want_s = numpy_ops.quantize_fp8(outs["silu_mul"]["out"].astype(np.float32), 128)
    np.testing.assert_array_equal(outs["silu_mul_q"]["xs"], want_s)
    np.testing.assert_array_equal(outs["silu_mul_q"]["xq"].astype(np.float32), want_q)


@pytest.mark.parametrize("scheme", ["auto", "channel"])
def test_producers_quantize_when_enabled(tmp_path, scheme):
    """fp8_quantize_in_producer: a quantize_fp8 after rmsnorm / add_rmsnorm (any group) or silu_mul (groups of 128)
    is fused into it, unless the linear after quantizes itself (blkq); after attention it still launches."""
    pytest.importorskip("cuda.core")
    from tests.test_cuda_fp8 import compile_fp8_tiny
    plan = compile_fp8_tiny(tmp_path, prefill_buckets=[16, 128], fp8_w8a16_max_rows=2, fp8_scheme=scheme,
                            fp8_quantize_in_producer=True, gemm_library=True)
    seen = set()
    for bk in plan.buckets:
        for i, op in enumerate(bk.ops):
            if op.op != "quantize_fp8":
                continue
            prev, lin = bk.ops[i - 1], bk.ops[i + 1]
            blkq = lin.cuda.launch[0].fn.startswith("skinny_w8a8_blkq_")
            producer = prev.op in ("rmsnorm", "add_rmsnorm") or (prev.op == "silu_mul" and op.group == 128)
            want = "fused_into_next" if blkq else "fused_into_previous" if producer else "quantize_fp8"
            assert op.cuda.kernel == want, (bk.name, prev.op, op.cuda.kernel)
            assert (prev.cuda.kernel.endswith("_q")) == (want == "fused_into_previous")
            seen.add(want)
    assert "fused_into_previous" in seen and "quantize_fp8" in seen

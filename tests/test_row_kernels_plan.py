"""plan/row_kernels.py routing: prefill_row_kernels "rows" gives the prefill buckets of >= ROWS_FROM rows the
rows_prefill.cu kernels with the planner's geometry, and changes nothing else (every other bucket's launch records,
the decode buckets' cubins); "auto" is AUTO; a bad value is refused."""
from __future__ import annotations

import pytest

pytest.importorskip("cuda.core")

from tests.test_kernel_build import compile_tiny  # noqa: E402
from xserv_aot.config import BuildConfig, ConfigError  # noqa: E402
from xserv_aot.plan import row_kernels as rk  # noqa: E402

BUCKETS = dict(prefill_buckets=[64, rk.ROWS_FROM], max_seq_len=2 * rk.ROWS_FROM)


def launches(plan) -> dict:
    return {bk.name: [(op.op, op.cuda.launch) for op in bk.ops] for bk in plan.buckets}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    out = {c: compile_tiny(tmp_path_factory.mktemp(c), mp, prefill_row_kernels=c, **BUCKETS)
           for c in ("v1", "rows", "auto")}
    mp.undo()
    return out


def test_rows_only_in_big_prefill_buckets(plans):
    old, new = launches(plans["v1"]), launches(plans["rows"])
    assert old.keys() == new.keys()
    big = f"prefill_{rk.ROWS_FROM}"
    for name in old:
        if name != big:
            assert new[name] == old[name], name
    changed = {op for (op, a), (_, b) in zip(old[big], new[big]) if a != b}
    assert changed == {"add_rmsnorm", "rmsnorm", "silu_mul", "qk_norm_rope_cache"}
    hidden, m = 256, plans["rows"].model
    for op in next(bk for bk in plans["rows"].buckets if bk.name == big).ops:
        rec = op.cuda.launch[0] if op.cuda.launch else None
        if op.op in ("add_rmsnorm", "rmsnorm"):
            assert rec.fn == f"{op.op}_rows_k{rk.NORM_K}" + ("_ef" if rk.NORM_EF else ""), rec.fn
            assert rec.grid[0] == op.rows and rec.block[0] == 32 * rk.norm_warps(hidden, rk.NORM_K)
        elif op.op == "silu_mul":
            assert rec.fn.startswith("silu_mul_rows_u") and rec.grid[0] == op.rows
        elif op.op == "qk_norm_rope_cache":
            assert rec.fn == "qk_norm_rope_cache_rows" + ("_ef" if rk.ROPE_EF else "") + "_hd64"
            assert rec.smem == rk.rope_rows_smem(64, m.num_heads, m.num_kv_heads)


def test_cubins_of_the_replaced_kernels_unchanged(plans):
    a, b = plans["v1"].kernels["cubins"], plans["rows"].kernels["cubins"]
    assert a == b                                   # every source built the same, rows_prefill.cu included


def test_auto_is_the_measured_default(plans):
    assert launches(plans["auto"]) == launches(plans[rk.AUTO])


def test_bad_choice_is_refused():
    with pytest.raises(ConfigError, match="prefill_row_kernels"):
        BuildConfig(prefill_row_kernels="fast").validate()


def test_norm_warps_cover_the_row():
    for hidden, k, warps in ((4096, 4, 4), (4096, 2, 8), (4096, 8, 2), (576, 2, 2), (8192, 8, 4), (256, 4, 1)):
        assert rk.norm_warps(hidden, k) == warps
    assert rk.norm_rows_fits(8192) and not rk.norm_rows_fits(8200)
    assert rk.uses_rows("rows", "prefill", rk.ROWS_FROM) and not rk.uses_rows("rows", "prefill", rk.ROWS_FROM - 1)
    assert not rk.uses_rows("v1", "prefill", 8192) and not rk.uses_rows("rows", "decode", 8192)


@pytest.fixture(scope="module")
def fp8_plans(tmp_path_factory):
    """Tiny FP8 plans whose 64-row prefill bucket gets the rows kernels (ROWS_FROM and QUANT_ROWS_FROM lowered to
    64; TMA W8A8, no CUTLASS library): quantize folded into the producers or not, and the v1 plan to compare with."""
    mp = pytest.MonkeyPatch()
    mp.setattr(rk, "ROWS_FROM", 64)
    mp.setattr(rk, "QUANT_ROWS_FROM", 64)
    fp8 = dict(quantization="fp8", fp8_w8a16_max_rows=2, fp8_w8a8_tma=True)
    out = {name: compile_tiny(tmp_path_factory.mktemp(name), mp, prefill_row_kernels=choice,
                              fp8_quantize_in_producer=fold, **fp8)
           for name, choice, fold in (("fold", "rows", True), ("plain", "rows", False), ("v1", "v1", True))}
    mp.undo()
    return out


def bucket_ops(plan, name):
    return next(bk for bk in plan.buckets if bk.name == name).ops


def test_fp8_prefill_rows_write_the_quantized_rows_only(fp8_plans):
    """Folded: every norm / silu_mul before a quantize_fp8 runs its `_qonly` rows kernel (the bf16 output has no
    reader) and the quantize is fused into it; the final norm stores; the quantize after attention runs
    quantize_fp8_rows; the other buckets keep v1's records."""
    ops, hidden = bucket_ops(fp8_plans["fold"], "prefill_64"), 256
    seen = set()
    for i, op in enumerate(ops):
        rec = op.cuda.launch[0] if op.cuda.launch else None
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        if op.op in ("rmsnorm", "add_rmsnorm", "silu_mul") and nxt.op == "quantize_fp8":
            want = (f"{op.op}_rows_k{rk.NORM_K}_qonly" if op.op != "silu_mul"
                    else f"silu_mul_rows_u{rk.SILU_U}_qonly")
            assert rec.fn == want and rec.fn in rk.QUANTIZING, rec.fn
            assert nxt.cuda.kernel == "fused_into_previous"
            assert [a for a in rec.args if a[0] == "ptr"][-2:] == [("ptr", nxt.out), ("ptr", nxt.scale)]
            seen.add(op.op)
        elif op.op == "quantize_fp8" and op.cuda.launch:
            assert ops[i - 1].op == "attention" and rec.fn == f"quantize_fp8_rows_k{rk.QUANT_K}"
            assert rec.grid[0] == op.rows and rec.block[0] == 32 * rk.norm_warps(op.k, rk.QUANT_K)
            seen.add(op.op)
        elif op.op == "add_rmsnorm":
            assert nxt.op == "gather_rows" and rec.fn == f"add_rmsnorm_rows_k{rk.NORM_K}", rec.fn
    assert seen == {"rmsnorm", "add_rmsnorm", "silu_mul", "quantize_fp8"}
    old, new = launches(fp8_plans["v1"]), launches(fp8_plans["fold"])
    assert all(new[name] == old[name] for name in old if name != "prefill_64")
    assert any(r.fn == "add_rmsnorm_q" for _, recs in old["prefill_64"] for r in recs)


def test_fp8_prefill_rows_without_folding_quantize_on_their_own(fp8_plans):
    ops = bucket_ops(fp8_plans["plain"], "prefill_64")
    quants = [op for op in ops if op.op == "quantize_fp8"]
    assert quants and all(op.cuda.launch[0].fn == f"quantize_fp8_rows_k{rk.QUANT_K}" for op in quants)
    norms = [op.cuda.launch[0].fn for op in ops if op.op in ("rmsnorm", "add_rmsnorm", "silu_mul")]
    assert norms and not any(fn in rk.QUANTIZING for fn in norms), norms


def test_quantize_rows_fits_and_skipping_the_output_needs_quantize():
    from xserv_aot.plan.op_records import QuantizeFp8, SiluMul
    q = lambda k, group: QuantizeFp8(rows=8, inp="a", out="xq", scale="xs", k=k, group=group)  # noqa: E731
    assert rk.quantize_rows_fits(q(4096, 128)) and rk.quantize_rows_fits(q(1040, 1040))
    assert not rk.quantize_rows_fits(q(4096, 256)) and not rk.quantize_rows_fits(q(4100, 4100))
    assert not rk.quantize_rows_fits(q(8 * 256 * rk.QUANT_K * 33, 128))          # 33 warps a row
    with pytest.raises(ValueError, match="only when it quantizes"):
        rk.silu_rows_launch(SiluMul(8, inp="g", out="a", inter=1024), store_out=False)

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

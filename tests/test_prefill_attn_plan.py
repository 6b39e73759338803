"""The prefill attention launch of plan_attention (plan/attention_plan.py), every variant: the kernel exists in
kernels/attention_prefill*.cu with the op's argument kinds, the dynamic shared memory fits an H200 SM, and the
grid has a (seq, tile) block for every query tile of any split of the rows into seqs. No GPU."""
from __future__ import annotations

import numpy as np
import pytest

from xserv_aot.config import BuildConfig, ConfigError
from xserv_aot.plan import attention_plan as ap
from xserv_aot.plan import signatures as sg
from xserv_aot.plan.kernel_constants import PREFILL_F8KV_STAGING
from xserv_aot.plan.nvrtc_build import KernelBuildError
from xserv_aot.plan.op_records import Attention

H200_SMEM_PER_BLOCK = 227 * 1024
MODEL = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}


def op(rows, num_seqs, hd=128):
    return Attention(q="q", kv_cache="kv_cache", layer=3, query_start_loc="qsl", seq_lens="lens", block_tables="bt",
                     out="attn", rows=rows, num_seqs=num_seqs, num_heads=32, num_kv_heads=8, head_dim=hd,
                     scale=hd ** -0.5)


def test_prefill_bucket_runs_the_default_variant_then_the_batched_decode_kernel():
    choice = ap.plan_attention(op(2048, 256), "prefill", MODEL, {"max_seq_len": 8192}, 16, 512, 640000)
    pre, dec = choice.launch
    tiers = dict(ap.PREFILL_ATTN_TIERS)
    assert pre.fn == f"attn_prefill_{tiers[2048][128][0]}_hd128"
    for rows, least in ((8192, 2048), (4096, 2048), (2048, 2048), (2047, 0), (16, 0)):
        got = ap.plan_attention(op(rows, 16), "prefill", MODEL, {"max_seq_len": 8192}, 16, 512, 640000)
        assert got.launch[0].fn == f"attn_prefill_{tiers[least][128][0]}_hd128", rows
    assert [least for least, _ in ap.PREFILL_ATTN_TIERS] == sorted(tiers, reverse=True) and 0 in tiers
    defaults = {v for _, table in ap.PREFILL_ATTN_TIERS for vs in table.values() for v in vs}
    assert defaults <= set(ap.PREFILL_ATTN_VARIANTS)
    for _, table in ap.PREFILL_ATTN_TIERS:
        assert all(ap.prefill_tiles(vs[-1])[1] == 1 for vs in table.values()), "the last one fits any head groups"
    assert ap.PREFILL_ATTN_OTHER_HD in ap.PREFILL_ATTN_BOTH_HD, "unswept head sizes get a kernel built for hd 64"
    small = ap.plan_attention(op(256, 16, hd=64), "prefill", dict(MODEL, head_dim=64), {"max_seq_len": 8192}, 16, 512,
                              640000)
    assert small.launch[0].fn == f"attn_prefill_{ap.PREFILL_ATTN_OTHER_HD}_hd64"
    assert dec.fn.startswith("attn_decode_")
    assert pre.args[-1] == ("i32", 2), "min_rows 2: one-row seqs are the decode kernel's"


BUILT = [(v, 128) for v in ap.PREFILL_ATTN_VARIANTS] + [(v, 64) for v in ap.PREFILL_ATTN_BOTH_HD]
SOURCES = ("attention_prefill.cu", "attention_prefill_pipe.cu", "attention_prefill_wgmma.cu")


@pytest.mark.parametrize("variant,hd", BUILT)
def test_every_variant_launches_a_built_kernel_with_its_argument_kinds(variant, hd):
    sigs = {fn: p for src in SOURCES for fn, p in sg.kernel_signatures(src).items()}
    m = dict(MODEL, head_dim=hd)
    common = [("ptr", "q"), ("kv", 3), ("ptr", "qsl"), ("ptr", "lens"), ("ptr", "bt")]
    tail = [("i32", 16), ("i32", 512), ("i32", 640000), ("f32", hd ** -0.5)]
    rec = ap.prefill_attn_launch(op(8192, 256, hd), m, common, tail, variant)
    assert rec.fn in sigs, rec.fn
    kinds = ["ptr" if k == "kv" else k for k, _ in rec.args]
    assert kinds == [p["type"] for p in sigs[rec.fn]]
    assert rec.smem <= H200_SMEM_PER_BLOCK and rec.block[0] in (128, 256, 384, 512)
    f8kv = {f"attn_prefill_f8kv_{v}_hd128" for v in ap.PREFILL_ATTN_F8KV} | {
        f"attn_prefill_f8kv_{ap.PREFILL_ATTN_F8KV_HD64}_hd64"}
    assert set(sigs) == {"attn_prefill_hd64", "attn_prefill_hd128"} | {f"attn_prefill_{v}_hd{h}" for v, h in BUILT
                                                                       if v != "v1"} | f8kv, "built == listed"
    assert rec.grid[1] <= 65535


@pytest.mark.parametrize("variant", ap.PREFILL_ATTN_VARIANTS)
def test_grid_covers_every_query_tile_of_any_split_of_the_rows(variant, seed):
    rng = np.random.default_rng(seed)
    rec = ap.prefill_attn_launch(op(1000, 16), MODEL, [], [], variant)
    if variant in ap.PREFILL_ATTN_WGMMA:                     # 64 rows a warpgroup, h heads a block share them
        heads = int(variant.split("h")[1][0])
        rows_per_tile = int(variant[2]) * 64 // min(heads, int(variant[2]))
        assert rec.grid[0] * heads == 32
    else:
        rows_per_tile = 64 if variant == "v1" else 16 * rec.block[0] // 32 * int(variant.split("m")[1].split("k")[0])
    tile_blocks = rec.grid[0] if variant == "v1" else rec.grid[1]
    heads = rec.grid[1] if variant == "v1" else rec.grid[0]
    assert heads == 32 or variant in ap.PREFILL_ATTN_WGMMA
    for _ in range(200):
        cuts = np.sort(rng.integers(0, 1001, 15))
        n = np.diff(np.concatenate([[0], cuts, [1000]]))
        assert sum(-(-int(x) // rows_per_tile) for x in n) <= tile_blocks, n.tolist()


@pytest.mark.parametrize("variant,fp8_kv", [(v, False) for v in ap.PREFILL_ATTN_VARIANTS]
                         + [(v, True) for v in ap.PREFILL_ATTN_F8KV])
def test_grid_has_a_few_partial_tiles_not_a_row_per_seq_slot(variant, fp8_kv):
    """Blocks past the last pair find no work: a 256-slot bucket gets the prompt's tiles plus PREFILL_EXTRA_TILES
    rows, and the kernels' blocks loop over the pairs past them (tests/test_cuda_prefill.py, test_cuda_kv_fp8.py);
    v1 (no loop) keeps a row per seq slot."""
    rows_per_tile = ap.prefill_tiles(variant)[0]
    for rows, seqs in ((4096, 256), (2048, 256), (1000, 5), (1000, 16)):
        rec = ap.prefill_attn_launch(op(rows, seqs), MODEL, [], [], variant, scales=(0.5, 0.25) if fp8_kv else None)
        tiles_axis, extra = (0, seqs) if variant == "v1" else (1, min(seqs, ap.PREFILL_EXTRA_TILES))   # v1: a slot each
        assert rec.grid[tiles_axis] == -(-rows // rows_per_tile) + extra, (rows, seqs, rec.grid)
        assert rec.grid[1 - tiles_axis] * ap.prefill_tiles(variant)[1] == MODEL["num_heads"]


def test_a_default_that_shares_kv_tiles_across_q_heads_gives_way_where_they_do_not_divide(monkeypatch):
    monkeypatch.setattr(ap, "PREFILL_ATTN_TIERS", ((2048, {128: ("ws2h2k64s4oplq", "ws3h1k64s4o")}),
                                                   (0, {128: ("ws2h4k64s4", "ws2h2k64s4", "w4m2k16s4")})))
    fn = {}
    for q_heads in (32, 16, 24):                             # 4, 2 and 3 q heads a KV head
        m = dict(MODEL, num_heads=q_heads)
        fn[q_heads] = [ap.plan_attention(op(rows, 4), "prefill", m, {"max_seq_len": 8192}, 16, 512, 640000).launch[0].fn
                       for rows in (512, 2048)]
    assert fn == {32: ["attn_prefill_ws2h4k64s4_hd128", "attn_prefill_ws2h2k64s4oplq_hd128"],
                  16: ["attn_prefill_ws2h2k64s4_hd128", "attn_prefill_ws2h2k64s4oplq_hd128"],
                  24: ["attn_prefill_w4m2k16s4_hd128", "attn_prefill_ws3h1k64s4o_hd128"]}


def test_an_fp8_cache_takes_the_bf16_tiers_variant_where_it_is_built_and_the_first_built_otherwise(monkeypatch):
    m24 = dict(MODEL, num_heads=24)                          # 3 q heads a KV head: no ws2h2 below 2048 rows
    assert ap.default_prefill_variant(MODEL, 4096, True) == ap.default_prefill_variant(MODEL, 4096) == "ws3h1k64s4oe"
    assert ap.default_prefill_variant(MODEL, 512, True) == ap.default_prefill_variant(MODEL, 512) == "ws2h2k64s4"
    assert ap.default_prefill_variant(m24, 512, True) == ap.PREFILL_ATTN_F8KV[0] == "w4m2k16s4"
    assert ap.default_prefill_variant(dict(MODEL, head_dim=64), 512, True) == ap.PREFILL_ATTN_F8KV_HD64
    monkeypatch.setattr(ap, "PREFILL_ATTN_TIERS", ((0, {128: ("ws2h4k64s4",)}),))   # built for bf16 only
    assert ap.default_prefill_variant(MODEL, 512, True) == "w4m2k16s4"
    rec = ap.prefill_attn_launch(op(4096, 256), MODEL, [], [], "ws3h1k64s4oe", scales=(0.5, 0.25))
    bf16 = ap.prefill_attn_launch(op(4096, 256), MODEL, [], [], "ws3h1k64s4oe")
    assert rec.fn == "attn_prefill_f8kv_ws3h1k64s4oe_hd128"
    assert rec.smem == bf16.smem + PREFILL_F8KV_STAGING * 2 * 64 * 128 <= 227 * 1024   # staging; sm_90's limit
    assert rec.grid == bf16.grid and rec.args[-2:] == (("f32", 0.5), ("f32", 0.25))


def test_the_build_config_selects_the_variant_and_wgmma_refuses_shapes_it_lacks():
    choice = ap.plan_attention(op(2048, 4), "prefill", MODEL, {"max_seq_len": 8192, "prefill": "wg2h2k64s2"}, 16, 512,
                               640000)
    assert choice.launch[0].fn == "attn_prefill_wg2h2k64s2_hd128" and choice.launch[0].block == (256, 1, 1)
    odd = dict(MODEL, num_heads=24)                           # 3 q heads a KV head: no pair of heads to share
    with pytest.raises(KernelBuildError, match="divisible by 2"):
        ap.plan_attention(op(2048, 4), "prefill", odd, {"max_seq_len": 8192, "prefill": "wg2h2k64s2"}, 16, 512, 640000)
    assert ap.plan_attention(op(2048, 4), "prefill", odd, {"max_seq_len": 8192, "prefill": "wg3h1k64s2"}, 16, 512,
                             640000).launch[0].grid[0] == 24
    with pytest.raises(KernelBuildError, match="head_dim 128"):
        ap.plan_attention(op(256, 4, hd=64), "prefill", dict(MODEL, head_dim=64), {"max_seq_len": 8192,
                                                                                    "prefill": "wg3h1k64s4o"},
                          16, 512, 640000)
    with pytest.raises(ConfigError, match="prefill_attention 'wg9' is not auto"):
        BuildConfig(prefill_attention="wg9").validate()


def test_the_cli_option_reaches_every_prefill_bucket_and_refuses_a_head_size_it_lacks(tmp_path):
    import json

    pytest.importorskip("cuda.core")
    from tests.test_cli import assert_one_line_error, cli
    from xserv_aot.plan.manifest import Plan
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 128, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "tie_word_embeddings": True}
    small = ["--max-num-seqs", "2", "--prefill-buckets", "16,128", "--max-seq-len", "256", "--dummy-weights",
             "--no-gemm-library", "--prefill-attention", "ws2h2k64s3"]
    (tmp_path / "c.json").write_text(json.dumps(config))
    r = cli("compile", tmp_path / "c.json", "-o", tmp_path / "plan", *small)
    assert r.returncode == 0, r.stderr
    plan = Plan.load(tmp_path / "plan")
    assert plan.build.prefill_attention == "ws2h2k64s3"
    attn = {bk.kind: {op.cuda.kernel for op in bk.ops if op.op == "attention"} for bk in plan.buckets}
    assert attn["prefill"] == {"attn_prefill_ws2h2k64s3_hd128"}
    assert not any(k.startswith("attn_prefill") for k in attn["decode"])
    (tmp_path / "c64.json").write_text(json.dumps(dict(config, head_dim=64)))
    r = cli("compile", tmp_path / "c64.json", "-o", tmp_path / "plan64", *small)
    assert_one_line_error(r, "needs head_dim 128")
    assert not (tmp_path / "plan64").exists()


def test_ptxas_keeps_every_wgmma_variant_asynchronous_and_spill_free():
    """ptxas serializes every wgmma of a kernel (C7514) when it cannot follow the accumulators through the code
    between an issue and its wait (the old ping-pong variants); the overlap variants depend on it not doing so."""
    pytest.importorskip("cuda.core")
    from xserv_aot.plan.nvrtc_build import compile_source, ptxas_summary
    log = compile_source("attention_prefill_wgmma.cu", "sm_90a").log
    serialized = [line for line in log.splitlines() if "C7514" in line or "C7515" in line or "serialized" in line]
    assert not serialized, serialized
    resources = ptxas_summary(log)
    assert set(resources) == {f"attn_prefill_{v}_hd128" for v in ap.PREFILL_ATTN_WGMMA} | {
        f"attn_prefill_f8kv_{v}_hd128" for v in ap.PREFILL_ATTN_F8KV if v in ap.PREFILL_ATTN_WGMMA}
    assert not [fn for fn, r in resources.items() if "spill" in r], resources

"""The planner's CUTLASS choice for prefill linears (no GPU): the build config's gemm_configs table ("MxNxK" over
"NxK" over the tile model), its validation, the stream-K tile config's workspace call, and the residual add folded
into the o_proj / down epilogue (gemm_residual): the linear writes into the residual buffer with the config's
residual twin and the add_rmsnorm that followed becomes an rmsnorm of that buffer; nothing else changes."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("cuda.core")

from tests.test_cli import assert_one_line_error, cli  # noqa: E402
from xserv_aot.config import BuildConfig, ConfigError  # noqa: E402
from xserv_aot.plan import cutlass_build as cb  # noqa: E402
from xserv_aot.plan import kernel_build as kb  # noqa: E402
from xserv_aot.plan.builder import compile_plan  # noqa: E402

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1000, "hidden_size": 512,
         "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
         "tie_word_embeddings": True}
BUILD = dict(max_num_seqs=8, decode_buckets=[1, 2, 4, 8], prefill_buckets=[16, 128, 256], max_seq_len=512,
             dtype="bfloat16", target="sm_90a")
O_PROJ, DOWN = "512x512", "512x1024"          # N x K of this model's o_proj and down
WORKSPACE = 12345


def fake_cutlass(manifest, out_dir, target, progress):
    """The library's config table and workspace query without building it; table/residual as try_cutlass reads
    them from the build section."""
    b = manifest["build"]
    return {"file": "kernels/libxserv_gemm.so", "hash": "sha256:fake", "configs": list(cb.GEMM_CONFIGS),
            "build_key": "x", "path": None, "table": b.get("gemm_configs") or {},
            "residual": bool(b.get("gemm_residual"))}, ""


def compile_with(tmp, monkeypatch, **build):
    (tmp / "config.json").write_text(json.dumps(QWEN3))
    monkeypatch.setattr(kb, "try_cutlass", fake_cutlass)
    monkeypatch.setattr(cb, "library_workspace_size", lambda lib, cfg, m, n, k, splits, num_sms=132: WORKSPACE)
    return compile_plan(tmp / "config.json", tmp / "plan", BuildConfig(**{**BUILD, **build}), dummy_weights=True)


def ops_of(plan, bucket: str):
    return next(bk for bk in plan.buckets if bk.name == bucket).ops


def linear(ops, weight_suffix: str, layer: int = 0):
    return next(i for i, op in enumerate(ops) if op.op == "linear" and op.weight == f"layers.{layer}.{weight_suffix}")


def test_table_entry_for_m_n_k_wins_over_n_k_over_the_model():
    model = cb.choose_gemm_config(2048, 4096, 4096)
    table = {"4096x4096": "sm90_bf16_256x128x64_c2x1_coop", "4096x4096x4096": "sm90_bf16_128x128x64_c1x2_pingpong"}
    assert cb.pick_gemm_config(2048, 4096, 4096, table=table) == cb.CFG_256x128
    assert cb.pick_gemm_config(4096, 4096, 4096, table=table) == cb.CFG_128x128_PINGPONG
    assert cb.pick_gemm_config(2048, 4096, 4096, table={}) == model
    assert cb.pick_gemm_config(2048, 6144, 4096, table=table) == cb.choose_gemm_config(2048, 6144, 4096)
    # fp32 logits keep the fp32-output config whatever the table says
    assert cb.pick_gemm_config(2048, 4096, 4096, "float32", table) == cb.CFG_F32OUT
    with pytest.raises(cb.GemmBuildError, match="not a bf16 tile config"):
        cb.pick_gemm_config(2048, 4096, 4096, table={"4096x4096": "sm90_f32out_128x128x64_c2x1_coop"})


def test_table_names_only_bf16_tile_configs():
    assert set(cb.TABLE_CONFIGS.values()).isdisjoint(cb.RESIDUAL_TWIN.values())
    assert all("swap" not in n and "f32out" not in n for n in cb.TABLE_CONFIGS)
    for twin in cb.RESIDUAL_TWIN.values():
        assert cb.GEMM_CONFIGS[twin].startswith("sm90_bf16res_")
    for bad, msg in (({"4096": "sm90_bf16_128x128x64_c2x1_coop"}, "expected NxK or MxNxK"),
                     ({"0x4096": "sm90_bf16_128x128x64_c2x1_coop"}, "expected NxK or MxNxK"),
                     ({"4096x4096": "sm90_bf16_swap_128x64x128_streamk"}, "not a bf16 tile config"),
                     ({"4096x4096": "sm90_bf16res_128x256x64_c2x1_coop"}, "not a bf16 tile config")):
        with pytest.raises(ConfigError, match=msg):
            BuildConfig(gemm_configs=bad).validate()
    with pytest.raises(ConfigError, match="gemm_residual must be true or false"):
        BuildConfig(gemm_residual="yes").validate()


def test_a_bad_table_entry_is_a_one_line_cli_error(tmp_path):
    (tmp_path / "b.json").write_text(json.dumps({"gemm_configs": {"4096x4096": "nope"}}))
    (tmp_path / "c.json").write_text(json.dumps(QWEN3))
    r = cli("compile", tmp_path / "c.json", "-o", tmp_path / "plan", "--dummy-weights", "--build-config",
            tmp_path / "b.json")
    assert_one_line_error(r, "gemm_configs['4096x4096'] = 'nope'")
    assert not (tmp_path / "plan").exists()


def test_the_table_picks_each_prefill_shapes_config(tmp_path, monkeypatch):
    table = {O_PROJ: "sm90_bf16_256x128x64_c2x1_coop", f"256x{DOWN}": "sm90_bf16_128x128x64_c1x2_pingpong"}
    plan = compile_with(tmp_path, monkeypatch, gemm_configs=table)
    for rows in (128, 256):
        ops = ops_of(plan, f"prefill_{rows}")
        o, d = ops[linear(ops, "o_proj")], ops[linear(ops, "down")]
        assert o.cuda.gemm_config == cb.CFG_256x128
        want_down = cb.CFG_128x128_PINGPONG if rows == 256 else cb.choose_gemm_config(rows, 512, 1024)
        assert d.cuda.gemm_config == want_down
        assert o.cuda.launch[0].args[0] == ("i32", cb.CFG_256x128)           # the config argument of the call
    assert plan.kernels["gemm_configs"]["256x512x512"] == "sm90_bf16_256x128x64_c2x1_coop"
    assert plan.build.gemm_configs == table                                  # recorded in the manifest


def test_the_stream_k_tile_config_calls_the_workspace_entry(tmp_path, monkeypatch):
    plan = compile_with(tmp_path, monkeypatch, gemm_configs={O_PROJ: "sm90_bf16_128x256x64_c2x1_streamk"})
    ops = ops_of(plan, "prefill_256")
    rec = ops[linear(ops, "o_proj")].cuda.launch[0]
    assert rec.fn == "xserv_gemm_bf16_ex" and rec.args[8] == ("i32", 0)     # splits 0: stream-K
    assert rec.args[9] == ("ptr", "gemm_ws") and rec.args[10] == ("u64", WORKSPACE)
    assert plan.arena["gemm_ws"].nbytes >= WORKSPACE


def test_residual_fusion_rewrites_only_linear_then_add_rmsnorm_pairs(tmp_path, monkeypatch):
    table = {O_PROJ: "sm90_bf16_128x256x64_c2x1_coop", DOWN: "sm90_bf16_256x128x64_c2x1_coop"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    base = compile_with(tmp_path / "a", monkeypatch, gemm_configs=table)
    fused = compile_with(tmp_path / "b", monkeypatch, gemm_configs=table, gemm_residual=True)
    assert fused.build.gemm_residual is True and base.build.gemm_residual is False
    for bk_base, bk in zip(base.buckets, fused.buckets):
        assert [replace(op, cuda=None) for op in bk.ops] == [replace(op, cuda=None) for op in bk_base.ops]
        changed = [i for i, (a, b) in enumerate(zip(bk_base.ops, bk.ops)) if a.cuda != b.cuda]
        if bk.kind == "decode":                    # <= 8 rows: GEMV / skinny kernels, no CUTLASS epilogue
            assert not changed, bk.name
            continue
        pairs = [i for i, op in enumerate(bk.ops) if op.op == "linear" and i + 1 < len(bk.ops)
                 and bk.ops[i + 1].op == "add_rmsnorm" and bk.ops[i + 1].delta == op.out]
        if bk.ops[0].rows < 128:                   # prefill_16: NVRTC GEMMs, no twin
            assert not changed, bk.name
            continue
        assert len(pairs) == 2 * QWEN3["num_hidden_layers"] and changed == sorted(pairs + [i + 1 for i in pairs])
        for i in pairs:
            lin, norm = bk.ops[i], bk.ops[i + 1]
            assert lin.cuda.fused_residual == norm.residual
            assert lin.cuda.gemm_config == cb.RESIDUAL_TWIN[bk_base.ops[i].cuda.gemm_config]
            args = dict(zip(("config", "A", "B", "D", "bias"), lin.cuda.launch[0].args))
            assert args["D"] == ("ptr", norm.residual) and args["A"] == ("ptr", lin.inp)
            rec = norm.cuda.launch[0]
            assert rec.fn == "rmsnorm" and rec.args[:3] == (("ptr", norm.residual), ("ptr", norm.weight),
                                                             ("ptr", norm.out))


def test_no_fusion_without_a_residual_twin(tmp_path, monkeypatch):
    plan = compile_with(tmp_path, monkeypatch, gemm_residual=True,
                        gemm_configs={O_PROJ: "sm90_bf16_128x128x64_c1x2_pingpong",
                                      DOWN: "sm90_bf16_128x128x64_c1x2_pingpong"})
    ops = ops_of(plan, "prefill_256")
    assert not any(op.cuda.fused_residual for op in ops)
    assert [op.cuda.launch[0].fn for op in ops if op.op == "add_rmsnorm"] == ["add_rmsnorm"] * 4


def test_read_later_sees_reads_before_the_next_write():
    from xserv_aot.plan.op_records import AddRmsNorm, Linear, RmsNorm
    lin = Linear(4, inp="h", weight="w", bias=None, out="o", n=8, k=8)
    norm = AddRmsNorm(4, residual="x", delta="o", weight="nw", out="h", eps=1e-6)
    reads_o = RmsNorm(4, inp="o", weight="nw", out="h2", eps=1e-6)
    writes_o = replace(lin, out="o")
    assert not kb.read_later([lin, norm, writes_o, reads_o], 2, "o")
    assert kb.read_later([lin, norm, reads_o, writes_o], 2, "o")


def test_the_h200_build_routes_its_table_cells_and_leaves_the_rest_to_the_model():
    """plans/h200.build.json's gemm_configs reach plan_linear for Qwen3-8B's prefill linears (no compile)."""
    from pathlib import Path

    from xserv_aot.plan.linear_plan import plan_linear
    from xserv_aot.plan.op_records import Linear
    build = BuildConfig.from_dict(json.loads((Path(__file__).resolve().parents[1] / "plans" / "h200.build.json")
                                             .read_text())).validate()
    cutlass = {"configs": list(cb.GEMM_CONFIGS), "table": build.gemm_configs, "residual": build.gemm_residual,
               "path": None}
    assert build.gemm_configs and all(len(key.split("x")) == 3 for key in build.gemm_configs)
    for rows in build.prefill_buckets:
        for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
            op = Linear(rows, inp="h", weight="w", bias=None, out="o", n=n, k=k)
            got = plan_linear(op, "bfloat16", None, cutlass).gemm_config
            name = build.gemm_configs.get(f"{rows}x{n}x{k}")
            assert got == (cb.TABLE_CONFIGS[name] if name else cb.choose_gemm_config(rows, n, k)), (rows, n, k)

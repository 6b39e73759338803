"""Where the planner puts the decode megakernel (plan/megakernel_plan.py): decode_1 / decode_2 get one launch whose
arguments are layer 0's weights plus the one layer stride, every replaced op launches nothing, larger buckets keep
their kernels; models or plans the kernel does not fit keep per-op kernels with the reason in the manifest."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("cuda.core")

from xserv_aot.config import BuildConfig, ConfigError  # noqa: E402
from xserv_aot.plan.kernel_constants import (MK_H_SEQ_BYTES, MK_PART_FLOATS, MK_SCALE_FLOATS,  # noqa: E402
                                             MK_STAGE_BYTES, MK_TRACE)
from xserv_aot.plan.manifest import Plan  # noqa: E402
from xserv_aot.plan.megakernel_plan import (FUSED, MK_PREFIX, block_threads, kernel_name,  # noqa: E402
                                            layer_scale_floats)

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1000, "hidden_size": 512,
          "intermediate_size": 1024, "num_hidden_layers": 3, "num_attention_heads": 16, "num_key_value_heads": 4,
          "head_dim": 128, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
          "tie_word_embeddings": True}


def compile_tiny(tmp_path, config=CONFIG, **build):
    from xserv_aot.plan.builder import compile_plan
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config))
    b = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[16, 64], max_seq_len=512, dtype="bfloat16",
             target="sm_90a", gemm_library=False, megakernel_sms=132)
    b.update(build)
    return compile_plan(cfg, tmp_path / "plan", BuildConfig(**b), dummy_weights=True)


def bucket(plan, name):
    return next(b for b in plan.buckets if b.name == name)


def test_decode_1_and_2_run_one_persistent_launch(tmp_path):
    plan = compile_tiny(tmp_path)
    tensors = plan.manifest["weights"]["tensors"]
    for name, seqs in (("decode_1", 1), ("decode_2", 2)):
        ops = bucket(plan, name).ops
        kernels = [op.cuda.kernel for op in ops]
        first = next(i for i, k in enumerate(kernels) if k.startswith(MK_PREFIX))
        assert ops[first].op == "rmsnorm" and kernels[first] == kernel_name(seqs, 4)
        # everything from layer 0's input norm to the final norm, nothing after it (gather, lm_head, sampling)
        assert ops[first + 1:].index(next(op for op in ops if op.op == "gather_rows")) == 3 * 9 + 1 - 1
        assert all(k == FUSED for k in kernels[first + 1:first + 1 + 3 * 9])
        assert kernels[first + 1 + 3 * 9] == "gather_rows"
        assert all(not op.cuda.launch for op in ops[first + 1:first + 1 + 3 * 9])
        rec = ops[first].cuda.launch[0]
        assert rec.grid == (132, 1, 1) and rec.block == (block_threads(), 1, 1) and rec.smem <= 227 * 1024
        args = {i: a for i, a in enumerate(rec.args)}
        assert args[6] == ("ptr", "layers.0.qkv") and args[12] == ("ptr", "layers.0.down")
        stride = args[18][1]
        for w in ("qkv", "down", "q_norm", "input_norm"):
            assert tensors[f"layers.2.{w}"]["offset"] - tensors[f"layers.0.{w}"]["offset"] == 2 * stride * 2
        assert rec.args[13:17] == (("ptr", None),) * 4          # no weight scales (bf16)
        assert args[30] == ("ptr", None)                      # the trace buffer: only scripts/megakernel_trace.py
        assert args[39] == ("i32", 132 // (seqs * 4))        # splits a seq: blocks / (seqs x kv heads)
        stages = args[40][1]
        fixed = seqs * MK_H_SEQ_BYTES + 4 * MK_PART_FLOATS + 256 + 2 * 4 * MK_SCALE_FLOATS
        assert 2 <= stages and rec.smem == stages * (MK_STAGE_BYTES + 16) + fixed
    assert not any(op.cuda.kernel.startswith(MK_PREFIX) for op in bucket(plan, "decode_4").ops)
    buffers = plan.manifest["arena"]["buffers"]
    assert buffers["mk_grid_barrier"]["dtype"] == "int64" and buffers["mk_trace"]["shape"] == [132 * 3 * MK_TRACE]
    assert "megakernel_skipped" not in plan.kernels


@pytest.mark.parametrize("build", [{}, {"quantization": "fp8"},
                                   {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}], ids=["bf16", "fp8", "fp8kv"])
def test_pdl_marks_every_kernel_that_waits(tmp_path, build):
    """build.pdl: a record is launched under PDL when its function's PTX waits for the predecessor
    (griddepcontrol.wait); every kernel does but the megakernel (kernels/decode_megakernel.cu), so every other
    record is marked. A kernel that lost its wait (the batched decode attention did) shows up here unmarked."""
    plan = compile_tiny(tmp_path, pdl=True, **build)
    recs = [r for b in plan.buckets for op in b.ops if op.cuda for r in op.cuda.launch if not r.library]
    waits = {fn for c in plan.kernels["cubins"].values() for fn in c["pdl_waits"]}
    mk = [r for r in recs if r.fn.startswith(MK_PREFIX)]
    assert not any(r.pdl for r in mk) and not any(fn.startswith(MK_PREFIX) for fn in waits)
    assert [r.fn for r in recs if not r.pdl and not r.fn.startswith(MK_PREFIX)] == []
    assert any(r.fn.startswith("attn_decode_tc") and not r.fn.startswith("attn_decode_fused") for r in recs)
    assert not any(r.pdl for b in compile_tiny(tmp_path / "off", **build).buckets for op in b.ops if op.cuda
                   for r in op.cuda.launch if not r.fn.startswith(("gemm_w8a8_tma", "gemv_tc", "gemv_fp8_tc")))


def test_pdl_max_seqs_marks_the_small_decode_buckets_only(tmp_path):
    """build.pdl_max_seqs 2: decode_1 / decode_2 launch every waiting kernel under PDL, like build.pdl; decode_4 and
    the prefill buckets only the records that are always early (none in this bf16 build: gemv cuda_cores)."""
    plan = compile_tiny(tmp_path, pdl_max_seqs=2, megakernel_sms=0)
    waits = {fn for c in plan.kernels["cubins"].values() for fn in c["pdl_waits"]}
    for b in plan.buckets:
        recs = [r for op in b.ops if op.cuda for r in op.cuda.launch if not r.library]
        small = b.name in ("decode_1", "decode_2")
        assert recs and all(r.pdl == (small and r.fn in waits) for r in recs), b.name
    with pytest.raises(ConfigError, match="pdl_max_seqs"):
        BuildConfig(pdl_max_seqs=-1).validate()
    with pytest.raises(ConfigError, match="pdl_max_seqs"):
        BuildConfig(pdl_max_seqs=True).validate()


def test_max_context_adds_megakernel_copies_chosen_by_context(tmp_path):
    plan = compile_tiny(tmp_path, megakernel_max_context=300)
    names = [b.name for b in plan.buckets]
    assert names.index("decode_1_mk") == names.index("decode_1") + 1 and "decode_4_mk" not in names
    for name, seqs in (("decode_1", 1), ("decode_2", 2)):
        per_op, mk = bucket(plan, name), bucket(plan, f"{name}_mk")
        assert (per_op.max_context, mk.max_context) == (0, 300)
        assert [replace(op, cuda=None) for op in per_op.ops] == [replace(op, cuda=None) for op in mk.ops]
        assert not any(op.cuda.kernel.startswith(MK_PREFIX) or op.cuda.kernel == FUSED for op in per_op.ops)
        assert sum(op.cuda.kernel == kernel_name(seqs, 4) for op in mk.ops) == 1
    # the longest context of the step picks: <= 300 the megakernel copy, longer the per-op bucket
    assert plan.bucket_for(1, 1, 1).name == "decode_1_mk" and plan.bucket_for(1, 1, 300).name == "decode_1_mk"
    assert plan.bucket_for(1, 1, 301).name == "decode_1" and plan.bucket_for(2, 2, 512).name == "decode_2"
    assert plan.bucket_for(2, 2, 299).name == "decode_2_mk" and plan.bucket_for(3, 3, 5).name == "decode_4"
    assert plan.bucket_for(16, 1, 16).kind == "prefill"
    reloaded = Plan.load(plan.dir, verify="none")
    assert [(b.name, b.max_context) for b in reloaded.buckets] == [(b.name, b.max_context) for b in plan.buckets]
    from xserv_aot.plan.inspect import describe
    rows = {ln.split()[0]: ln for ln in describe(plan.dir).splitlines() if ln.startswith("  decode_")}
    assert rows["decode_1_mk"].endswith(f"[{kernel_name(1, 4)}]  [steps with contexts <= 300]")
    assert "[" not in rows["decode_1"] and "[" not in rows["decode_4"]


@pytest.mark.parametrize("scheme, suffix", [("block128", "_f8b"), ("channel", "_f8c")])
def test_fp8_weights_run_the_fp8_kernel_with_their_scales(tmp_path, scheme, suffix, monkeypatch):
    from xserv_aot.plan import megakernel_plan
    monkeypatch.setattr(megakernel_plan, "MK_FP8_SEQS", (1, 2))
    plan = compile_tiny(tmp_path, quantization="fp8", fp8_scheme=scheme)
    tensors = plan.manifest["weights"]["tensors"]
    for name, seqs in (("decode_1", 1), ("decode_2", 2)):
        rec = next(op.cuda.launch[0] for op in bucket(plan, name).ops if op.cuda.kernel.startswith(MK_PREFIX))
        assert rec.fn == kernel_name(seqs, 4, f"fp8_{scheme}") == f"{MK_PREFIX}m{seqs}_g4_hd128_tl2_p4{suffix}"
        assert rec.args[13:17] == tuple(("ptr", f"layers.0.{w}.scale") for w in ("qkv", "o_proj", "gate_up", "down"))
        stride = rec.args[18][1]
        for w in ("qkv", "qkv.scale", "down", "down.scale", "input_norm"):     # one byte stride: 2 x the bf16 one
            assert tensors[f"layers.1.{w}"]["offset"] - tensors[f"layers.0.{w}"]["offset"] == 2 * stride
        assert tensors["layers.0.qkv"]["dtype"] == "float8_e4m3fn"
    assert "megakernel_skipped" not in plan.kernels


def test_fp8_tensor_core_variant_is_decode_1_only(tmp_path, monkeypatch):
    from xserv_aot.plan import megakernel_plan
    monkeypatch.setattr(megakernel_plan, "MK_FP8_SEQS", (1, 2))
    monkeypatch.setattr(megakernel_plan, "MK_FP8_TC", True)
    plan = compile_tiny(tmp_path / "wide", {**CONFIG, "hidden_size": 1024, "intermediate_size": 2048},
                        quantization="fp8")                  # every K a multiple of 8 warps x 128
    fns = {name: next(op.cuda.launch[0].fn for op in bucket(plan, name).ops if op.cuda.kernel.startswith(MK_PREFIX))
           for name in ("decode_1", "decode_2")}
    assert fns == {"decode_1": f"{MK_PREFIX}m1_g4_hd128_tl2_p4_f8bt", "decode_2": f"{MK_PREFIX}m2_g4_hd128_tl2_p4_f8b"}
    narrow = compile_tiny(tmp_path / "narrow", quantization="fp8")           # hidden 512: 64 k a warp
    assert "128-k blocks" in narrow.kernels["megakernel_skipped"]["decode_1"]


def test_fp8_plans_take_the_megakernel_at_the_measured_sizes_only(tmp_path):
    from xserv_aot.plan.megakernel_plan import MK_FP8_SEQS
    plan = compile_tiny(tmp_path, quantization="fp8")
    for name, seqs in (("decode_1", 1), ("decode_2", 2)):
        runs = any(op.cuda.kernel.startswith(MK_PREFIX) for op in bucket(plan, name).ops)
        assert runs == (seqs in MK_FP8_SEQS), name
        assert runs or "measured faster" in plan.kernels["megakernel_skipped"][name]


def test_fp8_weights_need_the_default_variant(tmp_path, monkeypatch):
    from xserv_aot.plan import megakernel_plan
    monkeypatch.setattr(megakernel_plan, "MK_PRODUCER_WARPS", 1)
    monkeypatch.setattr(megakernel_plan, "MK_FP8_SEQS", (1, 2))
    plan = compile_tiny(tmp_path, quantization="fp8")
    assert "no kernel of variant" in plan.kernels["megakernel_skipped"]["decode_1"]
    assert not any(op.cuda.kernel.startswith(MK_PREFIX) for op in bucket(plan, "decode_1").ops)


@pytest.mark.parametrize("sms", [132, 100, 7])
def test_staged_fp8_scales_a_block_reads_in_a_layer(sms):
    # counted here as the set of (scale row, column) pairs the rows of each block touch
    m = dict(hidden_size=4096, intermediate_size=12288, num_heads=32, num_kv_heads=8, head_dim=128)
    mats = [(6144, 4096, 0), (4096, 4096, 0), (12288, 4096, 0), (12288, 4096, 12288), (4096, 12288, 0)]
    block128 = channel = 0
    for b in range(sms):
        pairs, rows = set(), 0
        for i, (n, k, off) in enumerate(mats):
            for r in range(b * n // sms, (b + 1) * n // sms):
                pairs.update((i, (off + r) // 128, c) for c in range(k // 128))
                rows += 1
        block128, channel = max(block128, len(pairs)), max(channel, rows)
    assert layer_scale_floats(m, sms, "fp8_block128") == block128
    assert layer_scale_floats(m, sms, "fp8_channel") == channel
    assert block128 > 0
    assert layer_scale_floats(m, 132, "fp8_block128") <= MK_SCALE_FLOATS     # Qwen3-8B fits the H200's buffer


def test_max_context_must_be_a_count():
    for bad in (-1, True, 1.5, "4096"):
        with pytest.raises(ConfigError, match="megakernel_max_context"):
            BuildConfig(megakernel_max_context=bad).validate()


def test_off_by_default(tmp_path):
    plan = compile_tiny(tmp_path, megakernel_sms=0)
    assert not any(op.cuda.kernel.startswith(MK_PREFIX) or op.cuda.kernel == FUSED
                   for bk in plan.buckets for op in bk.ops)
    assert "mk_grid_barrier" not in plan.manifest["arena"]["buffers"]


@pytest.mark.parametrize("change, why", [
    ({"num_key_value_heads": 8}, "query heads a kv head"),
    ({"head_dim": 64}, "head_dim 64"),
    ({"intermediate_size": 20000}, "do not fit"),
])
def test_models_the_kernel_does_not_fit_keep_per_op_kernels(tmp_path, change, why):
    plan = compile_tiny(tmp_path, {**CONFIG, **change})
    assert set(plan.kernels["megakernel_skipped"]) == {"decode_1", "decode_2"}
    assert all(why in reason for reason in plan.kernels["megakernel_skipped"].values())
    assert not any(op.cuda.kernel == FUSED for bk in plan.buckets for op in bk.ops)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "132"])
def test_build_setting_is_checked(bad):
    with pytest.raises(ConfigError, match="megakernel_sms"):
        BuildConfig(megakernel_sms=bad).validate()


def test_kernel_name_refuses_variants_without_a_kernel(monkeypatch):
    """The first tile early has FP8 kernels only; FP8 weights need the producer warpgroup (the
    kernels decode_megakernel.cu instantiates)."""
    from xserv_aot.plan import megakernel_plan as mp
    monkeypatch.setattr(mp, "MK_TILE_LOAD", "early")
    with pytest.raises(mp.NotEligible, match="bf16 weights: no kernel of variant '_tl3_p4'"):
        mp.kernel_name(1, 4)
    monkeypatch.setattr(mp, "MK_FP8_TILE_LOAD", "early")
    assert mp.kernel_name(2, 4, "fp8_channel") == f"{mp.MK_PREFIX}m2_g4_hd128_tl3_p4_f8c"
    monkeypatch.setattr(mp, "MK_PRODUCER_WARPS", 1)
    with pytest.raises(mp.NotEligible, match="fp8_block128 weights: no kernel of variant '_tl3'"):
        mp.kernel_name(2, 4, "fp8_block128")

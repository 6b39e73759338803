"""The FP8 KV cache on the CPU (`--kv-cache-dtype fp8_e4m3`, xserv_aot/kv_cache.py): the quantization against an
independent float64 reference, the manifest fields and their checks, scales from a checkpoint, the refusals, the
pool's capacity for a memory budget, the NumPy backend's KV writes, and (with NVRTC) the kernel routing."""
from __future__ import annotations

import json

import numpy as np
import pytest

from xserv_aot import kv_cache
from xserv_aot.config import BuildConfig, ConfigError
from xserv_aot.dtypes import FP8, round_to
from xserv_aot.plan import attention_plan as ap
from xserv_aot.plan.builder import compile_plan
from xserv_aot.plan.integrity import PlanError
from xserv_aot.plan.manifest import Plan

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e4,
          "tie_word_embeddings": True}
@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)              # recorded and printed on failure (tests/conftest.py)


BUILD = dict(max_num_seqs=2, decode_buckets=[1, 2], prefill_buckets=[16], max_seq_len=64, block_size=16,
             dtype="bfloat16", target="cpu")


def e4m3_grid() -> np.ndarray:
    """Every finite e4m3fn value from its bit fields (bias 7, subnormals, 0x7f NaN excluded), float64, sorted."""
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            vals.append((m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    pos = np.array(vals)
    return np.unique(np.concatenate([-pos, pos]))


def ref_quantize(x: np.ndarray, scale: float) -> np.ndarray:
    """float32 x / scale (IEEE), saturated to +-448, to the nearest e4m3 value with ties to the even mantissa."""
    y = (x.astype(np.float32) / np.float32(scale)).astype(np.float64)
    y = np.clip(y, -448.0, 448.0)
    grid = e4m3_grid()
    hi = np.clip(np.searchsorted(grid, y), 1, len(grid) - 1)
    lo_v, hi_v = grid[hi - 1], grid[hi]
    d_lo, d_hi = y - lo_v, hi_v - y
    # the even mantissa: the value whose last mantissa bit is 0, i.e. an even multiple of its ulp
    def even(v):
        a = np.abs(v)
        ulp = np.where(a < 2.0 ** -6, 2.0 ** -9, 2.0 ** (np.floor(np.log2(np.maximum(a, 2.0 ** -6))) - 3))
        return np.round(a / ulp) % 2 == 0
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even(hi_v) & ~even(lo_v))
    return np.where(pick_hi, hi_v, lo_v)


@pytest.mark.parametrize("scale", [1.0, 0.0371, 3.5e-3, 17.25])
def test_quantize_matches_the_float64_reference(rng, scale):
    x = round_to(rng.standard_normal(20000) * rng.choice([1e-3, 0.3, 4, 300], 20000) * scale, "bfloat16")
    x[:8] = np.array([448, -448, 464, 1e6, -1e6, 0, 2.0 ** -10, -(2.0 ** -9) * 1.5]) * scale
    got = kv_cache.quantize(x, scale)
    np.testing.assert_array_equal(got.astype(np.float64), ref_quantize(x, scale))
    assert np.abs(got).max() <= 448
    stored = kv_cache.stored(x, "bfloat16", scale)
    np.testing.assert_array_equal(stored, (ref_quantize(round_to(x, "bfloat16"), scale) * np.float64(np.float32(scale)))
                                  .astype(np.float32))


def test_quantize_ties_go_to_even(rng):
    """Midpoints between neighbouring e4m3 values (exact in float32 at scale 1): the even mantissa wins."""
    grid = e4m3_grid()
    grid = grid[(grid > 0) & (grid < 448)]
    mids = (grid[:-1] + grid[1:]) / 2
    np.testing.assert_array_equal(kv_cache.quantize(mids, 1.0).astype(np.float64), ref_quantize(mids, 1.0))


def compile_tiny(tmp_path, name="plan", config=CONFIG, **build):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config))
    return compile_plan(cfg, tmp_path / name, BuildConfig(**{**BUILD, **build}), dummy_weights=True)


def test_manifest_records_the_fp8_pool_and_its_scales(tmp_path):
    bf16 = compile_tiny(tmp_path, "bf16")
    f8 = compile_tiny(tmp_path, "f8", kv_cache_dtype="fp8_e4m3")
    assert bf16.kv_cache["dtype"] == "bfloat16" and "scales" not in bf16.kv_cache
    assert f8.kv_cache["dtype"] == FP8 and f8.kv_cache["shape"] == bf16.kv_cache["shape"]
    assert f8.kv_cache["size"] * 2 == bf16.kv_cache["size"]
    assert f8.kv_cache["scales"] == {"k": [1.0] * 3, "v": [1.0] * 3, "source": "default"}
    assert f8.build.kv_cache_dtype == "fp8_e4m3"
    assert kv_cache.bytes_per_token(f8.kv_cache) == 3 * 2 * 2 * 16 * 1
    from xserv_aot.plan.inspect import describe
    text = describe(f8.dir)
    assert "float8_e4m3fn" in text and "192 B a token" in text and "scales default" in text


@pytest.mark.parametrize("edit,match", [
    (lambda kv: kv.update(dtype="bfloat16"), "does not match"),
    (lambda kv: kv["scales"]["k"].pop(), "scales.k must be 3"),
    (lambda kv: kv["scales"]["v"].__setitem__(1, -0.5), "scales.v must be"),
    (lambda kv: kv.pop("scales"), "needs scales"),
])
def test_plan_load_checks_the_kv_section(tmp_path, edit, match):
    plan = compile_tiny(tmp_path, kv_cache_dtype="fp8_e4m3")
    path = plan.dir / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest["kv_cache"])
    path.write_text(json.dumps(manifest))
    with pytest.raises(PlanError, match=match):
        Plan.load(plan.dir, verify="none")


@pytest.mark.parametrize("settings,match", [
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype 'fp8' is not one of"),
    (dict(kv_cache_dtype="float32"), "the KV cache is either the build dtype"),
    (dict(kv_cache_dtype="fp8_e4m3", target="sm_80"), "needs FP8 support"),
    (dict(kv_cache_scales="calibrate"), "needs kv_cache_dtype fp8_e4m3"),
    (dict(kv_cache_scales="amax"), "kv_cache_scales 'amax' is not one of"),
])
def test_bad_settings_are_refused_in_one_line(settings, match):
    with pytest.raises(ConfigError, match=match) as e:
        BuildConfig(**{**BUILD, **settings}).validate()
    assert "\n" not in str(e.value)


def test_cli_refuses_a_target_without_fp8(tmp_path):
    from typer.testing import CliRunner
    from xserv_aot.cli import app
    (tmp_path / "c.json").write_text(json.dumps(CONFIG))
    res = CliRunner().invoke(app, ["compile", str(tmp_path / "c.json"), "-o", str(tmp_path / "p"), "--dummy-weights",
                                   "--target", "sm_80", "--kv-cache-dtype", "fp8_e4m3"])
    assert res.exit_code == 1 and res.output.strip().splitlines()[-1].startswith("error: an fp8_e4m3 KV cache")
    assert not (tmp_path / "p").exists()


def test_kv_memory_budget_holds_twice_the_blocks(tmp_path):
    from xserv_aot.cli_compile import kv_blocks_for_memory
    (tmp_path / "c.json").write_text(json.dumps(CONFIG))
    per_bf16 = kv_blocks_for_memory(tmp_path / "c.json", BuildConfig(**BUILD).validate(), 0.01, True)
    per_fp8 = kv_blocks_for_memory(tmp_path / "c.json", BuildConfig(**BUILD, kv_cache_dtype="fp8_e4m3").validate(),
                                   0.01, True)
    block_bf16 = 3 * 2 * 16 * 2 * 16 * 2                # layers, K and V, tokens, kv heads, head_dim, bytes
    assert per_bf16 == int(0.01 * 2**30) // block_bf16 and per_fp8 == int(0.01 * 2**30) // (block_bf16 // 2)
    plan = compile_tiny(tmp_path, kv_cache_dtype="fp8_e4m3", num_blocks=per_fp8)
    from xserv_aot.engine.block_manager import BlockManager
    bm = BlockManager(plan.build.num_blocks, plan.build.block_size)
    assert bm.num_free_blocks == per_fp8 and plan.kv_cache["size"] == per_fp8 * 16 * 3 * 2 * 2 * 16


def test_checkpoint_kv_scales_become_the_plan_scales(tmp_path):
    pytest.importorskip("torch")
    from tests.tiny_models import make_tiny_model
    model = make_tiny_model(tmp_path / "hf", "qwen3", seed=3)
    k, v = add_kv_scales(model, 2, kv_only_layer=1)
    plan = compile_plan(model, tmp_path / "plan", BuildConfig(**BUILD, kv_cache_dtype="fp8_e4m3"))
    assert plan.kv_cache["scales"] == {"k": k, "v": v, "source": "checkpoint"}
    plain = compile_plan(model, tmp_path / "plain", BuildConfig(**BUILD))     # a bf16 cache ignores them
    assert "scales" not in plain.kv_cache


def add_kv_scales(model_dir, layers: int, kv_only_layer: int | None = None) -> tuple[list[float], list[float]]:
    """Write k_scale / v_scale scalars of every layer into the checkpoint (kv_only_layer: that layer carries the
    older single kv_scale instead); returns the float32 values (k, v)."""
    from safetensors.numpy import load_file, save_file
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    k, v = [float(np.float32(0.013 * (i + 1))) for i in range(layers)], [float(np.float32(0.007 * (i + 2)))
                                                                       for i in range(layers)]
    for i in range(layers):
        if i == kv_only_layer:
            tensors[f"model.layers.{i}.self_attn.kv_scale"] = np.array(k[i], np.float32)
            v[i] = k[i]
        else:
            tensors[f"model.layers.{i}.self_attn.k_scale"] = np.array(k[i], np.float32)
            tensors[f"model.layers.{i}.self_attn.v_scale"] = np.array([v[i]], np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    return k, v


@pytest.mark.parametrize("bad,match", [("missing", "layer 1 has no v_scale"), ("negative", "finite positive"),
                                       ("extra", "layer 5 of a 2-layer model")])
def test_bad_checkpoint_scales_are_refused_naming_the_tensor(tmp_path, bad, match):
    pytest.importorskip("torch")
    from safetensors.numpy import load_file, save_file
    from tests.tiny_models import make_tiny_model
    from xserv_aot.checkpoint import CheckpointError
    model = make_tiny_model(tmp_path / "hf", "qwen3", seed=4)
    add_kv_scales(model, 2)
    path = model / "model.safetensors"
    tensors = load_file(path)
    if bad == "missing":
        del tensors["model.layers.1.self_attn.v_scale"]
    elif bad == "negative":
        tensors["model.layers.0.self_attn.k_scale"] = np.array(-1.0, np.float32)
    else:
        tensors["model.layers.5.self_attn.k_scale"] = np.array(1.0, np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=match):
        compile_plan(model, tmp_path / "plan", BuildConfig(**BUILD, kv_cache_dtype="fp8_e4m3"))
    assert not (tmp_path / "plan").exists()


def test_numpy_backend_stores_the_quantized_bf16_values(tmp_path, rng):
    """Layer 0's K / V depend only on the embedding, so after the same prefill the FP8 plan's layer-0 pool is exactly
    kv_cache.stored() of the bf16 plan's; every layer's values are e4m3 multiples of its scales."""
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    from xserv_aot.runtime.session import Session
    bf16 = compile_tiny(tmp_path, "bf16")
    f8 = compile_tiny(tmp_path, "f8", kv_cache_dtype="fp8_e4m3")
    scales = {"k": [0.05, 0.011, 0.5], "v": [0.02, 0.3, 0.004], "source": "calibrated"}
    manifest = json.loads((f8.dir / "manifest.json").read_text())
    manifest["kv_cache"]["scales"] = scales
    (f8.dir / "manifest.json").write_text(json.dumps(manifest))
    prompt = rng.integers(3, 300, 29).tolist()
    pools = []
    for plan in (bf16, Plan.load(f8.dir)):
        runner = NumpyRunner(plan)
        s = Session(runner)
        s.prefill(0, prompt)
        s.step({0: [5]})
        pools.append(runner.kv)
    ref, got = pools
    used = np.flatnonzero(np.abs(ref[0]).reshape(2, ref.shape[2], -1).max(axis=(0, 2)) > 0)
    assert len(used) == 30
    for part in range(2):
        want = kv_cache.stored(ref[0, part, used], "bfloat16", scales["kv"[part]][0])
        np.testing.assert_array_equal(got[0, part, used], want)
        for layer in range(3):
            s = np.float32(scales["kv"[part]][layer])
            vals = got[layer, part, used]
            np.testing.assert_array_equal(kv_cache.quantize(vals / s, 1.0) * s, vals)


# ---- kernel routing (NVRTC, no GPU) ----------------------------------------------------------------------------

MK_CONFIG = {**CONFIG, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 16,
             "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 4096}
GPU_BUILD = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[16, 64, 512], max_seq_len=1024,
                 block_size=16, dtype="bfloat16", target="sm_90a", gemm_library=False, megakernel_sms=132,
                 prefill_row_kernels="rows")


def kv_launches(plan):
    """(bucket, op, launch record) of every op that writes or reads the KV cache."""
    return [(bk.name, op, rec) for bk in plan.buckets for op in bk.ops if op.op in ("qk_norm_rope_cache", "attention")
            for rec in op.cuda.launch]


def test_every_kv_kernel_is_its_fp8_variant_with_the_layer_scales(tmp_path):
    pytest.importorskip("cuda.core")
    from xserv_aot.plan.megakernel_plan import MK_PREFIX
    bf16 = compile_tiny(tmp_path, "bf16", MK_CONFIG, **GPU_BUILD)
    f8 = compile_tiny(tmp_path, "f8", MK_CONFIG, **GPU_BUILD, kv_cache_dtype="fp8_e4m3")
    fns16 = {rec.fn for bk in bf16.buckets for op in bk.ops for rec in op.cuda.launch}
    fns8 = {rec.fn for bk in f8.buckets for op in bk.ops for rec in op.cuda.launch}
    assert any(f.startswith(MK_PREFIX) for f in fns16) and not any(f.startswith(MK_PREFIX) for f in fns8)
    assert set(f8.kernels["megakernel_skipped"]) == {"decode_1", "decode_2"}
    assert all("FP8 KV cache" in why for why in f8.kernels["megakernel_skipped"].values())
    assert [bk.name for bk in f8.buckets] == [bk.name for bk in bf16.buckets if not bk.name.endswith("_mk")]
    records = kv_launches(f8)
    assert {rec.fn for _, _, rec in records} == {
        "attn_decode_fused_f8kv_s3_hd128", "attn_decode_tc_f8kvn_b{}_s{}_hd128".format(*ap.BATCHED_ATTN_F8KVN_VARIANT)
        if ap.BATCHED_ATTN_F8KVN_VARIANT else f"attn_decode_tc_f8kv_s{ap.BATCHED_ATTN_F8KV_STAGES}_hd128",
        "qk_norm_rope_cache_f8kv_hd128",
        "qk_norm_rope_cache_rows_f8kv_hd128", "attn_prefill_f8kv_ws2h2k64s4_hd128"}   # the bf16 tier's (< 2048 rows)
    for _, op, rec in records:
        assert rec.args[-2:] == (("f32", 1.0), ("f32", 1.0)), rec.fn
    per_op = compile_tiny(tmp_path, "per_op", MK_CONFIG, **{**GPU_BUILD, "megakernel_sms": 0})
    same = lambda plan: [(bk.name, op.op, rec) for bk in plan.buckets for op in bk.ops  # noqa: E731
                         if op.op not in ("qk_norm_rope_cache", "attention") for rec in op.cuda.launch]
    assert same(f8) == same(per_op)                 # everything else as the bf16 plan without the megakernel


def test_checkpoint_scales_reach_every_layers_launches(tmp_path):
    pytest.importorskip("cuda.core")
    pytest.importorskip("torch")
    from tests.tiny_models import make_tiny_model
    model = make_tiny_model(tmp_path / "hf", "qwen3", seed=5, hidden_size=256, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=128, num_hidden_layers=3)
    k, v = add_kv_scales(model, 3)
    plan = compile_plan(model, tmp_path / "plan", BuildConfig(**{**GPU_BUILD, "max_seq_len": 512,
                                                                 "prefill_buckets": [16, 64]},
                                                              kv_cache_dtype="fp8_e4m3"))
    records = kv_launches(plan)
    assert len({op.layer for _, op, _ in records}) == 3
    for _, op, rec in records:
        assert rec.args[-2:] == (("f32", k[op.layer]), ("f32", v[op.layer])), (rec.fn, op.layer)


@pytest.mark.parametrize("variant,fn", [("w8m1k64s3", "attn_prefill_f8kv_w8m1k64s3_hd128"),
                                        ("ws2h2k64s4", "attn_prefill_f8kv_ws2h2k64s4_hd128"), ("ws3h1k64s4o", None),
                                        ("v1", None)])
def test_prefill_attention_choice_over_an_fp8_cache(tmp_path, variant, fn):
    pytest.importorskip("cuda.core")
    from xserv_aot.plan.nvrtc_build import KernelBuildError
    build = {**GPU_BUILD, "megakernel_sms": 0, "prefill_attention": variant, "kv_cache_dtype": "fp8_e4m3"}
    if fn is None:
        with pytest.raises(KernelBuildError, match=f"prefill attention {variant} has no FP8 KV cache variant"):
            compile_tiny(tmp_path, "p", MK_CONFIG, **build)
        assert not (tmp_path / "p").exists()
        return
    plan = compile_tiny(tmp_path, "p", MK_CONFIG, **build)
    assert {rec.fn for bk in plan.buckets if bk.kind == "prefill" for _, op, rec in kv_launches(plan)
            if op.op == "attention" and rec.fn.startswith("attn_prefill")} == {fn}


# ---- calibration (real weights: SmolLM2) ---------------------------------------------------------------------

def test_calibration_refuses_dummy_weights(tmp_path):
    with pytest.raises(ConfigError, match="calibrate needs real weights") as e:
        compile_tiny(tmp_path, kv_cache_dtype="fp8_e4m3", kv_cache_scales="calibrate")
    assert "\n" not in str(e.value) and not (tmp_path / "plan").exists()


@pytest.mark.slow
def test_calibrated_scales_map_each_layers_largest_value_to_448(tmp_path, smollm2_gguf):
    """Layer 0's K / V do not depend on the cache, so running the calibration prompts through the calibrated FP8
    plan stores layer 0's largest |k| and |v| as exactly 448 x its scale; deeper layers (inputs shifted by the FP8
    cache of the layers before) stay near it and nothing passes 448."""
    from xserv_aot.plan import kv_calibrate
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    from xserv_aot.runtime.session import Session
    from xserv_aot.tokenizer import Tokenizer
    build = BuildConfig(max_num_seqs=1, decode_buckets=[1], prefill_buckets=[64], max_seq_len=128, dtype="bfloat16",
                        target="cpu", kv_cache_dtype="fp8_e4m3", kv_cache_scales="calibrate")
    plan = compile_plan(smollm2_gguf, tmp_path / "plan", build)
    sc = plan.kv_cache["scales"]
    assert sc["source"] == "calibrated" and len(sc["k"]) == plan.model.num_layers
    scales = np.array([sc["k"], sc["v"]], np.float32).T                       # [L, 2]
    runner, tok = NumpyRunner(plan), Tokenizer.from_dir(plan.dir)
    top = np.zeros_like(scales)
    for text in kv_calibrate.PROMPTS:
        runner.reset_kv()
        Session(runner).greedy(tok.encode(text), kv_calibrate.GREEDY_TOKENS)
        top = np.maximum(top, np.abs(runner.kv).reshape(len(scales), 2, -1).max(axis=-1) / scales)
    np.testing.assert_allclose(top[0], 448, rtol=1e-6)
    assert (top <= 448 * (1 + 1e-6)).all() and (top > 300).all(), top


def test_fp8_kv_launch_records_match_the_kernel_signatures():
    """Every _f8kv record the planner can write: its function exists, argument kinds match the parsed signature
    (the KV pointer an e4m3 pointee), the scales are the two last f32 arguments."""
    from xserv_aot.plan import attention_plan as ap
    from xserv_aot.plan import row_kernels as rk
    from xserv_aot.plan.elementwise_plan import qk_rope_launch
    from xserv_aot.plan.op_records import Attention, QkNormRopeCache
    from xserv_aot.plan.signatures import kernel_signatures
    sigs = {fn: p for src in ("attention_decode_tc.cu", "attention_prefill_pipe.cu", "attention_prefill_wgmma.cu",
                              "rope_cache.cu", "rows_prefill.cu") for fn, p in kernel_signatures(src).items()}
    scales = (0.25, 0.125)
    recs = []
    for hd, nh, nkv in ((128, 32, 8), (64, 8, 2)):
        m = {"num_heads": nh, "num_kv_heads": nkv, "head_dim": hd}
        rope = QkNormRopeCache(qkv="qkv", positions="p", slot_mapping="s", q_norm=None, k_norm=None, cos="c",
                               sin="s", q_out="q", kv_cache="kv", layer=0, rows=2, eps=1e-6, num_heads=nh,
                               num_kv_heads=nkv, head_dim=hd)
        attn = Attention(q="q", kv_cache="kv", layer=0, query_start_loc="qsl", seq_lens="l", block_tables="bt",
                         out="o", rows=2, num_seqs=2, num_heads=nh, num_kv_heads=nkv, head_dim=hd, scale=0.1)
        common = [("ptr", "q"), ("kv", 0), ("ptr", "qsl"), ("ptr", "l"), ("ptr", "bt")]
        tail = [("i32", 16), ("i32", 64), ("i32", 1024), ("f32", 0.1)]
        recs += [ap.few_seq_attn_launch(attn, rope, m, 1024, common, tail, scales),
                 ap.batched_attn_launch(attn, m, 1024, common, tail, scales),
                 qk_rope_launch(rope, hd, nh, nkv, 1024, scales=scales).launch[0],
                 rk.rope_rows_launch(rope, hd, nh, nkv, 1024, scales=scales).launch[0]]
        variants = ap.PREFILL_ATTN_F8KV if hd == 128 else (ap.PREFILL_ATTN_F8KV_HD64,)
        recs += [ap.prefill_attn_launch(attn, m, common, tail, v, scales=scales) for v in variants]
    for rec in recs:
        assert "_f8kv" in rec.fn and rec.fn in sigs, rec.fn
        params = sigs[rec.fn]
        assert ["ptr" if k == "kv" else k for k, _ in rec.args] == [p["type"] for p in params], rec.fn
        kv_param = params[[k for k, _ in rec.args].index("kv")]
        assert kv_param["pointee"] == FP8 and [p["name"] for p in params[-2:]] == ["k_scale", "v_scale"]
        assert rec.args[-2:] == (("f32", 0.25), ("f32", 0.125))

"""The FP8-KV kernel variants (kernels/kv_fp8.cuh; `--kv-cache-dtype fp8_e4m3`) on fresh random inputs, outputs
poisoned first:
- the KV writes (qk_norm_rope_cache_f8kv, qk_norm_rope_cache_rows_f8kv, the fused few-seq decode kernel): q bit for
  bit as the bf16 kernel's, and each written e4m3 byte exactly the quantization (ml_dtypes, xserv_aot/kv_cache.py)
  of the value the bf16 kernel writes, at the layer's scales; every other slot untouched;
- the attention kernels (batched tensor-core decode, fused few-seq decode, pipe prefill) against the NumPy
  attention over the dequantized cache (float(e4m3) * scale);
- graph replay == eager, and a small FP8-KV plan's CUDA logits against the NumPy backend on the same plan.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import bf, rng  # noqa: F401  (fixtures)
from tests.test_cuda_kernels import check, paged_setup, rope_inputs
from tests.test_cuda_prefill import CASES, LONG
from xserv_aot import kv_cache
from xserv_aot.dtypes import FP8, decode, encode
from xserv_aot.plan import attention_plan as ap
from xserv_aot.plan import row_kernels as rk
from xserv_aot.plan.elementwise_plan import qk_rope_launch
from xserv_aot.plan.op_records import Attention, QkNormRopeCache
from xserv_aot.runtime import numpy_ops as ref

pytestmark = pytest.mark.gpu
KV_SOURCES = ("rope_cache.cu", "rows_prefill.cu", "attention_decode_tc.cu", "attention_prefill_pipe.cu",
              "attention_prefill_wgmma.cu")
SCALES = [(0.02, 0.011), (1.0, 1.0)]          # k, v: amax-like scales (values near 448 saturate), and the default


@pytest.fixture(scope="module")
def lib():
    """The kernel library of the four sources with FP8-KV variants only (a cold NVRTC cache builds just these)."""
    from xserv_aot.runtime.select import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from xserv_aot.runtime.cuda.kernel_lib import KernelLib
    return KernelLib(sources=KV_SOURCES)


def random_fp8_cache(rng, shape, scales) -> tuple[np.ndarray, np.ndarray]:
    """A KV layer of `shape` [2, slots, nkv, hd]: (its e4m3 bytes, what they read as: float(e4m3) * scale, float32)
    of bf16 values ~ N(0, 2), K at scales[0], V at scales[1]."""
    assert len(shape) == 4 and shape[0] == 2
    vals = bf(rng.standard_normal(shape) * 2)
    q = np.stack([kv_cache.quantize(vals[i], scales[i]) for i in range(2)])
    return encode(q, FP8), q * np.asarray(scales, np.float32).reshape(2, 1, 1, 1)


def e4m3_values(arr) -> np.ndarray:
    return arr.numpy().astype(np.float32)


def rope_op(T, nh, nkv, hd, eps):
    return QkNormRopeCache(T, qkv="qkv", positions="p", slot_mapping="s", q_norm="qn", k_norm="kn", cos="c",
                           sin="s", q_out="q", kv_cache="kv", layer=0, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                           eps=eps)


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("rows", [False, True], ids=["rope", "rope_rows"])
@pytest.mark.parametrize("hd,nh,nkv,norm", [(128, 32, 8, True), (64, 9, 3, False), (256, 4, 2, True)])
def test_rope_f8kv_writes_the_quantized_bf16_values(lib, rng, hd, nh, nkv, norm, rows, scales):
    T, num_slots, eps = 11, 64, 1e-6
    qkv, pos, slots, qn, kn, cos, sin, kv = rope_inputs(rng, T, num_slots, hd, nh, nkv, norm, qkv_scale=3)
    common = [lib.to_device(qkv, "bfloat16"), lib.to_device(pos), lib.to_device(slots),
              lib.to_device(qn, "bfloat16") if norm else 0, lib.to_device(kn, "bfloat16") if norm else 0,
              lib.to_device(cos), lib.to_device(sin)]
    op = rope_op(T, nh, nkv, hd, eps)
    plain = [("i32", nh), ("i32", nkv), ("f32", eps), ("i32", num_slots)]
    launch_of = (lambda s: rk.rope_rows_launch(op, hd, nh, nkv, num_slots, scales=s)) if rows else \
        (lambda s: qk_rope_launch(op, hd, nh, nkv, num_slots, scales=s))
    rec16, rec8 = launch_of(None).launch[0], launch_of(scales).launch[0]
    assert rec8.fn.endswith(f"_f8kv_hd{hd}") and rec8.args[-2:] == (("f32", scales[0]), ("f32", scales[1]))
    q16, kv16 = lib.empty((T, nh, hd), "bfloat16"), lib.to_device(kv, "bfloat16")
    lib.launch(rec16.fn, rec16.grid, rec16.block, [("ptr", a) for a in common] + [("ptr", q16), ("ptr", kv16)] + plain,
               smem=rec16.smem)
    old8, _ = random_fp8_cache(rng, kv.shape, scales)
    q8, kv8 = lib.empty((T, nh, hd), "bfloat16"), lib.to_device(old8)
    lib.launch(rec8.fn, rec8.grid, rec8.block, [("ptr", a) for a in common] + [("ptr", q8), ("ptr", kv8)] + plain
               + [("f32", scales[0]), ("f32", scales[1])], smem=rec8.smem)
    np.testing.assert_array_equal(q8.numpy().view(np.uint32), q16.numpy().view(np.uint32))
    written = slots[slots >= 0]
    got, bf16_written = e4m3_values(kv8), kv16.numpy()
    for part in range(2):
        np.testing.assert_array_equal(got[part, written], kv_cache.quantize(bf16_written[part, written], scales[part]))
    untouched = np.setdiff1d(np.arange(num_slots), written)
    np.testing.assert_array_equal(got[:, untouched], old8.astype(np.float32)[:, untouched])
    kv_ref = kv.copy()                                       # the NumPy backend's write: stored() of the op's values
    ref.qk_norm_rope_cache(qkv, pos, slots, qn, kn, cos, sin, kv_ref, nh, nkv, hd, eps)
    for part in range(2):
        check(got[part, written] * scales[part], kv_cache.stored(kv_ref[part, written], "bfloat16", scales[part]),
              tol=3e-2)


def attention_op(T, seqs, nh, nkv, hd):
    op = Attention(q="q", kv_cache="kv", layer=0, query_start_loc="qsl", seq_lens="lens", block_tables="bt", out="out",
                   rows=T, num_seqs=seqs, num_heads=nh, num_kv_heads=nkv, head_dim=hd, scale=hd ** -0.5)
    common = [("ptr", "q"), ("kv", 0), ("ptr", "qsl"), ("ptr", "lens"), ("ptr", "bt")]
    return op, common


def run_record(lib, rec, bufs):
    args = [("ptr", bufs["kv"]) if a[0] == "kv" else ("ptr", bufs[a[1]]) if a[0] == "ptr" else a for a in rec.args]
    lib.func(rec.fn, rec.smem)
    lib.launch(rec.fn, rec.grid, rec.block, args, smem=rec.smem)
    return args


BATCHED_F8KV = [("m", 4, st) for st in ap.TC_F8KV_STAGES] + [("n", b, st) for b, st in ap.TC_F8KVN_VARIANTS]


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("hd,nh,nkv", [(128, 32, 8), (64, 9, 3), (128, 64, 8), (128, 48, 3)])
@pytest.mark.parametrize("side,blocks,stages", BATCHED_F8KV)
def test_batched_decode_f8kv_matches_numpy(lib, rng, hd, nh, nkv, scales, side, blocks, stages, monkeypatch):
    """Every variant built of both kernels (heads on the MMAs' m side at every ring depth, and their n-side twin
    for G <= 8 at every (blocks an SM, depth); G 16 takes the m-side kernel either way), through the plan's launch
    record (the defaults are among them)."""
    if hd == 64 and stages == 3 and side == "m":
        pytest.skip("hd 64: 2 and 4 stages built")
    monkeypatch.setattr(ap, "BATCHED_ATTN_F8KV_STAGES", stages)
    monkeypatch.setattr(ap, "BATCHED_ATTN_F8KVN_VARIANT", (blocks, stages) if side == "n" else None)
    heads_n = side == "n" and nh // nkv <= ap.TC_F8KVN_MAX_G
    seqs = [(1, 1), (1, 300), (1, 700), (0, 0), (1, 17), (1, 64), (1, 1000)]
    block_size, max_blocks = 16, 64
    qsl, lens, tables, kv = paged_setup(rng, seqs, nkv, hd)
    raw, real = random_fp8_cache(rng, kv.shape, scales)
    T = int(qsl[-1]) + 2
    q = bf(rng.standard_normal((T, nh, hd)))
    op, common = attention_op(T, len(seqs), nh, nkv, hd)
    tail = [("i32", block_size), ("i32", max_blocks), ("i32", kv.shape[1]), ("f32", op.scale)]
    rec = ap.batched_attn_launch(op, {"num_heads": nh, "num_kv_heads": nkv, "head_dim": hd}, block_size * max_blocks,
                                 common, tail, scales)
    assert rec.fn == (f"attn_decode_tc_f8kvn_b{blocks}_s{stages}_hd{hd}" if heads_n
                      else f"attn_decode_tc_f8kv_s{stages}_hd{hd}")
    splits = rec.grid[2]
    bufs = {"q": lib.to_device(q, "bfloat16"), "kv": lib.to_device(raw), "qsl": lib.to_device(qsl),
            "lens": lib.to_device(lens), "bt": lib.to_device(tables), "out": lib.empty((T, nh * hd), "bfloat16"),
            "attn_part_o": lib.empty((len(seqs), nh, splits, hd), "float32"),
            "attn_part_ml": lib.empty((len(seqs), nh, splits, 2), "float32"),
            "attn_counters": lib.to_device(np.zeros((len(seqs), nkv), np.int32))}
    args = run_record(lib, rec, bufs)
    first = bufs["out"].numpy()
    check(first, ref.attention(q, real, qsl, lens, tables, block_size, op.scale))
    assert not first[qsl[-1]:].any(), "padding rows not zeroed"
    assert not bufs["attn_counters"].numpy().any(), "split counters must be reset for the next launch"
    from xserv_aot.runtime.cuda.driver import Launch
    dargs = [(t, v.ptr if hasattr(v, "ptr") else v) for t, v in args]
    gexec = lib.dev.capture(Launch(rec.fn, lib.func(rec.fn, rec.smem), rec.grid, rec.block, rec.smem, dargs))
    for _ in range(2):
        lib.dev.htod(bufs["out"].ptr, np.full(bufs["out"].shape, 0x7FC0, np.uint16))
        lib.dev.graph_launch(gexec)
        lib.dev.sync()
        np.testing.assert_array_equal(bufs["out"].numpy(), first)


@pytest.mark.parametrize("variant", ap.PREFILL_ATTN_F8KV)
@pytest.mark.parametrize("hd,nh,nkv", [(128, 32, 8), (64, 9, 3)])
@pytest.mark.parametrize("case", ["mixed", "many", "long", "codes"])
def test_prefill_f8kv_matches_numpy(lib, rng, hd, nh, nkv, variant, case):
    """many: more (seq, tile) pairs than the grid has rows, so blocks loop and their rings wrap across seqs; long:
    many key tiles a seq (the wgmma kernels' ring and staging buffers wrap), chunks at offsets; codes: a cache of
    every finite e4m3 code (subnormals, +-0, +-448) at random places, read exactly."""
    if hd != 128 and variant != ap.PREFILL_ATTN_F8KV_HD64:
        pytest.skip("hd 64: PREFILL_ATTN_F8KV_HD64 only")
    mixed = [(50, 50), (70, 200), (0, 0), (1, 33), (130, 130)]
    seqs = {"mixed": mixed, "many": CASES["many"], "long": LONG, "codes": mixed}[case]
    block_size, max_blocks, scales = 16, 64, (0.021, 0.013)
    qsl, lens, tables, kv = paged_setup(rng, seqs, nkv, hd)
    raw, real = random_fp8_cache(rng, kv.shape, scales)
    if case == "codes":
        codes = np.setdiff1d(np.arange(256, dtype=np.uint8), [0x7F, 0xFF])          # every code but the NaNs
        raw = rng.choice(codes, raw.shape).astype(np.uint8).view(raw.dtype)
        real = decode(raw, FP8) * np.asarray(scales, np.float32).reshape(2, 1, 1, 1)
    T = int(qsl[-1]) + 7
    q = bf(rng.standard_normal((T, nh, hd)))
    op, common = attention_op(T, len(seqs), nh, nkv, hd)
    tail = [("i32", block_size), ("i32", max_blocks), ("i32", kv.shape[1]), ("f32", op.scale)]
    rec = ap.prefill_attn_launch(op, {"num_heads": nh, "num_kv_heads": nkv, "head_dim": hd}, common, tail, variant,
                                 min_rows=1, scales=scales)
    assert rec.fn == f"attn_prefill_f8kv_{variant}_hd{hd}"
    bufs = {"q": lib.to_device(q, "bfloat16"), "kv": lib.to_device(raw), "qsl": lib.to_device(qsl),
            "lens": lib.to_device(lens), "bt": lib.to_device(tables), "out": lib.empty((T, nh * hd), "bfloat16")}
    run_record(lib, rec, bufs)
    out = bufs["out"].numpy()
    check(out, ref.attention(q, real, qsl, lens, tables, block_size, op.scale))
    assert not out[qsl[-1]:].any()


def fused_case(rng, lens, nh, nkv, hd, scales):
    from tests.test_cuda_attention_fused import make_case
    c = make_case(rng, lens, nh, nkv, hd, norm=True)
    c["raw"], c["real"] = random_fp8_cache(rng, c["kv"].shape, scales)
    return c


def fused_launch(num_seqs, nh, nkv, hd, scales):
    from tests.test_cuda_attention_fused import BS, EPS, MAX_SEQ_LEN
    rope = QkNormRopeCache(qkv="qkv", positions="positions", slot_mapping="slot_mapping", q_norm="q_norm",
                           k_norm="k_norm", cos="cos", sin="sin", q_out="q", kv_cache="kv_cache", layer=0,
                           rows=num_seqs, eps=EPS, num_heads=nh, num_kv_heads=nkv, head_dim=hd)
    attn = Attention(q="q", kv_cache="kv_cache", layer=0, query_start_loc="qsl", seq_lens="seq_lens",
                     block_tables="block_tables", out="out", rows=num_seqs, num_seqs=num_seqs, num_heads=nh,
                     num_kv_heads=nkv, head_dim=hd, scale=hd ** -0.5)
    m = {"num_heads": nh, "num_kv_heads": nkv, "head_dim": hd}
    common = [("ptr", "q"), ("kv", 0), ("ptr", "qsl"), ("ptr", "seq_lens"), ("ptr", "block_tables")]
    tail = [("i32", BS), ("i32", MAX_SEQ_LEN // BS), ("i32", -1), ("f32", attn.scale)]
    return ap.few_seq_attn_launch(attn, rope, m, MAX_SEQ_LEN, common, tail, scales)


def run_fused(lib, rec, c, nh, hd, kv_raw):
    from tests.test_cuda_attention_fused import device_args
    bufs, args = device_args(lib, rec, c, nh, hd)
    if kv_raw is not None:
        bufs["kv"] = lib.to_device(kv_raw)
        args = [("ptr", bufs["kv"]) if a[0] == "kv" else b for a, b in zip(rec.args, args)]
    lib.func(rec.fn, rec.smem)
    lib.launch(rec.fn, rec.grid, rec.block, args, smem=rec.smem)
    return bufs, args


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("ctx", [1, 17, 128, 513, 4096])
@pytest.mark.parametrize("two", [False, True])
def test_fused_decode_f8kv(lib, rng, ctx, two, scales):
    """Against the bf16 fused kernel (the new k / v bytes: exactly its values quantized) and the NumPy ops (q,
    attention over the dequantized cache with the new token's stored values)."""
    from tests.test_cuda_attention_fused import BS, EPS
    nh, nkv, hd = 32, 8, 128
    lens = [ctx, int(rng.integers(1, ctx + 1))] if two else [ctx, 0]
    c = fused_case(rng, lens, nh, nkv, hd, scales)
    rec8 = fused_launch(len(lens), nh, nkv, hd, scales)
    assert rec8.fn == f"attn_decode_fused_f8kv_s{ap.FEW_ATTN_STAGES}_hd{hd}"
    b16, _ = run_fused(lib, fused_launch(len(lens), nh, nkv, hd, None), c, nh, hd, None)
    b8, _ = run_fused(lib, rec8, c, nh, hd, c["raw"])
    live = int(c["qsl"][-1])
    written = c["slot_mapping"][:live]
    got, new16 = e4m3_values(b8["kv"]), b16["kv"].numpy()
    for part in range(2):
        np.testing.assert_array_equal(got[part, written], kv_cache.quantize(new16[part, written], scales[part]))
    untouched = np.setdiff1d(np.arange(got.shape[1]), written)
    np.testing.assert_array_equal(got[:, untouched], c["raw"].astype(np.float32)[:, untouched])
    np.testing.assert_array_equal(b8["q"].numpy().view(np.uint32), b16["q"].numpy().view(np.uint32))
    real = c["real"].copy()
    fresh = c["kv"].copy()
    q = bf(ref.qk_norm_rope_cache(c["qkv"], c["positions"], c["slot_mapping"], c["q_norm"], c["k_norm"], c["cos"],
                                  c["sin"], fresh, nh, nkv, hd, EPS))
    for part in range(2):
        real[part, written] = kv_cache.stored(fresh[part, written], "bfloat16", scales[part])
    want = ref.attention(q, real, c["qsl"], c["seq_lens"], c["block_tables"], BS, hd ** -0.5)
    out = b8["out"].numpy()
    check(out[:live], want[:live])
    assert not out[live:].any(), "padding rows must be zero"
    assert not b8["attn_counters"].numpy().any()


def test_fused_decode_f8kv_graph_replay_equals_eager(lib, rng):
    from xserv_aot.runtime.cuda.driver import Launch
    nh, nkv, hd, scales = 32, 8, 128, SCALES[0]
    c = fused_case(rng, [3000, 1201], nh, nkv, hd, scales)
    rec = fused_launch(2, nh, nkv, hd, scales)
    bufs, args = run_fused(lib, rec, c, nh, hd, c["raw"])
    out_eager, kv_eager = bufs["out"].numpy(), bufs["kv"].numpy()
    dargs = [(t, v.ptr if hasattr(v, "ptr") else v) for t, v in args]
    gexec = lib.dev.capture(Launch(rec.fn, lib.func(rec.fn, rec.smem), rec.grid, rec.block, rec.smem, dargs))
    for _ in range(2):
        lib.dev.htod(bufs["out"].ptr, np.full(bufs["out"].shape, 0x7FC0, np.uint16))
        lib.dev.htod(bufs["kv"].ptr, c["raw"])
        lib.dev.graph_launch(gexec)
        lib.dev.sync()
        np.testing.assert_array_equal(bufs["out"].numpy(), out_eager)
        np.testing.assert_array_equal(bufs["kv"].numpy(), kv_eager)


@pytest.mark.parametrize("prefill_rows", [False, True], ids=["v1_rows", "rows_kernels"])
def test_fp8_kv_plan_cuda_matches_numpy(tmp_path, seed, prefill_rows):
    """A small random Qwen3 plan with an FP8 KV cache (its checkpoint carries k_scale / v_scale of every layer),
    every KV kernel its _f8kv variant: CUDA logits over a prompt (prefill 64 + 36, or 512 + 88 on the rows
    kernels) and 12 decode steps within 3e-2 of the NumPy backend; graph replay == eager bit for bit."""
    from tests.test_cuda_e2e import gpu_or_skip
    from tests.test_cuda_runner import SHAPE, forced_logits, plan_logits, rel_err
    from tests.tiny_models import make_tiny_model
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    gpu_or_skip()
    rng = np.random.default_rng(seed)
    from tests.test_kv_cache_fp8 import add_kv_scales
    model = make_tiny_model(tmp_path / "hf", "qwen3", seed=int(rng.integers(1 << 30)), **SHAPE,
                            max_position_embeddings=1024)
    k, v = add_kv_scales(model, SHAPE["num_hidden_layers"])
    build = BuildConfig(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[16, 64, 512] if prefill_rows
                        else [16, 64], max_seq_len=1024, block_size=16, dtype="bfloat16", target="sm_90a",
                        kv_cache_dtype="fp8_e4m3", prefill_row_kernels="rows" if prefill_rows else "v1")
    plan = compile_plan(model, tmp_path / "plan", build)
    assert plan.kv_cache["scales"] == {"k": k, "v": v, "source": "checkpoint"}
    fns = {r.fn for bk in plan.buckets for op in bk.ops if op.cuda for r in op.cuda.launch}
    kv_fns = {f for f in fns if "rope" in f or f.startswith("attn_")}
    assert kv_fns and all("_f8kv" in f for f in kv_fns), kv_fns
    prompt = rng.integers(3, SHAPE["vocab_size"], 600 if prefill_rows else 100).tolist()
    forced = rng.integers(3, SHAPE["vocab_size"], 12).tolist()
    got, eager = plan_logits(plan, prompt, forced, eager=True)
    np.testing.assert_array_equal(got, eager)
    want = forced_logits(NumpyRunner(plan), prompt, forced)
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    print(f"FP8 KV plan, CUDA vs NumPy per-step logits relative error: max {max(errs):.2e}")
    assert max(errs) <= 3e-2, errs

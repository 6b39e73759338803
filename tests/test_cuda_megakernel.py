"""The persistent decode megakernel (kernels/decode_megakernel.cu) on a plan whose decode_1 / decode_2 run it:
teacher-forced decode logits against the NumPy backend on the same plan (the oracle) and against the per-op CUDA
kernels of the same model, at contexts from 1 key to several 256-key tiles a split (so one split, many splits with
the in-kernel combine, and multi-tile splits all run), two sequences of different lengths in decode_2, graph replay
== eager bit for bit, and the runner's refusal of a plan asking for more blocks than the GPU has SMs."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

# head_dim 128 and 4 query heads a kv head: the instantiated kernels; 8 kv heads give 16 splits a seq on 132 SMs
SHAPE = dict(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)
BUILD = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[64, 512], max_seq_len=8192, block_size=16,
             dtype="bfloat16", target="sm_90a", gemm_library=False)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def sms():
    from xserv_aot.runtime.select import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from xserv_aot.runtime.cuda.driver import Device
    return Device(0).num_sms


# kernel variants (plan/megakernel_plan.py constants): where the first KV tile is loaded (registers before the qkv
# barrier, after q / k / v are prepared), producer warps, the producer's L2 prefetch window while the ring is full,
# the KV prefetch kind (1: the copy engine)
VARIANTS = {"default": {}, "rt-bulkpf": dict(MK_TILE_LOAD="regs", MK_KV_PREFETCH=1),
            "p1-rt": dict(MK_PRODUCER_WARPS=1, MK_TILE_LOAD="regs"),
            "p1-l2pf8": dict(MK_PRODUCER_WARPS=1, MK_TILE_LOAD="after", MK_L2_AHEAD=8)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def plans(request, tmp_path_factory, seed_for, sms):
    from tests.tiny_models import make_tiny_model
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan import megakernel_plan
    from xserv_aot.plan.builder import compile_plan
    tmp = tmp_path_factory.mktemp("cuda_mk")
    model_dir = make_tiny_model(tmp / "hf", "qwen3", seed=seed_for("test_cuda_megakernel.plans"), **SHAPE)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in VARIANTS[request.param].items():
            mp.setattr(megakernel_plan, k, v)
        mk = compile_plan(model_dir, tmp / "mk", BuildConfig(**BUILD, megakernel_sms=sms))
        want = {"decode_1": megakernel_plan.kernel_name(1, 4), "decode_2": megakernel_plan.kernel_name(2, 4)}
    ref = compile_plan(model_dir, tmp / "ref", BuildConfig(**BUILD))
    for name, fn in want.items():
        kernels = [op.cuda.kernel for op in next(b for b in mk.buckets if b.name == name).ops]
        assert [k for k in kernels if k.startswith("decode_mk_")] == [fn], kernels
    return mk, ref


@pytest.fixture(scope="module")
def runners(plans):
    from xserv_aot.runtime.cuda.runner import CudaRunner
    mk, ref = (CudaRunner(p, log=print) for p in plans)
    yield mk, ref
    mk.close()
    ref.close()


def forced(runner, prompts: dict, steps: list[dict]):
    """Prefill every prompt, then teacher-forced decode steps; -> {k: [logits of each step]} (the prefill's last
    row first)."""
    from xserv_aot.runtime.session import Session
    runner.reset_kv() if hasattr(runner, "reset_kv") else None
    s = Session(runner, num_seqs=len(prompts))
    out = {}
    for k, p in prompts.items():
        out[k] = [s.prefill(k, p)[1]]
    for toks in steps:
        _, lg = s.step({k: [t] for k, t in toks.items()})
        for i, k in enumerate(toks):
            out[k].append(lg[i])
    return {k: np.array(v, np.float64) for k, v in out.items()}


@pytest.mark.parametrize("ctx", [1, 9, 200, 700, 3000, 5000])
def test_decode_1_matches_numpy_and_per_op_kernels(plans, runners, ctx, seed):
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, SHAPE["vocab_size"], ctx).tolist()
    steps = [{0: int(t)} for t in rng.integers(3, SHAPE["vocab_size"], 4)]
    got = forced(runners[0], {0: prompt}, steps)[0][1:]
    per_op = forced(runners[1], {0: prompt}, steps)[0][1:]
    want = forced(NumpyRunner(plans[0]), {0: prompt}, steps)[0][1:]
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    base = [rel_err(g, w) for g, w in zip(per_op, want)]
    # the per-op kernels' own error against NumPy sets the scale (bf16 roundings in another order)
    assert max(errs) <= max(2e-2, 1.5 * max(base)), (errs, base, seed)


def test_decode_2_two_lengths(plans, runners, seed):
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    rng = np.random.default_rng(seed)
    prompts = {0: rng.integers(3, SHAPE["vocab_size"], 300).tolist(),
               1: rng.integers(3, SHAPE["vocab_size"], 2600).tolist()}
    steps = [{0: int(a), 1: int(b)} for a, b in rng.integers(3, SHAPE["vocab_size"], (4, 2))]
    got = forced(runners[0], prompts, steps)
    want = forced(NumpyRunner(plans[0]), prompts, steps)
    for k in prompts:
        errs = [rel_err(g, w) for g, w in zip(got[k][1:], want[k][1:])]
        assert max(errs) <= 2e-2, (k, errs, seed)


def test_graph_replay_equals_eager_bitwise(runners, seed):
    rng = np.random.default_rng(seed)
    mk = runners[0]

    class Eager:
        plan = mk.plan

        def run(self, batch):
            return mk.run_eager(mk.bucket_for(batch).name, batch)

        def reset_kv(self):
            mk.reset_kv()

    prompt = rng.integers(3, SHAPE["vocab_size"], 1500).tolist()
    steps = [{0: int(t)} for t in rng.integers(3, SHAPE["vocab_size"], 5)]
    graph = forced(mk, {0: prompt}, steps)[0]
    eager = forced(Eager(), {0: prompt}, steps)[0]
    np.testing.assert_array_equal(graph, eager)


@pytest.fixture(scope="module", params=["block128", "channel", "block128-tc", "channel-tc", "block128-tc-i12288",
                                        "channel-tc-i12288", "block128-early", "channel-tc-early"])
def fp8_plans(request, tmp_path_factory, seed_for, sms):
    """A tiny FP8 (W8A16 at decode) plan with the megakernel (-tc: decode_1 on the tensor cores; -i12288: Qwen3-8B's
    intermediate size, so down_proj's K = 12288 gives 2-row ring slots and a partial second mma iteration; -early:
    the first KV tile loaded at attention's start) and the same model's per-op FP8 plan."""
    from tests.tiny_models import make_tiny_model
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan import megakernel_plan
    from xserv_aot.plan.builder import compile_plan
    tmp = tmp_path_factory.mktemp("cuda_mk_fp8")
    scheme, *opts = request.param.split("-")
    tc, shape = "tc" in opts, dict(SHAPE, intermediate_size=12288) if "i12288" in opts else SHAPE
    model_dir = make_tiny_model(tmp / "hf", "qwen3", seed=seed_for("test_cuda_megakernel.fp8"), **shape)
    fp8 = dict(BUILD, quantization="fp8", fp8_scheme=scheme, prefill_buckets=[64])
    with pytest.MonkeyPatch.context() as mp:                # decode_1 too (selectable, not the default)
        mp.setattr(megakernel_plan, "MK_FP8_SEQS", (1, 2))
        mp.setattr(megakernel_plan, "MK_FP8_TC", tc)
        if "early" in opts:
            mp.setattr(megakernel_plan, "MK_FP8_TILE_LOAD", "early")
        mk = compile_plan(model_dir, tmp / "mk", BuildConfig(**fp8, megakernel_sms=sms))
    ref = compile_plan(model_dir, tmp / "ref", BuildConfig(**fp8))
    suffix = {"block128": "_f8b", "channel": "_f8c"}[scheme]
    assert [[op.cuda.kernel.rsplit("_", 1)[1] for op in bk.ops if op.cuda.kernel.startswith("decode_mk_")]
            for bk in mk.buckets[:2]] == [[suffix[1:] + ("t" if tc else "")], [suffix[1:]]]
    return mk, ref


@pytest.mark.parametrize("ctx, seqs", [(200, 1), (3000, 1), (700, 2)])
def test_fp8_weights_match_numpy_and_per_op_kernels(fp8_plans, ctx, seqs, seed):
    from xserv_aot.runtime.cuda.runner import CudaRunner
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    rng = np.random.default_rng(seed)
    prompts = {k: rng.integers(3, SHAPE["vocab_size"], ctx - 100 * k).tolist() for k in range(seqs)}
    steps = [{k: int(t) for k, t in enumerate(row)} for row in rng.integers(3, SHAPE["vocab_size"], (4, seqs))]
    mk, ref = (CudaRunner(p, log=print) for p in fp8_plans)
    try:
        got, per_op = forced(mk, prompts, steps), forced(ref, prompts, steps)
    finally:
        mk.close()
        ref.close()
    want = forced(NumpyRunner(fp8_plans[0]), prompts, steps)
    for k in prompts:
        errs = [rel_err(g, w) for g, w in zip(got[k][1:], want[k][1:])]
        base = [rel_err(g, w) for g, w in zip(per_op[k][1:], want[k][1:])]
        assert max(errs) <= max(2e-2, 1.5 * max(base)), (k, errs, base, seed)


def test_context_limited_copy_hands_over_to_per_op_kernels(tmp_path, seed_for, seed, sms):
    """megakernel_max_context 203: a 200-token prompt decodes at contexts 201-203 in decode_1_mk, then 204-205 in
    the per-op decode_1 over the same KV cache; every step's logits against the NumPy backend."""
    from tests.tiny_models import make_tiny_model
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.runtime.cuda.runner import CudaRunner
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    model_dir = make_tiny_model(tmp_path / "hf", "qwen3", seed=seed_for("mk_limit"), **SHAPE)
    plan = compile_plan(model_dir, tmp_path / "plan", BuildConfig(**BUILD, megakernel_sms=sms,
                                                                  megakernel_max_context=203))
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, SHAPE["vocab_size"], 200).tolist()
    steps = [{0: int(t)} for t in rng.integers(3, SHAPE["vocab_size"], 5)]
    runner = CudaRunner(plan, log=print)
    chosen = []
    run = runner.run

    def spy(batch):
        chosen.append(runner.bucket_for(batch).name)
        return run(batch)
    runner.run = spy
    try:
        got = forced(runner, {0: prompt}, steps)[0][1:]
    finally:
        runner.close()
    assert chosen[-5:] == ["decode_1_mk"] * 3 + ["decode_1"] * 2, chosen
    want = forced(NumpyRunner(plan), {0: prompt}, steps)[0][1:]
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    assert max(errs) <= 2e-2, (errs, seed)


def test_runner_refuses_more_blocks_than_sms(tmp_path, seed_for, sms):
    from tests.tiny_models import make_tiny_model
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.runtime.cuda.runner import CudaRunner, CudaRunnerError
    model_dir = make_tiny_model(tmp_path / "hf", "qwen3", seed=seed_for("mk_refuse"), **SHAPE)
    plan = compile_plan(model_dir, tmp_path / "plan", BuildConfig(**{**BUILD, "decode_buckets": [1, 4]},
                                                                  megakernel_sms=sms + 1))
    with pytest.raises(CudaRunnerError, match="megakernel needs"):
        CudaRunner(plan)

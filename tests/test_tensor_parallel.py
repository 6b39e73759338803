"""Tensor-parallel plans on the NumPy backend: N simulated ranks (own weights file, arena and KV pool, host
collectives) give TP=1's logits and greedy tokens; the manifest records every tensor's sharding and every bucket's
collectives; shapes that do not divide are refused with one line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.test_cli import assert_one_line_error, cli, no_plan_left
from tests.tiny_models import load_hf_model, make_tiny_model
from xserv_aot.config import BuildConfig, ConfigError
from xserv_aot.model_config import ModelConfig
from xserv_aot.engine.api import SamplingParams
from xserv_aot.engine.llm_engine import LLMEngine
from xserv_aot.plan.builder import compile_plan
from xserv_aot.plan.manifest import Plan, PlanError
from xserv_aot.plan.tensor_parallel import ShardSpec, kv_head_starts, tensor_sharding
from xserv_aot.runtime.numpy_backend import NumpyRunner
from xserv_aot.runtime.session import Session

BUILD = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[8, 16], max_seq_len=128, block_size=4,
             dtype="float32", target="cpu")


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def model_cfg(**kw) -> ModelConfig:
    d = dict(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=8,
             num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
             tie_word_embeddings=False)
    return ModelConfig(**{**d, **kw})


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_rank_slices_follow_heads_by_index(tp):
    """Rank r's fused qkv rows are its q heads, then the kv head(s) those heads use, then the same v head(s),
    computed here from head indices (not from the Segment records); o_proj columns are its q heads."""
    m = model_cfg()
    hd, nh, nkv = m.head_dim, m.num_heads, m.num_kv_heads
    names = ["layers.0.qkv", "layers.0.o_proj", "layers.0.gate_up", "layers.0.down", "embed_tokens", "final_norm"]
    specs = tensor_sharding(m, tp, names)
    qkv = np.arange((nh + 2 * nkv) * hd * 3, dtype=np.float32).reshape(-1, 3)
    o_proj = np.arange(m.hidden_size * nh * hd, dtype=np.float32).reshape(m.hidden_size, -1)
    for r in range(tp):
        heads = range(r * nh // tp, (r + 1) * nh // tp)
        kv_heads = sorted({h // (nh // nkv) for h in heads})
        rows = [h * hd + j for h in heads for j in range(hd)]
        rows += [nh * hd + h * hd + j for h in kv_heads for j in range(hd)]
        rows += [(nh + nkv) * hd + h * hd + j for h in kv_heads for j in range(hd)]
        np.testing.assert_array_equal(specs["layers.0.qkv"].shard(qkv, r), qkv[rows])
        cols = [h * hd + j for h in heads for j in range(hd)]
        np.testing.assert_array_equal(specs["layers.0.o_proj"].shard(o_proj, r), o_proj[:, cols])
        assert kv_head_starts(m, tp)[r] == kv_heads[0]
    gate_up = np.arange(2 * m.intermediate_size, dtype=np.float32)[:, None]
    i_r = m.intermediate_size // tp
    np.testing.assert_array_equal(specs["layers.0.gate_up"].shard(gate_up, 1)[:, 0],
                                  np.r_[i_r:2 * i_r, m.intermediate_size + i_r:m.intermediate_size + 2 * i_r])
    assert specs["embed_tokens"].style == specs["final_norm"].style == "replicated"
    assert specs["lm_head"].style == "vocab" and specs["lm_head"].local_shape([64, 32]) == [64 // tp, 32]
    spec = specs["layers.0.qkv"]
    assert ShardSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize("kw,tp,dim", [
    (dict(vocab_size=250), 4, "vocab_size 250"),
    (dict(intermediate_size=50), 4, "intermediate_size 50"),
    (dict(num_heads=6, num_kv_heads=6), 4, "num_heads 6"),
    (dict(num_heads=12, num_kv_heads=3), 2, "num_kv_heads 3"),
])
def test_shapes_that_do_not_divide_are_refused(kw, tp, dim):
    from xserv_aot.plan.tensor_parallel import check_divisible
    with pytest.raises(ConfigError, match=dim):
        check_divisible(model_cfg(**kw), tp)


def test_cli_refuses_an_indivisible_tensor_parallel_size_with_one_line(tmp_path):
    d = make_tiny_model(tmp_path / "hf", "qwen3", seed=5, vocab_size=250)
    r = cli("compile", d, "-o", tmp_path / "plan", "--target", "cpu", "--tensor-parallel", "4")
    assert_one_line_error(r, "tensor_parallel 4 does not divide vocab_size 250")
    assert no_plan_left(tmp_path, "plan")
    r = cli("compile", d, "-o", tmp_path / "plan", "--target", "cpu", "--tensor-parallel", "3")
    assert_one_line_error(r, "tensor_parallel 3 is not one of 1, 2, 4, 8")


def test_cli_compiles_a_sharded_plan(tmp_path):
    d = make_tiny_model(tmp_path / "hf", "llama", seed=6, tie=True)
    r = cli("compile", d, "-o", tmp_path / "plan", "--target", "cpu", "--dtype", "float32", "--max-num-seqs", "2",
            "--prefill-buckets", "8", "--max-seq-len", "64", "--tensor-parallel", "2")
    assert r.returncode == 0, r.stderr
    plan = Plan.load(tmp_path / "plan", verify="full")
    assert plan.build.tensor_parallel == 2
    assert [w["file"] for w in plan.weight_files] == ["weights.rank0.bin", "weights.rank1.bin"]


CASES = [  # (arch, tp, overrides): TINY has 4 heads / 2 kv heads, vocab 256, intermediate 128
    ("qwen3", 2, {}),
    ("qwen3", 4, {}),                                            # 2 kv heads over 4 ranks: each replicated twice
    ("llama", 2, {"tie": True}),                                 # tied lm_head cut from embed_tokens
    ("llama", 4, {"num_key_value_heads": 1}),                    # MQA: one kv head on every rank
    ("qwen2", 2, {}),                                            # qkv bias sharded with qkv
    ("qwen3", 8, {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8}),
]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """(arch, tp, overrides) -> (TP=1 plan, TP=tp plan, HF dir) of one tiny random model (seed from the case)."""
    made = {}

    def get(case):
        arch, tp, extra = case
        key = (arch, tp, tuple(sorted(extra.items())))
        if key not in made:
            seed = 1000 + CASES.index(case)
            tmp = tmp_path_factory.mktemp(f"{arch}{tp}")
            d = make_tiny_model(tmp / "hf", arch, seed=seed, **extra)
            made[key] = (compile_plan(d, tmp / "tp1", BuildConfig(**BUILD)),
                         compile_plan(d, tmp / f"tp{tp}", BuildConfig(**BUILD, tensor_parallel=tp)), d, seed)
        return made[key]
    return get


@pytest.mark.parametrize("case", CASES, ids=[f"{a}-tp{t}" for a, t, _ in CASES])
def test_tp_matches_tp1_logits_and_greedy_tokens(plans, case):
    one, sharded, _, seed = plans(case)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, 256, size=21).tolist()
    want_tokens, want_logits = Session(NumpyRunner(one)).greedy(prompt, 33)
    got_tokens, got_logits = Session(NumpyRunner(sharded)).greedy(prompt, 33)
    errs = [rel_err(g, w) for g, w in zip(got_logits, want_logits)]
    assert max(errs) <= 1e-5, (seed, max(errs))
    assert got_tokens == want_tokens, seed


def test_tp_matches_hf_transformers(plans):
    """The sharded plan against an independent reference too (HF, float64 logits of the whole sequence)."""
    import torch
    _, sharded, d, seed = plans(CASES[1])
    prompt = np.random.default_rng(seed).integers(3, 256, size=13).tolist()
    tokens, logits = Session(NumpyRunner(sharded)).greedy(prompt, 8)
    with torch.no_grad():
        ref = load_hf_model(d).double()(torch.tensor([prompt + tokens[:-1]])).logits[0].numpy()[len(prompt) - 1:]
    assert rel_err(logits, ref) <= 1e-4, seed


def test_manifest_records_sharding_and_collectives(plans):
    one, sharded, _, _ = plans(CASES[1])          # qwen3, tp 4, 2 kv heads
    m, L = sharded.model, sharded.model.num_layers
    assert set(sharded.sharding) == set(sharded.weights)
    assert sharded.sharding["layers.0.qkv"]["style"] == "column"
    assert sharded.sharding["layers.0.down"] == {"style": "row", "dim": 1, "segments": [
        {"name": "inter", "size": 128, "local": 32, "starts": [0, 32, 64, 96]}]}
    assert sharded.weights["layers.0.qkv"].shape == [(m.num_heads // 4 + 2) * m.head_dim, m.hidden_size]
    tp = sharded.manifest["tensor_parallel"]
    assert tp["ranks"] == 4 and tp["kv_head_starts"] == [0, 0, 1, 1] and tp["embedding"] == "replicated"
    assert sharded.kv_cache["shape"][4] == 1
    for bk in sharded.buckets:
        names = [op.op for op in bk.ops]
        assert names.count("all_reduce") == 2 * L and names.count("all_gather") == 1
        for i, op in enumerate(bk.ops):
            if op.op == "all_reduce":
                prev = bk.ops[i - 1]
                assert prev.op == "linear" and prev.weight.rsplit(".", 1)[1] in ("o_proj", "down")
                assert op.buf == prev.out and op.rows == bk.num_tokens and op.ranks == 4
        gather = bk.ops[names.index("all_gather")]
        assert names[names.index("all_gather") + 1:] == ["apply_token_bitmask", "sample"] and gather.out == "logits"
        assert gather.n * 4 == m.vocab_size
    # the one-rank plan is as before: one weights.bin, no sharding, no collectives
    assert one.weight_files[0]["file"] == "weights.bin" and one.sharding is None
    assert "tensor_parallel" not in one.manifest
    assert not any(op.op.startswith("all_") for bk in one.buckets for op in bk.ops)


def test_a_changed_rank_file_is_refused(plans):
    _, sharded, _, _ = plans(CASES[0])
    path = sharded.dir / "weights.rank1.bin"
    raw = bytearray(path.read_bytes())
    raw[:64] = bytes(64)
    path.write_bytes(bytes(raw))
    with pytest.raises(PlanError, match="weights.rank1.bin"):
        Plan.load(sharded.dir, verify="full")


def test_engine_with_the_sharded_runner_matches_tp1(plans):
    one, sharded, _, seed = plans(CASES[3])      # llama, tp 4, one kv head
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 256, 9).tolist()
    prompts = [shared + rng.integers(3, 256, n).tolist() for n in (1, 12, 20, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.new_token_ids for o in LLMEngine(NumpyRunner(one), None).generate(prompts, params)]
    eng = LLMEngine(NumpyRunner(sharded), None)
    assert [o.new_token_ids for o in eng.generate(prompts, params)] == want, seed
    assert eng.stats().prefix_cache_hits > 0


def test_dummy_weight_plans_shard_the_one_generator(tmp_path):
    cfg = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "max_position_embeddings": 64, "tie_word_embeddings": True}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    build = dict(BUILD, max_seq_len=64)
    one = compile_plan(tmp_path / "c.json", tmp_path / "p1", BuildConfig(**build), dummy_weights=True, dummy_seed=3)
    two = compile_plan(tmp_path / "c.json", tmp_path / "p2", BuildConfig(**build, tensor_parallel=2),
                       dummy_weights=True, dummy_seed=3)
    assert not list(two.dir.glob("weights*.bin"))
    prompt = list(range(3, 20))
    want_tokens, want = Session(NumpyRunner(one)).greedy(prompt, 6)
    got_tokens, got = Session(NumpyRunner(two)).greedy(prompt, 6)
    assert rel_err(got, want) <= 1e-5 and got_tokens == want_tokens


def test_roofline_counts_one_ranks_heads(plans):
    from xserv_aot.plan.roofline import bucket_costs
    one, sharded, _, _ = plans(CASES[1])         # qwen3, 4 ranks, 2 kv heads (one per rank, replicated)
    m, ctx, item = one.model, 64, 4              # float32 plans, float32 KV
    for plan, nh, nkv in ((one, m.num_heads, m.num_kv_heads), (sharded, m.num_heads // 4, 1)):
        bk = next(b for b in plan.buckets if b.name == "decode_2")
        costs = {c[1].op: c[2] for c in bucket_costs(plan, bk, ctx)}
        assert costs["attention"] == 2 * ctx * nkv * m.head_dim * item * 2 + 2 * 2 * nh * m.head_dim * item
        assert costs["qk_norm_rope_cache"] == 2 * ((2 * nh + 2 * nkv) * m.head_dim * item + 2 * nkv * m.head_dim * item)
        assert ("all_reduce" in costs) == (plan is sharded) and costs.get("all_reduce", 0) == 0

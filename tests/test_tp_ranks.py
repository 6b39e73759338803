"""The CUDA side of tensor parallelism as far as a CPU allows: NCCL records and their signatures (checked against the
wheel's nccl.h), the ctypes binding's argument checks, the device-side slice copies, and the multi-process rank
protocol run with NumPy ranks (one process per rank, collectives through the pipes), including a failing rank."""
from __future__ import annotations

import json
import os
import re
import signal

import numpy as np
import pytest

from tests.test_tensor_parallel import BUILD, rel_err
from tests.tiny_models import make_tiny_model
from xserv_aot.config import BuildConfig
from xserv_aot.engine.api import SamplingParams
from xserv_aot.engine.llm_engine import LLMEngine
from xserv_aot.plan import nccl_records
from xserv_aot.plan.builder import compile_plan
from xserv_aot.plan.manifest import Plan
from xserv_aot.plan.tensor_parallel import ShardSpec, shard_copies
from xserv_aot.runtime.numpy_backend import NumpyRunner
from xserv_aot.runtime.session import Session
from xserv_aot.runtime.tp_ranks import RankFailure, TensorParallelRunner


def nccl_header() -> str:
    nccl = pytest.importorskip("nvidia.nccl")
    for root in nccl.__path__:
        path = os.path.join(root, "include", "nccl.h")
        if os.path.isfile(path):
            return open(path).read()
    pytest.skip("nccl.h not in the nvidia-nccl wheel")


def test_nccl_records_agree_with_nccl_h():
    h = nccl_header()
    enum = {m[0]: int(m[1]) for m in re.findall(r"(nccl\w+)\s*=\s*(\d+)", h)}
    assert {"int32": enum["ncclInt32"], "float32": enum["ncclFloat32"], "bfloat16": enum["ncclBfloat16"]} \
        == nccl_records.NCCL_DTYPES
    assert enum["ncclSum"] == nccl_records.NCCL_SUM
    from xserv_aot.runtime.cuda.nccl import UNIQUE_ID_BYTES
    assert f"#define NCCL_UNIQUE_ID_BYTES {UNIQUE_ID_BYTES}" in h
    for fn, params in nccl_records.SIGNATURES.items():
        decl = re.search(rf"ncclResult_t\s+{fn}\(([^)]*)\)", h).group(1)
        names = [re.split(r"[\s*]+", p.strip())[-1] for p in decl.split(",")]
        assert names == [p["name"] for p in params], fn


def test_nccl_binding_checks_its_arguments(monkeypatch):
    nccl_header()
    from xserv_aot.runtime.cuda.nccl import Nccl, NcclError
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    with pytest.raises(NcclError, match="NCCL_NVLS_ENABLE=0"):
        Nccl()
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    lib = Nccl()
    assert lib.version() >= 22000
    a, b = lib.unique_id(), lib.unique_id()
    assert len(a) == len(b) == 128 and a != b
    with pytest.raises(NcclError, match="rank 2 of 2"):
        lib.init_rank(2, a, 2)
    with pytest.raises(NcclError, match="no NCCL entry point"):
        lib.entry("ncclBroadcast", [])
    with pytest.raises(NcclError, match="4 arguments for 5"):
        lib.entry("ncclAllReduce", [("ptr", 1), ("ptr", 1), ("u64", 8), ("i32", 9)])
    with pytest.raises(NcclError, match="no communicator"):
        lib.entry("ncclAllGather", [("ptr", 1), ("ptr", 2), ("u64", 8), ("i32", 7)])


QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1024, "hidden_size": 256,
         "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
         "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def gpu_plans(tmp_path_factory):
    pytest.importorskip("cuda.core")
    tmp = tmp_path_factory.mktemp("tpcuda")
    (tmp / "c.json").write_text(json.dumps(QWEN3))
    b = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[16, 64], max_seq_len=512, dtype="bfloat16",
             target="sm_90a", gemm_library=False)
    return {tp: compile_plan(tmp / "c.json", tmp / f"tp{tp}", BuildConfig(**b, tensor_parallel=tp), dummy_weights=True)
            for tp in (1, 4)}


def rope_launch(bk, op):
    """The launch doing a qk_norm_rope_cache op: its own, or the attention kernel's it is fused into."""
    return op.cuda.launch[0] if op.cuda.launch else bk.ops[bk.ops.index(op) + 1].cuda.launch[0]


def args_of(rec, plan) -> dict:
    return {p["name"]: a[1] for p, a in zip(plan.kernels["signatures"][rec.fn], rec.args)}


def test_cuda_plan_has_rank_shapes_and_nccl_records(gpu_plans):
    one, four = gpu_plans[1], gpu_plans[4]
    hidden, vocab = one.model.hidden_size, one.model.vocab_size
    assert four.kernels["collectives"] == {"library": "nccl", "ranks": 4, "env": {"NCCL_NVLS_ENABLE": "0"}}
    assert four.arena["logits_gathered"].shape == [4, 4, vocab // 4]
    for bk1, bk4 in zip(one.buckets, four.buckets):
        ops1 = {op.op: op for op in bk1.ops}
        for op in bk4.ops:
            if op.op == "all_reduce":
                (rec,) = op.cuda.launch
                assert rec.library == "nccl" and rec.fn == "ncclAllReduce"
                assert args_of(rec, four) == {"sendbuff": "o", "recvbuff": "o", "count": bk4.num_tokens * hidden,
                                              "datatype": 9, "op": 0}
            elif op.op == "all_gather":
                gather, place = op.cuda.launch
                assert args_of(gather, four) == {"sendbuff": "logits_shard", "recvbuff": "logits_gathered",
                                                 "sendcount": bk4.num_seqs * vocab // 4, "datatype": 7}
                assert place.fn == "gather_shard_columns" and place.grid == (bk4.num_seqs, 4, 1)
                assert args_of(place, four) == {"gathered": "logits_gathered", "out": "logits",
                                                "rows": bk4.num_seqs, "n": vocab // 4, "ranks": 4}
            elif op.op == "qk_norm_rope_cache":   # one rank's heads: 4 / 4 q heads, 1 (replicated) kv head
                a = args_of(rope_launch(bk4, op), four)
                assert (a["nh"], a["nkv"]) == (1, 1), a
                b = args_of(rope_launch(bk1, ops1["qk_norm_rope_cache"]), one)
                assert (b["nh"], b["nkv"]) == (4, 2)
    assert not any(op.op.startswith("all_") or "nccl" in op.cuda.kernel for bk in one.buckets for op in bk.ops)
    assert "collectives" not in one.kernels


def test_device_slice_copies_cut_what_shard_cuts(gpu_plans):
    """shard_copies (the device's cudaMemcpy2D list) applied to the full tensor's bytes == ShardSpec.shard."""
    plan, tp = gpu_plans[4], 4
    rng = np.random.default_rng(4)
    for name, d in plan.sharding.items():
        spec = ShardSpec.from_dict(d)
        full_shape = list(plan.weights[name].shape)
        if spec.dim is not None:
            full_shape[spec.dim] = sum(s.size for s in spec.segments)
        full = rng.standard_normal(full_shape).astype(np.float32)
        src = full.tobytes()
        for rank in range(tp):
            want = spec.shard(full, rank)
            dst = bytearray(want.nbytes)
            for c in shard_copies(spec, full_shape, 4, rank):
                for row in range(c.height):
                    s, t = c.src_offset + row * c.src_pitch, c.dst_offset + row * c.dst_pitch
                    dst[t:t + c.width] = src[s:s + c.width]
            np.testing.assert_array_equal(np.frombuffer(bytes(dst), np.float32).reshape(want.shape), want,
                                          err_msg=f"{name} rank {rank}")


@pytest.fixture(scope="module")
def cpu_plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tpranks")
    d = make_tiny_model(tmp / "hf", "qwen3", seed=77)
    return {tp: compile_plan(d, tmp / f"tp{tp}", BuildConfig(**BUILD, tensor_parallel=tp)) for tp in (1, 2, 4)}


def test_rank_processes_match_the_in_process_ranks_and_tp1(cpu_plans):
    prompt = np.random.default_rng(77).integers(3, 256, 19).tolist()
    want_tokens, want = Session(NumpyRunner(cpu_plans[2])).greedy(prompt, 12)
    runner = TensorParallelRunner(cpu_plans[2], "cpu")
    try:
        got_tokens, got = Session(runner).greedy(prompt, 12)
    finally:
        runner.close()
    assert got_tokens == want_tokens
    np.testing.assert_array_equal(np.array(got), np.array(want))      # same sums in the same rank order
    one_tokens, one = Session(NumpyRunner(cpu_plans[1])).greedy(prompt, 12)
    assert one_tokens == got_tokens and rel_err(got, one) <= 1e-5
    assert not any(p.is_alive() for p in runner.procs)


def test_engine_on_rank_processes_matches_tp1(cpu_plans):
    rng = np.random.default_rng(78)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 17, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [o.new_token_ids for o in LLMEngine(NumpyRunner(cpu_plans[1]), None).generate(prompts, params)]
    runner = TensorParallelRunner(cpu_plans[2], "cpu")
    try:
        got = [o.new_token_ids for o in LLMEngine(runner, None).generate(prompts, params)]
    finally:
        runner.close()
    assert got == want


def test_overlapped_steps_on_rank_processes_match_tp1_without_overlap(cpu_plans):
    """Followers get each step's prev_rows and resolve the pending ids from their own sampled_ids; launch/wait keep
    their answers in order. A follower that embedded the placeholder ids would change the all_reduce sums."""
    rng = np.random.default_rng(79)
    prompts = [rng.integers(3, 256, n).tolist() for n in (6, 21, 3)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=40, seed=11, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)]
    want = [o.new_token_ids for o in LLMEngine(NumpyRunner(cpu_plans[1]), None, overlap=False).generate(prompts, params)]
    in_process = LLMEngine(NumpyRunner(cpu_plans[4]), None, overlap=True)
    assert [o.new_token_ids for o in in_process.generate(prompts, params)] == want
    runner = TensorParallelRunner(cpu_plans[2], "cpu")
    try:
        assert runner.overlaps is False             # NumPy ranks: on only when asked
        eng = LLMEngine(runner, None, overlap=True)
        assert [o.new_token_ids for o in eng.generate(prompts, params)] == want
        assert not runner._pending
        runner.reset_kv()
    finally:
        runner.close()


def test_grammar_masks_reach_every_rank(cpu_plans):
    """A masked batch (bitmask_rows, token_bitmask) on rank processes: each rank masks its gathered logits before
    sampling, so the token is TP=1's best allowed one (checked on TP=1's own unmasked logits)."""
    from xserv_aot.runtime.batch import BatchDescription
    seed = 80
    rng = np.random.default_rng(seed)
    vocab, n = cpu_plans[1].model.vocab_size, 7
    allowed = sorted(rng.choice(vocab, 5, replace=False).tolist())
    bits = np.zeros((2, -(-vocab // 32)), np.uint32)
    for t in allowed:
        bits[0, t // 32] |= np.uint32(1 << (t % 32))
    mask, ids = bits.view(np.int32), rng.integers(3, vocab, n).tolist()

    def batch(masked: bool, need_logits: bool = False) -> BatchDescription:
        b = BatchDescription(ids + ids, list(range(n)) * 2, list(range(n)) + list(range(8, 8 + n)), [0, n, 2 * n],
                             [n, n], [[0, 1], [2, 3]], need_logits=need_logits).fill_sampling_defaults()
        if masked:
            b.bitmask_rows, b.token_bitmask = [1, 0], mask        # row 0 masked, row 1 not
        return b
    one = NumpyRunner(cpu_plans[1])
    logits = one.run(batch(False, need_logits=True)).logits
    want = [allowed[int(np.argmax(logits[0][allowed]))], int(np.argmax(logits[1]))]
    assert want[0] != int(np.argmax(logits[0])), seed          # the mask changes row 0's token
    one.reset_kv()
    assert one.run(batch(True)).sampled_ids.tolist() == want, seed
    runner = TensorParallelRunner(cpu_plans[2], "cpu")
    try:
        assert runner.run(batch(True)).sampled_ids.tolist() == want, seed
    finally:
        runner.close()


def test_a_rank_that_cannot_start_fails_the_group(cpu_plans, tmp_path):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(cpu_plans[2].dir, broken)
    (broken / "weights.rank1.bin").unlink()
    with pytest.raises(RankFailure, match="rank 1 failed: .*weights.rank1.bin"):
        TensorParallelRunner(Plan.load(broken, verify="none"), "cpu")


def test_a_killed_rank_ends_the_engine_with_a_clear_error(cpu_plans):
    runner = TensorParallelRunner(cpu_plans[4], "cpu")
    try:
        eng = LLMEngine(runner, None)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert len(eng.generate([[5, 6, 7]], params)[0].new_token_ids) == 4
        victim = runner.procs[0]                 # rank 1
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        errors = []
        for attempt in range(eng.max_consecutive_failures):     # a new request after each failed step
            eng.add_request(f"r{attempt}", [5, 6, 7, 8], params)
            with pytest.raises(RankFailure) as e:
                eng.step()
            errors.append(str(e.value))
            outs = eng.recover(f"engine step failed: {e.value}")
            assert [o.finish_reason for o in outs] == ["error"]
        assert all("rank 1 exited" in e for e in errors), errors
        assert "rank 1 exited" in eng.failed
        assert not any(p.is_alive() for p in runner.procs)           # no half-alive group
        with pytest.raises(RankFailure, match="rank 1 exited"):
            runner.reset_kv()
    finally:
        runner.close()


def test_a_hung_rank_fails_the_group_after_the_step_timeout(cpu_plans):
    """A stopped follower never sends its collective part: rank 0 gives up after step_timeout_s, kills the group."""
    runner = TensorParallelRunner(cpu_plans[2], "cpu", step_timeout_s=0.5)
    try:
        s = Session(runner)
        s.prefill(0, [5, 6, 7])
        os.kill(runner.procs[0].pid, signal.SIGSTOP)
        with pytest.raises(RankFailure, match=r"rank 1 sent nothing for 0.5 s \(hung\?\)"):
            s.step({0: [8]})
        assert not any(p.is_alive() for p in runner.procs)
    finally:
        runner.close()

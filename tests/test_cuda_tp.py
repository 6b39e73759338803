"""Tensor parallelism on GPUs (NOT RUN yet: written in a session without multi-GPU machines).

One GPU (nvidia-h200): the gather_shard_columns kernel and each rank's sharded dummy weights.
Two or more GPUs (nvidia-h200-x2 / -x4): TP=2 / TP=4 plans through NCCL against TP=1 (CUDA) and against the NumPy
backend's simulated ranks on the same plan. Speed targets are measured by scripts/bench_tp.py, never asserted here.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.cuda_fixtures import lib, rng  # noqa: F401
from tests.test_cuda_runner import forced_logits, rel_err

pytestmark = pytest.mark.gpu

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 2048, "hidden_size": 512,
          "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
          "head_dim": 128, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
          "tie_word_embeddings": False}
BUILD = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[16, 64], max_seq_len=256, block_size=16,
             dtype="bfloat16", target="sm_90a")


def gpus() -> int:
    from xserv_aot.runtime.select import gpu_available
    if not gpu_available():
        return 0
    from xserv_aot.runtime.cuda.driver import Device
    return Device.count()


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    if not gpus():
        pytest.skip("no CUDA GPU")
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    tmp = tmp_path_factory.mktemp("tp_gpu")
    (tmp / "c.json").write_text(json.dumps(CONFIG))
    return {tp: compile_plan(tmp / "c.json", tmp / f"tp{tp}", BuildConfig(**BUILD, tensor_parallel=tp),
                             dummy_weights=True, dummy_seed=11) for tp in (1, 2, 4)}


def test_gather_shard_columns_lays_rank_blocks_side_by_side(lib, rng):  # noqa: F811
    from xserv_aot.runtime.numpy_ops import all_gather_columns
    ranks, rows, n = 4, 3, 1000
    gathered = rng.standard_normal((ranks, rows, n)).astype(np.float32)
    out = lib.empty([rows, ranks * n], "float32")
    lib.launch("gather_shard_columns", [rows, ranks], [256],
               [("ptr", lib.to_device(gathered)), ("ptr", out), ("i32", rows), ("i32", n), ("i32", ranks)])
    np.testing.assert_array_equal(out.numpy(), all_gather_columns(list(gathered)))


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_holds_its_slice_of_the_dummy_generator(plans, tp):
    """Full fill + 2-D slice copies on the device == the NumPy backend's shards, bit for bit."""
    from xserv_aot.dtypes import encode
    from xserv_aot.runtime.cuda.driver import Device
    from xserv_aot.runtime.cuda.dummy_upload import upload_dummy_weights
    from xserv_aot.runtime.cuda.kernel_lib import KernelLib
    from xserv_aot.runtime.numpy_backend import load_rank_weights
    plan = plans[tp]
    kl = KernelLib(device=Device(0))
    host = load_rank_weights(plan)
    for rank in range(tp):
        ptr = kl.dev.alloc(int(plan.manifest["weights"]["size"]))
        upload_dummy_weights(kl.dev, plan, kl.func("fill_normal_bf16"), ptr, rank)
        kl.dev.sync()
        for name, info in plan.weights.items():
            dt = np.uint16 if info.dtype == "bfloat16" else np.float32
            got = kl.dev.dtoh(ptr + info.offset, info.shape, dt)
            want = encode(host[rank][name], info.dtype) if info.dtype == "bfloat16" else host[rank][name]
            np.testing.assert_array_equal(got, want, err_msg=f"{name} rank {rank}")


@pytest.fixture(scope="module")
def tp1_runner(plans):
    from xserv_aot.runtime.cuda.runner import CudaRunner
    r = CudaRunner(plans[1])
    yield r
    r.close()


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_logits_match_tp1_and_the_numpy_ranks(plans, tp1_runner, tp):
    if gpus() < tp:
        pytest.skip(f"needs {tp} GPUs")
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    from xserv_aot.runtime.session import Session
    from xserv_aot.runtime.tp_ranks import TensorParallelRunner
    rng = np.random.default_rng(16 + tp)
    prompt, forced = rng.integers(3, 2048, 80).tolist(), rng.integers(3, 2048, 12).tolist()
    runner = TensorParallelRunner(plans[tp], "cuda")
    try:
        got = forced_logits(runner, prompt, forced)
        tokens = Session(runner).greedy(prompt, 32)[0]
    finally:
        runner.close()
    want = forced_logits(tp1_runner, prompt, forced)
    oracle = forced_logits(NumpyRunner(plans[tp]), prompt, forced)
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    assert max(errs) <= 2e-2, errs                     # bf16 tolerance (test_cuda_runner's)
    assert max(rel_err(g, o) for g, o in zip(got, oracle)) <= 2e-2
    assert len(tokens) == 32


def test_a_dead_gpu_rank_ends_the_process_with_a_clear_error(plans, tmp_path):
    """Rank 1 killed mid-serve: the watchdog prints one error line and exits 1 (rank 0 may wait in NCCL)."""
    if gpus() < 2:
        pytest.skip("needs 2 GPUs")
    import subprocess
    import sys
    code = f"""
import os, signal, time
from xserv_aot.plan.manifest import Plan
from xserv_aot.runtime.session import Session
from xserv_aot.runtime.tp_ranks import TensorParallelRunner
r = TensorParallelRunner(Plan.load({str(plans[2].dir)!r}), "cuda")
s = Session(r)
s.prefill(0, [5, 6, 7])
os.kill(r.procs[0].pid, signal.SIGKILL)
while True:
    s.step({{0: [8]}})
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "tensor-parallel group failed: rank 1 exited" in p.stderr     # the watchdog's line or the step's error


def test_tp_engine_overlap_on_equals_off(plans):
    """Overlapped steps across rank processes: step N+1 reaches the followers (prev_rows and all) before step N is
    read. With as many requests as sequence slots the steps have the same shapes on and off, so every token must be
    identical (greedy and seeded rows)."""
    if gpus() < 2:
        pytest.skip("needs 2 GPUs")
    from tests.test_cuda_overlap import _generate
    from xserv_aot.engine.api import SamplingParams
    from xserv_aot.runtime.tp_ranks import TensorParallelRunner
    rng = np.random.default_rng(21)
    n = plans[2].build.max_num_seqs
    prompts = [rng.integers(3, CONFIG["vocab_size"], size=int(k)).tolist() for k in rng.integers(5, 60, size=n)]
    params = [SamplingParams(max_tokens=int(rng.integers(4, 24)), temperature=t, seed=i, ignore_eos=True)
              for i, t in enumerate([0.0, 0.8] * (n // 2))]
    runner = TensorParallelRunner(plans[2], "cuda")
    try:
        assert runner.overlaps
        (off, shapes_off), (on, shapes_on) = (_generate(runner, prompts, params, o) for o in (False, True))
    finally:
        runner.close()
    assert shapes_on == shapes_off
    assert on == off

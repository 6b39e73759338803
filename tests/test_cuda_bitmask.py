"""GPU: the apply_token_bitmask kernel against its NumPy op (poisoned output rows), and inside the captured graph:
masked-out tokens are never sampled, rows without a mask pass through, and a step with masks waits on the host like one without."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_fixtures import lib, rng  # noqa: F401  (fixtures)
from tests.test_cuda_runner import SHAPE, plan, runner  # noqa: F401  (fixtures)
from xserv_aot.runtime import numpy_ops as ref

pytestmark = pytest.mark.gpu


def test_kernel_matches_numpy(lib, rng):  # noqa: F811
    B, V = 6, 50001
    W = -(-V // 32)
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    mask = rng.integers(-2 ** 31, 2 ** 31, size=(B, W), dtype=np.int64).astype(np.int32)
    flags = np.array([1, 0, 1, 0, 1, 1], dtype=np.int32)
    dev = lib.to_device(logits)
    lib.launch("apply_token_bitmask", [B], [256], [("ptr", dev), ("ptr", lib.to_device(mask)),
                                                  ("ptr", lib.to_device(flags)), ("i32", V)])
    got = dev.numpy()
    np.testing.assert_array_equal(got, ref.apply_token_bitmask(logits, mask, flags))


def batch_with_masks(runner, allowed_sets, seeds):  # noqa: F811
    from xserv_aot.runtime.batch import BatchDescription
    n, V = len(allowed_sets), SHAPE["vocab_size"]
    W = runner.plan.arena["token_bitmask"].shape[1]
    bits = np.zeros((n, W), dtype=np.int64)
    rows = []
    for i, allowed in enumerate(allowed_sets):
        rows.append(0 if allowed is None else 1)
        for t in allowed or ():
            bits[i, t // 32] |= 1 << (t % 32)
    words = ((bits + 2 ** 31) % 2 ** 32 - 2 ** 31).astype(np.int32)
    bs = runner.plan.build.block_size
    b = BatchDescription(input_ids=list(range(5, 5 + n)), positions=[0] * n, slot_mapping=[i * bs for i in range(n)],
                         query_start_loc=list(range(n + 1)), seq_lens=[1] * n, block_tables=[[i] for i in range(n)],
                         temperature=[1.0] * n, top_k=[0] * n, top_p=[1.0] * n, seeds=list(seeds),
                         sample_offsets=[0] * n)
    if any(rows):                                               # no row with a mask: nothing staged
        b.bitmask_rows, b.token_bitmask = rows, words
    assert V > 900
    return b


def test_masked_tokens_never_sampled_in_the_graph(runner):  # noqa: F811
    allowed = [[3, 500, 901], None, [17], [0, 1, 2, 3, 4, 5, 6, 7]]
    free = []
    for seed in range(40):
        out = runner.run(batch_with_masks(runner, allowed, [seed, seed + 1, seed + 2, seed + 3])).sampled_ids
        for i, a in enumerate(allowed):
            if a is not None:
                assert int(out[i]) in a, (seed, i, int(out[i]))
        free.append(int(out[1]))
    assert len(set(free)) > 5                                   # the unmasked row samples the whole vocabulary


def test_a_masked_step_waits_like_an_unmasked_one(runner):  # noqa: F811
    """The masks add an H2D copy to the step, no host wait: the same number of syncs and event waits."""
    waits = []
    real_sync, real_wait = runner.dev.sync, runner.dev.wait_event
    runner.dev.sync = lambda *a, **k: (waits.append("sync"), real_sync(*a, **k))[1]
    runner.dev.wait_event = lambda *a, **k: (waits.append("event"), real_wait(*a, **k))[1]
    try:
        counts = []
        for allowed in ([[3], [4], None, [5]], [None] * 4):
            waits.clear()
            runner.run(batch_with_masks(runner, allowed, [1, 2, 3, 4]))
            counts.append(sorted(waits))
    finally:
        runner.dev.sync, runner.dev.wait_event = real_sync, real_wait
    assert counts[0] == counts[1] and counts[0]


def test_engine_grammar_rows_with_overlap_on_equal_off(tmp_path_factory):
    """A tiny Qwen3 with GPU head sizes and the real Qwen3 tokenizer: grammar rows (regex, choice, JSON schema) next to plain rows, with
    overlap on and off: a step where a grammar row samples is not overlapped, so the same steps run and every token
    is the same; each grammar output matches its grammar and no logits come back for it."""
    import json
    import re

    from tests.test_cuda_e2e import BUILD
    from xserv_aot.config import BuildConfig
    from xserv_aot.engine.api import GuidedDecoding, SamplingParams
    from xserv_aot.engine.llm_engine import LLMEngine
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.runtime.cuda.runner import CudaRunner
    from xserv_aot.runtime.select import gpu_available
    from xserv_aot.tokenizer import Tokenizer
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    import shutil

    from tests.conftest import ensure_qwen3_tokenizer
    from tests.tiny_models import make_tiny_model
    hf = make_tiny_model(tmp_path_factory.mktemp("bitmask_hf"), "qwen3", seed=7, vocab_size=151936,
                         num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, bos_token_id=151643, eos_token_id=151645)
    for f in ("tokenizer.json", "tokenizer_config.json"):           # the real Qwen3 tokenizer: real grammars
        shutil.copy(ensure_qwen3_tokenizer() / f, hf / f)
    gplan = compile_plan(hf, tmp_path_factory.mktemp("bitmask_gpu") / "plan", BuildConfig(**BUILD, num_blocks=64))
    tok = Tokenizer.from_dir(gplan.dir)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    specs = [GuidedDecoding("regex", r"[a-c]{2,4}-[0-9]"), None, GuidedDecoding("choice", '["yes", "no way"]'),
             GuidedDecoding("json", json.dumps(schema))]
    prompts = [tok.encode(t) for t in ("Answer:", "river violet engine", "Yes or no?", "JSON please:")]
    params = [SamplingParams(max_tokens=24, temperature=0.0, guided=g, ignore_eos=g is None) for g in specs]
    gpu = CudaRunner(gplan)
    try:
        outs, logits = [], []
        real_launch = gpu.launch

        def launch(batch):
            logits.append(batch.need_logits)
            return real_launch(batch)
        gpu.launch = launch
        for overlap in (False, True):
            gpu.reset_kv()
            eng = LLMEngine(gpu, tok, seed=0, overlap=overlap)
            outs.append([(o.new_token_ids, o.text, o.finish_reason) for o in eng.generate(prompts, params)])
            assert eng.stats().kv_blocks_used == 0
    finally:
        gpu.close()
    assert outs[1] == outs[0] and not any(logits)
    texts = [t for _, t, _ in outs[0]]
    assert re.fullmatch(r"[a-c]{2,4}-[0-9]", texts[0]) and texts[2] in ("yes", "no way")
    assert 0 <= json.loads(texts[3])["n"] <= 99

"""Real weights: SmolLM2-135M-Instruct (Q4_1 GGUF) on the NumPy backend against HF transformers on the same GGUF."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from xserv_aot.plan.manifest import Plan
from xserv_aot.runtime.numpy_backend import NumpyRunner
from xserv_aot.runtime.session import Session
from xserv_aot.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()


def test_capital_of_france(smollm2_plan):
    tok = Tokenizer.from_dir(smollm2_plan)
    runner = NumpyRunner(Plan.load(smollm2_plan))
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out, _ = Session(runner).greedy(ids, 24, stop_ids=set(tok.eos_token_ids))
    assert "Paris" in tok.decode(out)


@pytest.mark.parametrize("prompt", ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land"])
def test_first_16_greedy_tokens_match_hf(smollm2_plan, hf_model, prompt):
    tok = Tokenizer.from_dir(smollm2_plan)
    ids = tok.encode(prompt)
    ours, logits = Session(NumpyRunner(Plan.load(smollm2_plan))).greedy(ids, 16)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        ref_logits = hf_model(torch.tensor([ids + ours[:-1]])).logits[0, len(ids) - 1:].double().numpy()
    assert ours == ref
    err = np.linalg.norm(np.array(logits) - ref_logits) / np.linalg.norm(ref_logits)
    assert err <= 1e-3

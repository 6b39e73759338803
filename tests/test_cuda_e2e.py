"""End to end on the GPU: CudaRunner vs HF transformers (same random weights, bf16, on the GPU) for Qwen3 at a
small shape and at the Qwen3-8B shape (2 of its 36 layers, to keep the run short); SmolLM2 real weights: CUDA
greedy text == NumPy greedy text."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SMALL = dict(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=2, head_dim=128)
QWEN3_8B_2L = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=2,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128)
BUILD = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[16, 64], max_seq_len=256, block_size=16,
             dtype="bfloat16", target="sm_90a")


def gpu_or_skip():
    from xserv_aot.runtime.select import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    import torch
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")


def make_model(out: Path, shape: dict, seed: int, max_shard_size: str = "5GB"):
    """Random Qwen3 with fan-in scaled weights (activations stay O(1) at any width), saved as bf16 safetensors;
    returns the saved model loaded back by from_pretrained (bf16, on the GPU)."""
    import torch
    import transformers
    cfg = transformers.Qwen3Config(**{"max_position_embeddings": 4096, **shape}, rms_norm_eps=1e-6, rope_theta=1e6,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * (torch.rand_like(p, dtype=torch.float32) * 2 - 1))
            elif "embed" in name:
                p.copy_(torch.randn_like(p, dtype=torch.float32))
            else:
                p.copy_(torch.randn_like(p, dtype=torch.float32) * p.shape[1] ** -0.5)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    del model
    # The reference is the checkpoint as from_pretrained loads it: its RoPE frequencies stay float32. The model built
    # here holds them in bf16 after .to(bfloat16) (a buffer), which turns the angles at position p by up to
    # p * 2^-9 * inv_freq radians: 2x HF bf16's logits error at a 4096-token prompt (session 26).
    model = transformers.Qwen3ForCausalLM.from_pretrained(out, dtype=torch.bfloat16).to("cuda").eval()
    assert model.dtype == torch.bfloat16 and model.model.rotary_emb.inv_freq.dtype == torch.float32
    return model


@pytest.mark.parametrize("shape", [SMALL, QWEN3_8B_2L], ids=["small", "qwen3-8b-2layers"])
def test_logits_match_hf_over_prompt_and_64_decode_steps(tmp_path, shape, seed):
    gpu_or_skip()
    import torch
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.runtime.cuda.runner import CudaRunner
    from xserv_aot.runtime.session import Session

    rng = np.random.default_rng(seed)
    hf = make_model(tmp_path / "hf", shape, int(rng.integers(1 << 30)))
    plan = compile_plan(tmp_path / "hf", tmp_path / "plan", BuildConfig(**BUILD))
    prompt = rng.integers(3, shape["vocab_size"], 100).tolist()      # prefill chunks of 64 + 36
    forced = rng.integers(3, shape["vocab_size"], 64).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + forced], device="cuda")).logits[0].float().cpu().numpy()
    ref = ref[len(prompt) - 1:]                                          # 65 rows: after the prompt, then each step
    del hf
    torch.cuda.empty_cache()

    runner = CudaRunner(plan, log=print)
    try:
        s = Session(runner)
        _, last = s.prefill(0, prompt)
        got = [last]
        for tok in forced:
            got.append(s.step({0: [tok]})[1][0])
    finally:
        runner.close()
    got = np.array(got, np.float64)
    errs = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    print(f"per-step logits relative error: max {errs.max():.2e}, mean {errs.mean():.2e}")
    assert errs.max() <= 2e-2
    top2 = np.sort(ref, axis=1)[:, -2:]
    confident = (top2[:, 1] - top2[:, 0]) > 0.1
    agree = got.argmax(1) == ref.argmax(1)
    print(f"greedy agreement: {agree.mean():.0%} overall, {agree[confident].mean():.0%} where margin > 0.1")
    assert agree[confident].all()


def test_smollm2_cuda_greedy_text_equals_numpy(tmp_path, request):
    gpu_or_skip()
    SMOLLM2 = Path(request.config.getoption("--smollm2-gguf"))
    if not SMOLLM2.is_file():
        pytest.skip(f"SmolLM2 GGUF not found at {SMOLLM2}")
    from tokenizers import Tokenizer
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    from xserv_aot.runtime.cuda.runner import CudaRunner
    from xserv_aot.runtime.numpy_backend import NumpyRunner
    from xserv_aot.runtime.session import Session

    build = BuildConfig(max_num_seqs=2, decode_buckets=[1, 2], prefill_buckets=[32, 64], max_seq_len=256,
                        block_size=16, dtype="bfloat16", target="sm_90a")
    plan = compile_plan(SMOLLM2, tmp_path / "plan", build)
    tok = Tokenizer.from_file(str(tmp_path / "plan" / "tokenizer.json"))
    prompt = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n").ids
    runner = CudaRunner(plan, log=print)
    try:
        cuda_ids, _ = Session(runner).greedy(prompt, 32)
    finally:
        runner.close()
    np_ids, _ = Session(NumpyRunner(plan)).greedy(prompt, 32)
    print("cuda :", repr(tok.decode(cuda_ids)))
    print("numpy:", repr(tok.decode(np_ids)))
    assert tok.decode(cuda_ids) == tok.decode(np_ids)

"""scripts/fp8_accuracy.py on real weights (SmolLM2-135M, GGUF dequantized then FP8-quantized), one short prompt:
the FP8 plan stays next to the bf16 plan (a wrong scale index or rounding step gives errors of order 1)."""
from __future__ import annotations

from tests.conftest import load_script


def test_smollm2_fp8_next_to_bf16(smollm2_gguf, tmp_path):
    script = load_script("fp8_accuracy")
    bf16, fp8 = script.compile_pair(smollm2_gguf, tmp_path)
    res = script.measure(bf16, fp8, ["The capital of France is"], 8)
    assert res["steps"] == 8
    assert res["mean_err"] <= 0.15 and res["argmax_agree"] >= 0.75, res

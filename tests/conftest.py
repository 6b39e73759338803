"""Shared fixtures: the offline assets (fetched once by scripts/fetch_assets.sh; tests skip if that fails)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "build" / "assets"
SMOLLM2_GGUF = ASSETS / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def pytest_addoption(parser):
    g = parser.getgroup("xserv-aot")
    g.addoption("--server-plan", default=None, help="tests/test_server.py: serve this plan (NumPy backend) instead of "
                                                    "the fake engine; test_fake_* then skip")
    g.addoption("--smollm2-gguf", default=str(SMOLLM2_GGUF), help="tests/test_cuda_e2e.py: the SmolLM2 GGUF file")
    g.addoption("--gemm-lib", default=None, help="tests/test_cuda_cutlass.py: a built libxserv_gemm.so (default: "
                                                 "build/cutlass/kernels/, else built by the test)")
    g.addoption("--gemm-bench-out", default=None, help="tests/test_cuda_cutlass.py: write the timing table (JSON)")
    g.addoption("--gemm-sweep", action="store_true", help="tests/test_cuda_cutlass.py: time an M sweep per config")


def ensure_assets() -> Path:
    if not SMOLLM2_GGUF.is_file() or not (ASSETS / "qwen3-tokenizer" / "tokenizer.json").is_file():
        env = dict(os.environ, PYTHON=sys.executable, XSERV_ASSETS=str(ASSETS))
        r = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_assets.sh")], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"offline assets unavailable: {r.stderr.strip().splitlines()[-1:]}")
    return ASSETS


def ensure_qwen3_tokenizer() -> Path:
    """The Qwen3 tokenizer asset alone (the GPU machine carries it without the SmolLM2 GGUF)."""
    if (ASSETS / "qwen3-tokenizer" / "tokenizer.json").is_file():
        return ASSETS / "qwen3-tokenizer"
    return ensure_assets() / "qwen3-tokenizer"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    ensure_assets()
    return SMOLLM2_GGUF


@pytest.fixture(scope="session")
def smollm2_plan(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct compiled for the CPU in float32 (exact dequantized weights)."""
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan

    out = tmp_path_factory.mktemp("plans") / "smollm2"
    build = BuildConfig(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[16, 64], max_seq_len=512,
                        dtype="float32", target="cpu")
    compile_plan(smollm2_gguf, out, build)
    return out

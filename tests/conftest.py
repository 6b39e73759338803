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
    g.addoption("--seed", type=int, default=None, help="base seed of the random tests (default: a fresh one)")


def load_script(name: str):
    """scripts/NAME.py as a module (the scripts are not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


# ---- recorded seeds for every random test ----
# Each test (or fixture) that draws random inputs takes `seed` (or calls `seed_for(key)`): the run's base seed mixed
# with a stable key, so `pytest --seed BASE` reruns exactly; the base seed is in the header and in every failure.

def pytest_configure(config):
    import random
    given = config.getoption("--seed")
    config.xserv_base_seed = given if given is not None else random.SystemRandom().randrange(2**32)


def pytest_report_header(config):
    return f"random tests: base seed {config.xserv_base_seed} (rerun with --seed {config.xserv_base_seed})"


def derive_seed(base: int, key: str) -> int:
    import zlib
    return (base * 0x9E3779B1 + zlib.crc32(key.encode())) % 2**32


@pytest.fixture
def seed(request) -> int:
    s = derive_seed(request.config.xserv_base_seed, request.node.nodeid)
    request.node.xserv_seeds = [*getattr(request.node, "xserv_seeds", []), s]
    return s


@pytest.fixture(scope="session")
def seed_for(request):
    """For module/session fixtures: seed_for(key) -> the seed of that key in this run."""
    return lambda key: derive_seed(request.config.xserv_base_seed, key)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        base = item.config.xserv_base_seed
        own = getattr(item, "xserv_seeds", [])
        rep.sections.append(("random seed", f"test seed {own[0] if own else '-'}; base seed {base} "
                                            f"(rerun with --seed {base})"))

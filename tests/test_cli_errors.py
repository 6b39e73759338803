"""One `error: ...` line for every user-facing error (XservError), a traceback with --debug; refused options;
`xserv-aot verify`; a busy port; no driver."""
from __future__ import annotations

import ctypes
import json
import shutil
import socket

import pytest

from tests.test_cli import CPU, assert_one_line_error, cli


@pytest.fixture(scope="module")
def plan(tmp_path_factory, smollm2_gguf):
    out = tmp_path_factory.mktemp("cli") / "plan"
    r = cli("compile", smollm2_gguf, "-o", out, *CPU[:-4], "--max-seq-len", "64")
    assert r.returncode == 0, r.stderr
    return out


def test_generate_refuses_zero_tokens_and_negative_temperature(plan):
    assert_one_line_error(cli("generate", plan, "hi", "--max-tokens", "0", "--backend", "cpu"), "--max-tokens")
    assert_one_line_error(cli("generate", plan, "hi", "--temperature", "-0.5", "--backend", "cpu"), "--temperature")


def test_debug_gives_the_traceback(tmp_path):
    (tmp_path / "bad").mkdir()
    assert_one_line_error(cli("generate", tmp_path / "bad", "hi"), "not a plan")
    r = cli("--debug", "generate", tmp_path / "bad", "hi")
    assert r.returncode != 0 and "Traceback" in r.stderr and "PlanError" in r.stderr


def test_verify(plan, tmp_path):
    r = cli("verify", plan)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok: ") and "chunks" in r.stdout
    shutil.copytree(plan, tmp_path / "p")
    with open(tmp_path / "p" / "weights.bin", "r+b") as f:
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 0x10]))
    assert_one_line_error(cli("verify", tmp_path / "p"), "chunk hash 0")


def test_broken_kv_cache_shape_is_one_line(plan, tmp_path):
    shutil.copytree(plan, tmp_path / "p")
    m = json.loads((tmp_path / "p" / "manifest.json").read_text())
    m["kv_cache"]["shape"] = [1]
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(m))
    assert_one_line_error(cli("generate", tmp_path / "p", "hi", "--backend", "cpu"), "kv_cache")


def _has_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_has_driver(), reason="this machine has an NVIDIA driver")
def test_profile_without_driver(plan):
    assert_one_line_error(cli("profile", plan), "no NVIDIA driver found")


@pytest.mark.parametrize("args, needle", [(["--api-key", ""], "empty"), (["--api-key", "   "], "empty"),
                                          (["--api-key", "a b"], "whitespace"),
                                          (["--max-waiting", "-5"], "--max-waiting"),
                                          (["--no-engine-process", "--coalesce-stream-outputs"], "engine process")])
def test_serve_refuses_bad_options(plan, args, needle):
    assert_one_line_error(cli("serve", plan, "--backend", "cpu", "--port", "1", *args), needle)


def test_serve_on_a_busy_port_is_one_line(plan):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert_one_line_error(cli("serve", plan, "--backend", "cpu", "--port", str(port)), "already in use")


SIGTERM_DURING_BUILD = """
import os, signal, sys
import xserv_aot.plan.builder as b
inner = b._build
def build(source, tmp, *a):
    (tmp / "partial.bin").write_bytes(b"0" * 65536)
    os.kill(os.getpid(), signal.SIGTERM)                 # handled at the next bytecode, inside the build
    return inner(source, tmp, *a)
b._build = build
from xserv_aot.cli import app
app(sys.argv[1:])
"""


def test_sigterm_during_compile_leaves_nothing(tmp_path):
    import subprocess
    import sys

    from tests.tiny_models import make_tiny_model
    hf = make_tiny_model(tmp_path / "hf", "llama", seed=7)
    r = subprocess.run([sys.executable, "-c", SIGTERM_DURING_BUILD, "compile", str(hf), "-o", str(tmp_path / "plan"),
                        *map(str, CPU)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 143, r.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["hf"]

"""Installing as users do: the wheel carries the CUDA sources (kernels/ as package data) and, installed into a fresh
venv, compiles a tiny model for sm_90a from outside the source tree; without cuda-python, compile targets the CPU
and says so in one line, and an explicit GPU target names the missing install."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.test_cli import assert_one_line_error
from tests.test_kernel_build import CONFIG

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = "import sys; sys.modules['cuda'] = None; from xserv_aot.cli import app; app(sys.argv[1:])"


def run(*cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the sources (the build writes build/ and *.egg-info next to them)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for tree in ("xserv_aot", "kernels"):
        shutil.copytree(ROOT / tree, src / tree, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, src)
    return next(dist.glob("xserv_aot-*.whl"))


def test_wheel_ships_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ROOT.joinpath("kernels").rglob("*"):
        if f.is_file():
            assert f"xserv_aot/_kernels/{f.relative_to(ROOT / 'kernels')}" in names, f


def test_wheel_in_a_fresh_venv_compiles_for_sm90a(wheel, tmp_path):
    pytest.importorskip("cuda.core")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel)
    site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    deps = Path(sysconfig.get_paths()["purelib"])          # dependencies: this test venv's, not re-downloaded
    (site / "deps.pth").write_text(f"{deps}\n")
    (site / "nvidia").symlink_to(deps / "nvidia")            # NVRTC is found through site-packages, not sys.path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"XSERV_NO_CUTLASS": "1"}
    where = run(py, "-c", "import xserv_aot.plan.nvrtc_build as n; print(n.__file__); print(n.KERNEL_DIR)",
                cwd=tmp_path, env=env).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), where          # the wheel's code and kernels
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    run(venv / "bin" / "xserv-aot", "compile", "config.json", "--dummy-weights", "--target", "sm_90a", "-o", "plan",
        "--max-num-seqs", "2", "--prefill-buckets", "16", "--max-seq-len", "64", cwd=tmp_path, env=env)
    manifest = json.loads((tmp_path / "plan" / "manifest.json").read_text())
    assert manifest["kernels"]["target"] == "sm_90a" and len(manifest["kernels"]["cubins"]) >= 8


def test_without_cuda_python_compile_targets_the_cpu(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    args = ["compile", tmp_path / "config.json", "--dummy-weights", "--max-num-seqs", "2", "--prefill-buckets", "16",
            "--max-seq-len", "64"]
    r = subprocess.run([sys.executable, "-c", NO_CUDA, *map(str, args), "-o", str(tmp_path / "plan")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    note = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(note) == 1 and note[0].startswith("note: ") and "xserv-aot[cuda]" in note[0], r.stderr
    assert json.loads((tmp_path / "plan" / "manifest.json").read_text())["build"]["target"] == "cpu"
    r = subprocess.run([sys.executable, "-c", NO_CUDA, *map(str, args), "--target", "sm_90a",
                        "-o", str(tmp_path / "gpu")], capture_output=True, text=True, timeout=300)
    assert_one_line_error(r, "cuda-python", "xserv-aot[cuda]")

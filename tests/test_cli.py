"""The CLI as a user meets it: compile/inspect/generate, and one clear line + exit 1 on bad input."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.tiny_models import make_tiny_model

CPU = ["--target", "cpu", "--dtype", "float32", "--max-num-seqs", "2", "--prefill-buckets", "8,16",
       "--max-seq-len", "64", "--block-size", "4"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xserv_aot.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: "), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]


def no_plan_left(parent: Path, name: str) -> bool:
    return not any(p.name == name or p.name.startswith(f".{name}.") for p in parent.iterdir())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, seed_for) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hf") / "tiny", "qwen3", seed=seed_for("test_cli.tiny"))


def test_compile_inspect(tiny, tmp_path):
    r = cli("compile", tiny, "-o", tmp_path / "plan", *CPU)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "plan" / "manifest.json").read_text())
    assert [b["name"] for b in manifest["buckets"]] == ["decode_1", "decode_2", "prefill_8", "prefill_16"]
    r = cli("inspect", tmp_path / "plan", "--ops", "decode_1")
    assert r.returncode == 0, r.stderr
    assert "memory map" in r.stdout and "qk_norm_rope_cache" in r.stdout and "roofline" in r.stdout
    r = cli("compile", tiny, "-o", tmp_path / "plan", *CPU)                    # exists, no --force
    assert_one_line_error(r, "already exists")


def test_dummy_weights_from_preset_config(tmp_path):
    cfg = json.loads(Path("plans/qwen3-0.6b.config.json").read_text())
    cfg.update(num_hidden_layers=1, hidden_size=64, intermediate_size=96, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, vocab_size=300)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    r = cli("compile", tmp_path / "c.json", "-o", tmp_path / "plan", *CPU)
    assert_one_line_error(r, "--dummy-weights")
    r = cli("compile", tmp_path / "c.json", "-o", tmp_path / "plan", "--dummy-weights", *CPU)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "plan" / "weights.bin").exists()
    r = cli("bench", tmp_path / "plan", "--backend", "cpu", "--prompt-len", "10", "--decode-steps", "4")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["decode_tok_per_s"] > 0


def test_no_config(tmp_path):
    (tmp_path / "m").mkdir()
    r = cli("compile", tmp_path / "m", "-o", tmp_path / "plan", *CPU)
    assert_one_line_error(r, "config.json")
    assert no_plan_left(tmp_path, "plan")


def test_unknown_architecture(tiny, tmp_path):
    import shutil
    shutil.copytree(tiny, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MistralForCausalLM"], "mistral"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    r = cli("compile", tmp_path / "m", "-o", tmp_path / "plan", *CPU)
    assert_one_line_error(r, "MistralForCausalLM")
    assert no_plan_left(tmp_path, "plan")


def test_corrupt_safetensors_header(tiny, tmp_path):
    import shutil
    shutil.copytree(tiny, tmp_path / "m")
    st = tmp_path / "m" / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(struct.pack("<Q", 40) + b"{not json at all" + data[24:200])
    r = cli("compile", tmp_path / "m", "-o", tmp_path / "plan", *CPU)
    assert_one_line_error(r, "model.safetensors")
    assert no_plan_left(tmp_path, "plan")


def test_missing_tensor(tiny, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file
    shutil.copytree(tiny, tmp_path / "m")
    st = tmp_path / "m" / "model.safetensors"
    tensors = load_file(st)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, st, metadata={"format": "pt"})
    r = cli("compile", tmp_path / "m", "-o", tmp_path / "plan", *CPU)
    assert_one_line_error(r, "model.layers.1.mlp.down_proj.weight")
    assert no_plan_left(tmp_path, "plan")


def test_truncated_gguf(smollm2_gguf, tmp_path):
    with open(smollm2_gguf, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(5_000_000))
    r = cli("compile", tmp_path / "cut.gguf", "-o", tmp_path / "plan", *CPU)
    assert_one_line_error(r, "cut.gguf")
    assert no_plan_left(tmp_path, "plan")


def test_generate_and_bad_plan(smollm2_plan, tmp_path):
    r = cli("generate", smollm2_plan, "What is the capital of France?", "--max-tokens", "12", "--backend", "cpu")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "tok/s" in r.stderr
    (tmp_path / "bad").mkdir()
    assert_one_line_error(cli("generate", tmp_path / "bad", "hi"), "not a plan")
    import shutil
    shutil.copytree(smollm2_plan, tmp_path / "p")
    m = json.loads((tmp_path / "p" / "manifest.json").read_text())
    m["schema_version"] = 999
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(m))
    assert_one_line_error(cli("generate", tmp_path / "p", "hi"), "schema version 999")

"""Plan integrity: chunk hashes, layout, paths, kernel hashes, schema, arch checks, atomic replacement."""
from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from tests.tiny_models import make_tiny_model
from xserv_aot.config import BuildConfig
from xserv_aot.plan import builder
from xserv_aot.plan.builder import compile_plan
from xserv_aot.plan.manifest import Plan, PlanError
from xserv_aot.runtime.select import check_arch

BUILD = dict(max_num_seqs=2, decode_buckets=[1, 2], prefill_buckets=[8], max_seq_len=32, block_size=4,
             dtype="bfloat16", target="cpu")


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("p")
    hf = make_tiny_model(root / "hf", "llama", seed=3)
    return compile_plan(hf, root / "plan", BuildConfig(**BUILD)).dir


def copy(plan_dir, tmp_path):
    shutil.copytree(plan_dir, tmp_path / "p")
    return tmp_path / "p"


def test_weights_changed_are_refused(plan_dir, tmp_path, seed):
    p = copy(plan_dir, tmp_path)
    Plan.load(p, verify="full")
    raw = bytearray((p / "weights.bin").read_bytes())
    pos = int(np.random.default_rng(seed).integers(0, len(raw)))      # anywhere: every byte is covered
    raw[pos] ^= 0x01
    (p / "weights.bin").write_bytes(bytes(raw))
    with pytest.raises(PlanError, match="chunk hash 0"):
        Plan.load(p)
    Plan.load(p, verify="none")                                      # layout checks only, for inspect


@pytest.fixture(scope="module")
def chunked_plan(tmp_path_factory):
    """The same model with 4 KiB chunks, so weights.bin spans many chunks."""
    root = tmp_path_factory.mktemp("c")
    hf = make_tiny_model(root / "hf", "llama", seed=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder, "CHUNK_BYTES", 4096)
        return compile_plan(hf, root / "plan", BuildConfig(**BUILD)).dir


def test_chunk_hashes_name_the_overwritten_region(chunked_plan, tmp_path):
    p = copy(chunked_plan, tmp_path)
    m = json.loads((p / "manifest.json").read_text())
    size = m["weights"]["size"]
    assert m["weights"]["chunks"]["size"] == 4096 and len(m["weights"]["chunks"]["sha256"]) == -(-size // 4096)
    name, info = list(m["weights"]["tensors"].items())[5]                # a tensor in the middle of the file
    with open(p / "weights.bin", "r+b") as f:                            # overwrite its first 300 bytes
        f.seek(info["offset"])
        f.write(b"\x7f" * 300)
    with pytest.raises(PlanError) as e:
        Plan.load(p)
    msg = str(e.value)
    assert f"chunk hash {info['offset'] // 4096} " in msg and name in msg.split("tensors ")[1] and "\n" not in msg


def test_swapped_offsets_are_refused(plan_dir, tmp_path):
    p = copy(plan_dir, tmp_path)
    m = json.loads((p / "manifest.json").read_text())
    t = m["weights"]["tensors"]
    a, b = "layers.0.input_norm", "layers.0.post_attn_norm"                 # same shape and dtype
    t[a]["offset"], t[b]["offset"] = t[b]["offset"], t[a]["offset"]
    (p / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PlanError, match=f"tensor {a} at offset"):
        Plan.load(p, verify="none")


def test_plan_without_chunk_hashes_asks_to_recompile(plan_dir, tmp_path):
    p = copy(plan_dir, tmp_path)
    m = json.loads((p / "manifest.json").read_text())
    del m["weights"]["chunks"]
    (p / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PlanError, match="recompile"):
        Plan.load(p)


@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "kernels/../../x"])
def test_weights_path_stays_inside_the_plan(plan_dir, tmp_path, path):
    p = copy(plan_dir, tmp_path)
    m = json.loads((p / "manifest.json").read_text())
    m["weights"]["file"] = path
    (p / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PlanError) as e:
        Plan.load(p, verify="none")
    assert "plan directory" in str(e.value) and "bytes" not in str(e.value)


def test_weights_symlink_out_of_the_plan(plan_dir, tmp_path):
    p = copy(plan_dir, tmp_path)
    outside = tmp_path / "outside.bin"
    (p / "weights.bin").rename(outside)
    (p / "weights.bin").symlink_to(outside)
    with pytest.raises(PlanError, match="leaves the plan directory"):
        Plan.load(p, verify="none")


def _with_kernels(p, lib_bytes: bytes, recorded: bytes, lib_file: str = "kernels/libxserv_gemm.so"):
    (p / "kernels").mkdir(exist_ok=True)
    (p / "kernels" / "libxserv_gemm.so").write_bytes(lib_bytes)
    m = json.loads((p / "manifest.json").read_text())
    m["kernels"]["gemm_library"] = {"file": lib_file, "hash": "sha256:" + hashlib.sha256(recorded).hexdigest()}
    (p / "manifest.json").write_text(json.dumps(m))


def test_gemm_library_hash_is_checked_before_loading(plan_dir, tmp_path):
    p = copy(plan_dir, tmp_path)
    _with_kernels(p, b"library", b"library")
    assert Plan.load(p).kernel_files()["gemm_library"] == (p / "kernels" / "libxserv_gemm.so").resolve()
    _with_kernels(p, b"replaced", b"library")
    with pytest.raises(PlanError, match="GEMM library does not match"):
        Plan.load(p)
    _with_kernels(p, b"library", b"library", lib_file="/usr/lib/x.so")
    with pytest.raises(PlanError, match="must be relative"):
        Plan.load(p)


def test_broken_kv_cache_shape(plan_dir, tmp_path):
    p = copy(plan_dir, tmp_path)
    m = json.loads((p / "manifest.json").read_text())
    m["kv_cache"]["shape"] = m["kv_cache"]["shape"][:3]
    (p / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PlanError, match="kv_cache: shape"):
        Plan.load(p, verify="none")


def test_truncated_or_missing_weights(plan_dir, tmp_path):
    p = copy(plan_dir, tmp_path)
    raw = (p / "weights.bin").read_bytes()
    (p / "weights.bin").write_bytes(raw[:-256])
    with pytest.raises(PlanError, match="bytes"):
        Plan.load(p)
    (p / "weights.bin").unlink()
    with pytest.raises(PlanError, match="missing"):
        Plan.load(p)


def test_other_schema_and_corrupt_manifest(plan_dir, tmp_path):
    p = copy(plan_dir, tmp_path)
    m = json.loads((p / "manifest.json").read_text())
    (p / "manifest.json").write_text(json.dumps({**m, "schema_version": 0}))
    with pytest.raises(PlanError, match="schema version 0"):
        Plan.load(p)
    (p / "manifest.json").write_text("{")
    with pytest.raises(PlanError, match="corrupt manifest"):
        Plan.load(p)


def test_arch_check():
    plan = Plan.__new__(Plan)
    plan.dir, plan.build = "p", BuildConfig(target="sm_90a")
    check_arch(plan, "sm_90")
    with pytest.raises(PlanError, match="compiled for sm_90a but this GPU is sm_80"):
        check_arch(plan, "sm_80")


def test_recompile_replaces_atomically(plan_dir, tmp_path):
    p = copy(plan_dir, tmp_path)
    hf = make_tiny_model(tmp_path / "hf2", "llama", seed=4)
    with pytest.raises(ValueError, match="already exists"):
        compile_plan(hf, p, BuildConfig(**BUILD))
    old_fp = json.loads((p / "manifest.json").read_text())["weights"]["fingerprint"]
    compile_plan(hf, p, BuildConfig(**BUILD), force=True)
    new_fp = Plan.load(p, verify="full").manifest["weights"]["fingerprint"]
    assert new_fp != old_fp
    assert sorted(x.name for x in tmp_path.iterdir()) == ["hf2", "p"]


def test_op_reading_a_missing_weight(plan_dir, tmp_path):
    p = copy(plan_dir, tmp_path)
    m = json.loads((p / "manifest.json").read_text())
    op = next(o for o in m["buckets"][0]["ops"] if o["op"] == "linear")
    assert op["weight"] == "layers.0.qkv"
    op["weight"] = "layers.0.qkv_renamed"
    (p / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PlanError, match="names 'layers.0.qkv_renamed', which the plan has neither"):
        Plan.load(p, verify="none")


def test_force_replaces_only_plans(plan_dir, tmp_path):
    hf = make_tiny_model(tmp_path / "hf", "llama", seed=5)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a plan"):
        compile_plan(hf, tmp_path / "notes", BuildConfig(**BUILD), force=True)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="not a plan"):                   # the source model itself
        compile_plan(hf, hf, BuildConfig(**BUILD), force=True)
    assert (hf / "config.json").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a plan"):
        compile_plan(hf, tmp_path / "file", BuildConfig(**BUILD), force=True)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["file", "hf", "notes"]


def test_compile_lock_and_stale_temp_dirs(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", "llama", seed=6)
    for stale in (".plan.tmp-dead1", ".plan.old-123"):                 # left by compiles that were killed
        (tmp_path / stale).mkdir()
        (tmp_path / stale / "weights.bin").write_bytes(b"\0" * 4096)
    (tmp_path / ".planb.tmp-other").mkdir()                             # another target's: not ours to remove
    with builder.target_lock(tmp_path / "plan"):                        # a compile into the same target is running
        assert not (tmp_path / ".plan.tmp-dead1").exists()
        with pytest.raises(ValueError, match="another compile"):
            compile_plan(hf, tmp_path / "plan", BuildConfig(**BUILD))
        compile_plan(hf, tmp_path / "other", BuildConfig(**BUILD))     # other targets are free
    compile_plan(hf, tmp_path / "plan", BuildConfig(**BUILD))
    assert sorted(x.name for x in tmp_path.iterdir()) == [".planb.tmp-other", "hf", "other", "plan"]

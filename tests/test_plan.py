"""Plan integrity: fingerprints, schema, arch checks, atomic replacement."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.tiny_models import make_tiny_model
from xserv_aot.config import BuildConfig
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


def test_weights_changed_are_refused(plan_dir, tmp_path):
    p = copy(plan_dir, tmp_path)
    Plan.load(p, verify="full")
    raw = bytearray((p / "weights.bin").read_bytes())
    rng = np.random.default_rng()
    for _ in range(3):                                   # flip bytes somewhere in the first sampled chunk
        raw[int(rng.integers(0, 1 << 16))] ^= 0xFF
    (p / "weights.bin").write_bytes(bytes(raw))
    with pytest.raises(PlanError, match="fingerprint"):
        Plan.load(p)
    with pytest.raises(PlanError, match="fingerprint"):
        Plan.load(p, verify="full")


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

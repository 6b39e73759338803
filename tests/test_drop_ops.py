"""scripts/drop_ops.py: the timing-only plan copy loses exactly the named ops of the named decode buckets, shares
the weights and kernels by hard link, and still loads (and runs) as a plan."""
from __future__ import annotations

import json

import numpy as np

from tests.conftest import load_script
from tests.tiny_models import make_tiny_model
from xserv_aot.config import BuildConfig
from xserv_aot.plan.builder import compile_plan
from xserv_aot.plan.manifest import Plan
from xserv_aot.runtime.numpy_backend import NumpyRunner
from xserv_aot.runtime.session import Session


def test_drop_ops_removes_the_named_ops_only(tmp_path, seed):
    model = make_tiny_model(tmp_path / "hf", "qwen3", seed=seed)
    build = dict(max_num_seqs=2, decode_buckets=[1, 2], prefill_buckets=[8], max_seq_len=64, block_size=4,
                 dtype="float32", target="cpu")
    src = compile_plan(model, tmp_path / "plan", BuildConfig(**build)).dir
    changed = load_script("drop_ops").drop_ops(src, tmp_path / "nn", {"add_rmsnorm", "rmsnorm"}, {"decode_1"})
    before, after = (json.loads((d / "manifest.json").read_text())["buckets"] for d in (src, tmp_path / "nn"))
    for a, b in zip(before, after):
        kept = [op for op in a["ops"] if not (a["name"] == "decode_1" and op["op"] in ("add_rmsnorm", "rmsnorm"))]
        assert b["ops"] == kept
    n = len(next(b for b in before if b["name"] == "decode_1")["ops"])
    assert changed == {"decode_1": (n, n - 2 * 2 - 1)}     # 2 layers x 2 norms, + the final norm
    assert all((tmp_path / "nn" / p.relative_to(src)).stat().st_ino == p.stat().st_ino
               for p in src.rglob("*") if p.is_file() and p.name != "manifest.json")
    plan = Plan.load(tmp_path / "nn")
    s = Session(NumpyRunner(plan))
    s.prefill(0, [5, 6, 7])
    ref = Session(NumpyRunner(Plan.load(src)))
    ref.prefill(0, [5, 6, 7])
    assert not np.allclose(s.step({0: [9]})[1], ref.step({0: [9]})[1])     # decode_1 without its norms: other logits

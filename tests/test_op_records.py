"""Op records: a loaded plan's ops are frozen typed records; a manifest whose op list has an unknown op, an unknown
or missing field, a value of the wrong type or a buffer the plan lacks is refused with one line naming it."""
from __future__ import annotations

import dataclasses
import json

import pytest

from xserv_aot.config import BuildConfig
from xserv_aot.plan.builder import compile_plan
from xserv_aot.plan.manifest import Plan, PlanError
from xserv_aot.plan.op_records import KernelChoice, LaunchRecord, Linear, OpRecordError, op_from_dict

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 16, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1e4,
          "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("ops")
    (root / "c.json").write_text(json.dumps(CONFIG))
    build = BuildConfig(max_num_seqs=2, decode_buckets=[1, 2], prefill_buckets=[8], max_seq_len=32, block_size=4,
                        dtype="float32", target="cpu")
    return compile_plan(root / "c.json", root / "plan", build, dummy_weights=True).dir


def test_loaded_ops_are_frozen_records(plan_dir):
    plan = Plan.load(plan_dir)
    ops = plan.buckets[0].ops
    assert [op.op for op in ops[:4]] == ["resolve_input_ids", "embedding", "rmsnorm", "linear"]
    lin = ops[3]
    assert isinstance(lin, Linear) and (lin.inp, lin.weight, lin.bias, lin.out) == ("h", "layers.0.qkv", None, "qkv")
    with pytest.raises(dataclasses.FrozenInstanceError):
        lin.rows = 3
    assert op_from_dict(lin.to_dict()) == lin


@pytest.mark.parametrize("edit,needle", [
    (lambda op: op.update(op="conv2d"), "op 3: unknown op 'conv2d'"),
    (lambda op: op.update(alpha=1.0), "op 3 (linear): unknown field 'alpha'"),
    (lambda op: op.pop("k"), "op 3 (linear): missing field 'k'"),
    (lambda op: op.update(n="4096"), "op 3 (linear): field 'n' = '4096' is not"),
    (lambda op: op.update(rows=True), "field 'rows' = True is not"),
    (lambda op: op.update(weight="layers.9.qkv"), "names 'layers.9.qkv', which the plan has neither"),
    (lambda op: op.update(cuda={"kernel": "x", "color": 1}), "bad cuda entry"),
])
def test_bad_op_entries_are_refused_with_one_line(plan_dir, tmp_path, edit, needle):
    m = json.loads((plan_dir / "manifest.json").read_text())
    edit(m["buckets"][0]["ops"][3])
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PlanError) as e:
        Plan.load(tmp_path / "p", verify="none")
    assert needle in str(e.value) and "bucket decode_1" in str(e.value) and "\n" not in str(e.value)


def test_kernel_choice_round_trips_next_to_its_op():
    rec = LaunchRecord("gemv_m1_bf16", (("ptr", "h"), ("i32", 1)), (1, 1, 1), (256, 1, 1), 0)
    op = Linear(rows=1, inp="h", weight="w", bias=None, out="o", n=8, k=8,
                cuda=KernelChoice("gemv_m1_bf16", (rec,), fused_silu_out="act"))
    d = json.loads(json.dumps(op.to_dict()))
    assert d["cuda"] == {"kernel": "gemv_m1_bf16", "fused_silu_out": "act",
                         "launch": [{"fn": "gemv_m1_bf16", "grid": [1, 1, 1], "block": [256, 1, 1], "smem": 0,
                                     "args": [["ptr", "h"], ["i32", 1]]}]}
    assert op_from_dict(d) == op
    with pytest.raises(dataclasses.FrozenInstanceError):
        op.cuda.launch[0].smem = 1
    d["cuda"]["launch"][0]["color"] = 1
    with pytest.raises(OpRecordError, match="bad launch record"):
        op_from_dict(d)


def test_pdl_launch_record_round_trips_and_bad_pdl_is_refused():
    """A launch under PDL carries "pdl": true (absent otherwise, so other records keep their bytes); any other value,
    or pdl on a host-library call, is not a launch record."""
    rec = LaunchRecord("w8a8_tma_blk_n64c1_bf16", (("i32", 1),), (4, 1, 1), (288, 1, 1), 1024, pdl=True)
    d = json.loads(json.dumps(rec.to_dict()))
    assert d["pdl"] is True and LaunchRecord.from_dict(d, "t") == rec
    assert "pdl" not in LaunchRecord("f", (), (1, 1, 1), (32, 1, 1), 0).to_dict()
    for bad in ({**d, "pdl": False}, {**d, "pdl": 1},
                {"fn": "xserv_gemm_bf16", "library": "gemm_library", "args": [], "pdl": True}):
        with pytest.raises(OpRecordError, match="bad launch record"):
            LaunchRecord.from_dict(bad, "t")


def test_unknown_build_setting_in_a_manifest_is_refused(plan_dir, tmp_path):
    m = json.loads((plan_dir / "manifest.json").read_text())
    m["build"]["no_cutlass"] = True
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PlanError, match="unknown build setting 'no_cutlass'"):
        Plan.load(tmp_path / "p", verify="none")

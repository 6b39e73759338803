"""NVRTC compiles every kernel for sm_90a (no GPU needed), and build_kernels gives every op of every bucket a
kernel whose function exists, with workspace buffers that overlap nothing."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

pytest.importorskip("cuda.core")

from xserv_aot.plan import kernel_build as kb  # noqa: E402
from xserv_aot.plan.attention_plan import BATCHED_ATTN_MIN_SEQS, FEW_ATTN_MIN_TILES, FEW_ATTN_STAGES  # noqa: E402

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1000, "hidden_size": 256,
          "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
          "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
          "tie_word_embeddings": True}


def test_every_kernel_compiles_for_sm90a(tmp_path):
    out = kb.compile_all(tmp_path, "sm_90a")
    assert set(out) == set(kb.KERNEL_SOURCES)
    for name, info in out.items():
        code = (tmp_path / info["file"]).read_bytes()
        assert code[:4] == b"\x7fELF", name
        for fn in info["functions"]:
            assert fn.encode() in code, f"{name}: {fn} missing from the cubin"
        assert info["resources"], f"{name}: no ptxas report"
    assert "attn_prefill_hd128" in out["attention_prefill.cu"]["functions"]
    assert kb.nvrtc_version().startswith("13.0")


def test_cache_key_changes_with_source(tmp_path, monkeypatch):
    monkeypatch.setenv("XSERV_AOT_CACHE", str(tmp_path / "cache"))
    key1 = kb.compile_source("elementwise.cu", "sm_90a").key
    key2 = kb.compile_source("elementwise.cu", "sm_90a").key
    assert key1 == key2
    assert len(list((tmp_path / "cache" / "nvrtc").glob("elementwise-*.cubin"))) == 1
    from xserv_aot.plan import nvrtc_build
    original = nvrtc_build.expand_source
    monkeypatch.setattr(nvrtc_build, "expand_source", lambda p: "// changed\n" + original(p))
    key3 = nvrtc_build.compile_source("elementwise.cu", "sm_90a").key
    assert key3 != key1


def test_cache_entry_counts_only_with_its_log_and_waits(tmp_path, monkeypatch):
    monkeypatch.setenv("XSERV_AOT_CACHE", str(tmp_path / "cache"))
    first = kb.compile_source("elementwise.cu", "sm_90a")
    assert "rmsnorm" in first.waits and "Used" in first.log
    cubin = next((tmp_path / "cache" / "nvrtc").glob("elementwise-*.cubin"))
    cubin.with_suffix(".log").unlink()
    cubin.write_bytes(b"stale")                       # a cubin whose log went missing is compiled again
    again = kb.compile_source("elementwise.cu", "sm_90a")
    assert (again.cubin, again.key, again.waits) == (first.cubin, first.key, first.waits)
    assert cubin.read_bytes() == first.cubin and "Used" in cubin.with_suffix(".log").read_text()


def test_pdl_waiters_reads_each_entry_body():
    from xserv_aot.plan.nvrtc_build import pdl_waiters
    ptx = (".version 9.0\n.visible .entry a(\n\t.param .u64 a_param_0\n)\n{\n\tgriddepcontrol.wait;\n\tret;\n}\n"
           ".visible .entry b(\n)\n{\n\tgriddepcontrol.launch_dependents;\n\tret;\n}\n"
           ".weak .entry c(\n)\n{\n\tbar.sync 0;\n\tgriddepcontrol.wait;\n}\n")
    assert pdl_waiters(ptx) == ("a", "c")


def test_a_pdl_record_of_a_function_that_never_waits_is_refused():
    from xserv_aot.plan.op_records import LaunchRecord
    rec = LaunchRecord(fn="decode_mk_m1", args=(), grid=(1, 1, 1), block=(32, 1, 1), smem=0, pdl=True)
    kb.check_pdl([("decode_1", replace(rec, pdl=False))], set())
    with pytest.raises(kb.KernelBuildError, match="launched under PDL but never waits for its predecessor: decode_mk_m1"):
        kb.check_pdl([("decode_1", rec)], {"rmsnorm"})


def test_shared_constants_reach_the_kernels_only_as_defines():
    from xserv_aot.plan.kernel_constants import KERNEL_DEFINES
    from xserv_aot.plan.nvrtc_build import compile_options
    sources = {n: kb.expand_source(kb.KERNEL_DIR / n) for n in kb.KERNEL_SOURCES}
    for name in KERNEL_DEFINES:
        assert not any(re.search(rf"^\s*#define\s+{name}\b", src, re.M) for src in sources.values()), name
        assert any(re.search(rf"\b{name}\b", src) for src in sources.values()), f"{name} is used by no kernel"
    assert dict(compile_options("sm_90a")["define_macro"]) == {k: str(v) for k, v in KERNEL_DEFINES.items()}


def test_cache_key_changes_with_a_shared_constant(tmp_path, monkeypatch):
    from xserv_aot.plan import kernel_constants
    monkeypatch.setenv("XSERV_AOT_CACHE", str(tmp_path / "cache"))
    key1 = kb.compile_source("elementwise.cu", "sm_90a").key
    monkeypatch.setitem(kernel_constants.KERNEL_DEFINES, "NORM_NC", 2)
    key2 = kb.compile_source("elementwise.cu", "sm_90a").key
    assert key1 != key2


def compile_tiny(tmp_path, monkeypatch, **build):
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    b = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[16, 64], max_seq_len=512, dtype="bfloat16",
             target="sm_90a", gemm_library=False)
    b.update(build)
    return compile_plan(cfg, tmp_path / "plan", BuildConfig(**b), dummy_weights=True)


def test_build_kernels_annotates_every_op(tmp_path, monkeypatch):
    plan = compile_tiny(tmp_path, monkeypatch)
    funcs = plan.kernels["functions"]
    for bk in plan.buckets:
        for op in bk.ops:
            assert op.cuda is not None, (bk.name, op.op)
            for spec in op.cuda.launch:
                assert spec.fn in funcs, spec.fn
                assert all(g >= 1 for g in spec.grid) and 1 <= spec.block[0] <= 1024
        kinds = {op.op: op.cuda.kernel for op in bk.ops}
        if bk.kind == "decode":
            assert kinds["attention"].startswith("attn_decode")
            assert (kinds["silu_mul"] == "fused_into_previous") == (bk.num_tokens <= kb.GEMV_MAX_ROWS)
            few = bk.num_seqs < BATCHED_ATTN_MIN_SEQS        # rope + KV write inside the fused attention kernel
            assert (kinds["qk_norm_rope_cache"] == "fused_into_next") == few
            assert kinds["attention"].startswith("attn_decode_fused" if few else "attn_decode_tc")
        else:
            assert kinds["attention"].startswith("attn_prefill")
    for c in plan.kernels["cubins"].values():
        assert (plan.dir / c["file"]).is_file()
    spans = sorted((i.offset, i.offset + i.nbytes, n) for n, i in plan.arena.items())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "arena buffers overlap"
    assert spans[-1][1] <= plan.arena_size
    assert {"attn_part_o", "attn_part_ml", "sample_scaled", "gemm_splitk_ws"} <= set(plan.arena)
    splitk = [op for bk in plan.buckets for op in bk.ops if op.cuda.kernel == "gemm_64x64_splitk"]
    assert splitk and all(op.cuda.splits * op.rows * op.n <= plan.arena["gemm_splitk_ws"].shape[0] for op in splitk)


def test_few_seq_attention_launch_reads_the_rope_ops_inputs(tmp_path, monkeypatch):
    """decode_1 / decode_2: the fused kernel gets the rope op's buffers, this layer's KV, a grid sized for
    max_seq_len (64-key tiles, >= FEW_ATTN_MIN_TILES a split) and partials that fit the arena."""
    plan = compile_tiny(tmp_path, monkeypatch)
    sig = plan.kernels["signatures"]
    for bk in plan.buckets:
        if bk.kind != "decode" or bk.num_seqs >= BATCHED_ATTN_MIN_SEQS:
            continue
        pairs = [(a, b) for a, b in zip(bk.ops, bk.ops[1:]) if a.op == "qk_norm_rope_cache"]
        assert len(pairs) == CONFIG["num_hidden_layers"]
        for rope, attn in pairs:
            assert attn.op == "attention" and rope.cuda.launch == ()
            (rec,) = attn.cuda.launch
            args = {p["name"]: a for p, a in zip(sig[rec.fn], rec.args)}
            assert {k: args[k][1] for k in ("qkv", "positions", "slot_mapping", "q_norm", "k_norm", "cos_t", "sin_t",
                                           "q_out", "qsl", "seq_lens", "block_tables", "out")} == {
                "qkv": rope.qkv, "positions": rope.positions, "slot_mapping": rope.slot_mapping,
                "q_norm": rope.q_norm, "k_norm": rope.k_norm, "cos_t": rope.cos, "sin_t": rope.sin,
                "q_out": rope.q_out, "qsl": attn.query_start_loc, "seq_lens": attn.seq_lens,
                "block_tables": attn.block_tables, "out": attn.out}
            assert args["kv_layer"] == ("kv", attn.layer)
            assert args["eps"][1] == pytest.approx(rope.eps) and args["scale"][1] == pytest.approx(attn.scale)
            assert args["min_tiles"][1] == FEW_ATTN_MIN_TILES and args["solo_tiles"][1] == FEW_ATTN_STAGES - 1
            assert rec.grid[:2] == (bk.num_seqs, CONFIG["num_key_value_heads"])
            assert 1 <= rec.grid[2] <= -(-512 // 64) and attn.cuda.splits == rec.grid[2]
            assert plan.arena["attn_part_o"].shape[0] >= bk.num_seqs * rec.grid[2]


def test_float32_plan_is_refused(tmp_path, monkeypatch):
    with pytest.raises(kb.KernelBuildError, match="bfloat16"):
        compile_tiny(tmp_path, monkeypatch, dtype="float32")


def test_unsupported_target_is_refused():
    with pytest.raises(kb.KernelBuildError, match="sm_80"):
        kb.build_kernels({}, None, "sm_80")

"""Launch records (plan.kernel_build) against the kernels: the parsed `extern "C"` signatures agree with the
compiler's parameter table in each cubin, every record of a compiled plan packs one C value of the cubin's size per
parameter, its pointers land inside their buffers, bad records are refused with one line, and `inspect --ops`
shows the arguments. No GPU (NVRTC builds on the CPU; the CUTLASS library is replaced by its config table)."""
from __future__ import annotations

import ctypes
import json

import pytest

pytest.importorskip("cuda.core")

from xserv_aot.config import BuildConfig  # noqa: E402
from xserv_aot.plan import kernel_build as kb  # noqa: E402
from xserv_aot.plan import launch_records as lr  # noqa: E402
from xserv_aot.plan import signatures as sg  # noqa: E402
from xserv_aot.plan.builder import compile_plan  # noqa: E402
from xserv_aot.plan.cutlass_build import GEMM_CONFIGS  # noqa: E402
from xserv_aot.plan.inspect import describe  # noqa: E402
from xserv_aot.runtime.cuda.driver import C_TYPES  # noqa: E402
from xserv_aot.runtime.cuda.launch import Buffers, LaunchError, op_launches  # noqa: E402

QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 512,
         "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True}
BUILD = dict(max_num_seqs=8, decode_buckets=[1, 2, 4, 8], prefill_buckets=[16, 128, 256], max_seq_len=512,
             dtype="bfloat16", target="sm_90a")
BASES = (1 << 40, 2 << 40, 3 << 40)        # fake weights, arena, kv base addresses


def fake_cutlass(manifest, out_dir, target, progress):
    lib = {"file": "kernels/libxserv_gemm.so", "hash": "sha256:fake", "configs": list(GEMM_CONFIGS), "build_key": "x"}
    return lib, ""


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("records")
    (tmp / "config.json").write_text(json.dumps(QWEN2))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kb, "try_cutlass", fake_cutlass)
        return compile_plan(tmp / "config.json", tmp / "plan", BuildConfig(**BUILD), dummy_weights=True)


def test_parsed_signatures_match_the_cubin_parameter_tables(plan):
    seen = 0
    for src, c in plan.kernels["cubins"].items():
        parsed = sg.kernel_signatures(src)
        table = sg.cubin_param_sizes((plan.dir / c["file"]).read_bytes())
        assert set(table) == set(c["functions"]) == set(parsed), src
        for fn, sizes in table.items():
            assert [sg.TYPE_BYTES[p["type"]] for p in parsed[fn]] == sizes, fn
            seen += 1
    assert seen > 50


def test_every_record_packs_the_cubin_parameter_sizes_and_points_into_its_buffers(plan):
    tables = {fn: sizes for c in plan.kernels["cubins"].values()
              for fn, sizes in sg.cubin_param_sizes((plan.dir / c["file"]).read_bytes()).items()}
    buf = Buffers(plan, *BASES)
    spans = {n: (BASES[1] + t.offset, t.nbytes) for n, t in plan.arena.items()}
    spans.update({n: (BASES[0] + t.offset, t.nbytes) for n, t in plan.weights.items()})
    kinds, library_calls = set(), 0
    for bk in plan.buckets:
        for op in bk.ops:
            for rec in op.cuda.launch:
                if rec.library:
                    library_calls += 1
                    continue
                packed = [buf.resolve(a) for a in rec.args]
                assert [ctypes.sizeof(C_TYPES[t]) for t, _ in packed] == tables[rec.fn], rec.fn
                for a, (_, v) in zip(rec.args, packed):
                    kinds.add(a[0])
                    if a[0] == "ptr" and a[1] is not None:
                        assert v == spans[a[1]][0], (rec.fn, a)
                    if a[0] == "kv":
                        assert 0 <= v - BASES[2] < plan.kv_cache["size"]
    assert {"ptr", "kv", "i32", "f32"} <= kinds and library_calls > 0
    assert plan.manifest["kernels"]["signatures"]["xserv_gemm_bf16"][-1]["name"] == "stream"


def test_bad_records_are_refused_with_one_line():
    params = sg.kernel_signatures("elementwise.cu")["rmsnorm"]
    dtypes = {"x": "bfloat16", "w": "bfloat16", "h": "bfloat16", "logits": "float32"}.__getitem__
    good = [["ptr", "x"], ["ptr", "w"], ["ptr", "h"], ["i32", 64], ["f32", 1e-6]]
    lr.check_launch(lr.launch("rmsnorm", [1], [32], 0, good), params, dtypes, "bfloat16")
    bad = {"3 arguments for 5": good[:3], "eps is f32, the record passes i32": good[:4] + [["i32", 1]],
           "H is i32, the record passes ptr": good[:3] + [["ptr", "x"], good[4]],
           "points to bfloat16, 'logits' is float32": [["ptr", "logits"]] + good[1:],
           "'nope' is neither": [["ptr", "nope"]] + good[1:], "unknown argument kind": [["u8", 1]] + good[1:]}
    for msg, args in bad.items():
        with pytest.raises(kb.KernelBuildError, match=msg) as e:
            lr.check_launch(lr.launch("rmsnorm", [1], [32], 0, args), params, dtypes, "bfloat16")
        assert "\n" not in str(e.value)


def test_cubin_disagreeing_with_the_parsed_signature_is_refused():
    params = sg.kernel_signatures("elementwise.cu")["rmsnorm"]
    with pytest.raises(kb.KernelBuildError, match="differ from the cubin"):
        sg.check_sizes("rmsnorm", params, [8, 8, 8, 8, 4])


def test_launcher_refuses_a_library_call_without_the_library(plan):
    op = next(op for bk in plan.buckets for op in bk.ops if op.cuda.kernel == "cutlass")
    with pytest.raises(LaunchError, match="gemm_library"):
        op_launches(op, Buffers(plan, *BASES), lambda fn: fn, {})


def test_inspect_ops_shows_arguments(plan):
    text = describe(plan.dir, "decode_1")
    assert "rmsnorm<<<(1, 1, 1), (64, 1, 1), 0>>>(inp=x, w=layers.0.input_norm, out=h, H=512, eps=1e-06)" in text
    assert "kv_layer=kv[1]" in text and "num_slots=" in text
    text = describe(plan.dir, "prefill_256")
    assert "gemm_library:xserv_gemm_bf16(config=" in text and "bias=layers.0.qkv_bias" in text


def test_pointer_arguments_resolve_names_offsets_kv_layers_and_null(plan):
    buf = Buffers(plan, *BASES)
    kv = plan.kv_cache
    layer_bytes = 2 * kv["shape"][2] * kv["shape"][3] * kv["shape"][4] * kv["shape"][5] * 2    # bf16, K and V
    assert buf.resolve(["ptr", "x", 512]) == ("ptr", BASES[1] + plan.arena["x"].offset + 512)
    assert buf.resolve(["ptr", "final_norm"]) == ("ptr", BASES[0] + plan.weights["final_norm"].offset)
    assert buf.resolve(["kv", 1]) == ("ptr", BASES[2] + layer_bytes)
    assert buf.resolve(["ptr", None]) == ("ptr", 0) and buf.resolve(["f32", 0.5]) == ("f32", 0.5)
    with pytest.raises(LaunchError, match="'nope'"):
        buf.resolve(["ptr", "nope"])

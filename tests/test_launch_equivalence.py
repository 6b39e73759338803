"""Old per-op argument packing (tests/legacy_launch.py, runtime/cuda/launch.py before the launch records) against the
generic launcher replaying the manifest's records: byte-identical parameter blocks (pointers over fake base
addresses, scalars), grid, block and smem for every op of every bucket of the Qwen3-8B preset plan. No GPU: the
NVRTC build runs on the CPU, the CUTLASS library is replaced by a config table (the routing needs only that)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("cuda.core")

from tests import legacy_launch  # noqa: E402
from xserv_aot.config import BuildConfig  # noqa: E402
from xserv_aot.plan import kernel_build as kb  # noqa: E402
from xserv_aot.plan.builder import compile_plan  # noqa: E402
from xserv_aot.plan.cutlass_build import GEMM_CONFIGS  # noqa: E402
from xserv_aot.runtime.cuda import launch as new_launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASES = (0x7F0000000000, 0x7E0000000000, 0x7D0000000000)    # weights, arena, kv


class RecordingGemm:
    """Stands in for CutlassGemm on both sides: records the call arguments."""

    def __init__(self):
        self.calls = []

    def gemm(self, cfg, a, w, c, bias, m, n, k, stream):
        self.calls.append((cfg, a, w, c, bias, m, n, k))

    def entry(self, fn, args):
        assert fn == kb.GEMM_ENTRY
        vals = [v if t != "ptr" else (v or None) for t, v in args]
        return lambda stream: self.calls.append(tuple(vals))


def fake_cutlass(manifest, out_dir, target, progress):
    return {"file": "kernels/libxserv_gemm.so", "hash": "sha256:fake", "configs": list(GEMM_CONFIGS), "build_key": "x"}


def packed(ln):
    return [t for t, _ in ln.args], b"".join(bytes(v) for v in ln._vals), ln.grid, ln.block, ln.smem, ln.name


QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 512,
         "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True}
TINY_BUILD = dict(max_num_seqs=8, decode_buckets=[1, 2, 4, 8], prefill_buckets=[16, 128, 256], max_seq_len=512,
                  dtype="bfloat16", target="sm_90a")


@pytest.mark.parametrize("model", ["qwen3-8b", "qwen2-tiny"])
def test_generic_launcher_packs_what_the_per_op_code_packed(tmp_path, monkeypatch, model):
    monkeypatch.setattr(kb, "try_cutlass", fake_cutlass)
    if model == "qwen3-8b":
        config, build = ROOT / "plans" / "qwen3-8b.config.json", json.loads((ROOT / "plans" / "h200.build.json").read_text())
    else:
        config, build = tmp_path / "config.json", TINY_BUILD
        config.write_text(json.dumps(QWEN2))
    plan = compile_plan(config, tmp_path / "plan", BuildConfig(**build), dummy_weights=True)
    old_buf, new_buf = legacy_launch.Buffers(plan, *BASES), new_launch.Buffers(plan, *BASES)
    funcs = lambda fn: fn  # noqa: E731
    n_kernels = n_calls = 0
    for bk in plan.buckets:
        for i, op in enumerate(bk.ops):
            g_old, g_new = RecordingGemm(), RecordingGemm()
            old = legacy_launch.op_launches(op, old_buf, funcs, g_old)
            new = new_launch.op_launches(op, new_buf, funcs, {"gemm_library": g_new})
            where = f"{bk.name} op {i} ({op['op']}, {op.get('kernel')})"
            assert len(old) == len(new), where
            for lo, ln in zip(old, new):
                if isinstance(lo, legacy_launch.Launch):
                    assert packed(lo) == packed(ln), where
                    n_kernels += 1
                else:
                    lo(0)
                    ln(0)
                    assert g_old.calls == g_new.calls and len(g_new.calls) == 1, where
                    n_calls += 1
    print(f"equivalent: {n_kernels} kernel launches, {n_calls} CUTLASS calls over {len(plan.buckets)} buckets")
    assert n_kernels > 100 and n_calls > 0

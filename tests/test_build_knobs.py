"""Build-affecting switches are BuildConfig fields recorded in the manifest (no environment knobs): the GEMM
library on/off and programmatic dependent launch, set from the CLI, reach the plan and the launcher."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("cuda.core")

from tests.test_cli import assert_one_line_error, cli  # noqa: E402
from xserv_aot.config import BuildConfig, ConfigError  # noqa: E402
from xserv_aot.plan.manifest import Plan  # noqa: E402
from xserv_aot.runtime.cuda.driver import Launch  # noqa: E402
from xserv_aot.runtime.cuda.launch import Buffers, op_launches  # noqa: E402

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
          "tie_word_embeddings": True}
SMALL = ["--max-num-seqs", "2", "--prefill-buckets", "16,128", "--max-seq-len", "256", "--dummy-weights"]


def test_cli_switches_are_recorded_in_the_plan_and_reach_the_launcher(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(CONFIG))
    r = cli("compile", tmp_path / "c.json", "-o", tmp_path / "plan", *SMALL, "--pdl", "--no-gemm-library")
    assert r.returncode == 0, r.stderr
    plan = Plan.load(tmp_path / "plan")
    assert plan.build.pdl is True and plan.build.gemm_library is False
    assert plan.kernels["gemm_library"] is None and plan.kernels["gemm_library_skipped"] == "off in the build config"
    ops = [op for bk in plan.buckets for op in bk.ops]
    assert not any(op.cuda.kernel == "cutlass" for op in ops)
    assert any(op.op == "linear" and op.rows >= 128 for op in ops)      # a CUTLASS-sized linear, routed elsewhere
    buf = Buffers(plan, 1 << 40, 2 << 40, 3 << 40)
    launches = [ln for op in ops for ln in op_launches(op, buf, lambda fn: fn, {})]
    assert launches and all(isinstance(ln, Launch) and ln.pdl for ln in launches)


def test_defaults_are_recorded_too(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(CONFIG))
    r = cli("compile", tmp_path / "c.json", "-o", tmp_path / "plan", *SMALL, "--target", "cpu", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    build = json.loads((tmp_path / "plan" / "manifest.json").read_text())["build"]
    assert build["pdl"] is False and build["gemm_library"] is True


def test_switches_must_be_booleans(tmp_path):
    with pytest.raises(ConfigError, match="pdl must be true or false"):
        BuildConfig(pdl="yes").validate()
    (tmp_path / "b.json").write_text(json.dumps({"gemm_library": 1}))
    (tmp_path / "c.json").write_text(json.dumps(CONFIG))
    r = cli("compile", tmp_path / "c.json", "-o", tmp_path / "plan", *SMALL, "--build-config", tmp_path / "b.json")
    assert_one_line_error(r, "gemm_library must be true or false")


def test_a_misspelt_build_setting_is_refused(tmp_path):
    (tmp_path / "b.json").write_text(json.dumps({"pld": True}))
    (tmp_path / "c.json").write_text(json.dumps(CONFIG))
    r = cli("compile", tmp_path / "c.json", "-o", tmp_path / "plan", *SMALL, "--build-config", tmp_path / "b.json")
    assert_one_line_error(r, "unknown build setting 'pld'")


def test_a_renamed_setting_of_an_older_manifest_loads_under_its_new_name():
    b = BuildConfig.from_dict({"fp8_fold_norm": True})
    assert b.fold_norm is True and "fp8_fold_norm" not in b.to_dict()


@pytest.mark.parametrize("bad", [101, -2, 50.0, True, "100"])
def test_smem_carveout_is_a_percent_or_the_drivers_choice(tmp_path, bad):
    with pytest.raises(ConfigError, match="smem_carveout .* must be an integer percent in 0..100, or -1"):
        BuildConfig(smem_carveout=bad).validate()
    assert BuildConfig().validate().smem_carveout == -1 and BuildConfig(smem_carveout=100).validate()


def test_smem_carveout_is_recorded_and_set_on_every_plan_kernel(tmp_path):
    """A build config's smem_carveout reaches the manifest and every kernel function the CUDA runner loads
    (the device is a fake: what it is asked to set is recorded)."""
    from xserv_aot.runtime.cuda.runner import CudaRunner
    (tmp_path / "b.json").write_text(json.dumps({"smem_carveout": 100}))
    (tmp_path / "c.json").write_text(json.dumps(CONFIG))
    r = cli("compile", tmp_path / "c.json", "-o", tmp_path / "plan", *SMALL, "--no-gemm-library",
            "--build-config", tmp_path / "b.json")
    assert r.returncode == 0, r.stderr
    plan = Plan.load(tmp_path / "plan")
    assert plan.build.smem_carveout == 100

    class FakeDevice:
        calls = []

        def function(self, module, name, max_smem=0, carveout=-1):
            self.calls.append((name, carveout))
            return name

    runner = CudaRunner.__new__(CudaRunner)
    runner.plan, runner.dev, runner._funcs, runner._smem = plan, FakeDevice(), {}, {}
    runner.modules = {src: None for src in set(plan.kernels["functions"].values())}
    names = sorted(plan.kernels["functions"])[:3]
    assert [runner.func(n) for n in names] == names
    assert FakeDevice.calls == [(n, 100) for n in names]

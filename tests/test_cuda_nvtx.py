"""GPU: NVTX ranges on the CUDA runner are named from the plan and change nothing; one eager step for ncu runs."""
from __future__ import annotations

import numpy as np
import pytest

from tests.test_cuda_runner import plan  # noqa: F401 (module fixture)
from tests.test_nsight import Recorder
from xserv_aot.plan.roofline import op_name

pytestmark = pytest.mark.gpu


def test_ranges_named_from_the_plan_and_outputs_unchanged(plan):  # noqa: F811
    from xserv_aot.runtime.cuda.profile import decode_batch
    from xserv_aot.runtime.cuda.runner import CudaRunner

    plain = CudaRunner(plan)
    want = plain.run(decode_batch(plan, 2, 40)).sampled_ids
    plain.close()
    r = CudaRunner(plan, nvtx=True)                 # loads a real NVTX implementation (nvidia-nvtx / nvtx)
    try:
        r.nvtx = rec = Recorder()
        got = r.run(decode_batch(plan, 2, 40)).sampled_ids
        assert np.array_equal(got, want)
        assert [e for e in rec.events if e != "-"] == ["+stage", "+replay decode_2", "+finish"]
        rec.events.clear()
        r.run_eager("decode_2", decode_batch(plan, 2, 40))
        bk = r.buckets["decode_2"]
        ops = [f"+{op_name('decode_2', i, op)}" for i, op in enumerate(bk.ops) if op.cuda.launch]
        assert [e for e in rec.events if e != "-"] == ["+eager decode_2", *ops, "+finish"]
        assert rec.events.count("-") == len(ops) + 2
    finally:
        r.close()


def test_run_one_step(plan, tmp_path):  # noqa: F811
    import json

    from xserv_aot.runtime.cuda.profile import run_one_step
    from xserv_aot.runtime.ncu_report import profiled_ops
    bk = next(b for b in plan.buckets if b.name == "decode_1")
    msg = run_one_step(plan.dir, "decode_1", 64, layers=1, events_out=tmp_path / "ev.json")
    assert f"profiler on for {len(profiled_ops(bk, 1))} of" in msg
    ev = json.loads((tmp_path / "ev.json").read_text())
    assert ev["timing"] == "graph"                      # event nodes inside the captured step work on this driver
    assert sorted(int(i) for i in ev["ops"]) == [i for i, op in enumerate(bk.ops) if op.cuda.launch]
    assert all(ms > 0 for ms in ev["ops"].values())
    with pytest.raises(ValueError, match="no bucket"):
        run_one_step(plan.dir, "decode_3", 64)


def test_op_times_in_graph_follow_the_step(plan):  # noqa: F811
    from xserv_aot.runtime.cuda.profile import format_table, profile_runner
    from xserv_aot.runtime.cuda.runner import CudaRunner
    r = CudaRunner(plan)
    try:
        prof = profile_runner(r, "decode_2", 40, reps=5)
    finally:
        r.close()
    assert prof["timing"] == "graph" and all(row[3] > 0 for row in prof["ops"])
    assert "events inside one graph replay" in format_table(prof, plan.build.target)


def test_profile_ncu_on_the_tiny_plan(plan, tmp_path):  # noqa: F811
    """Nsight Compute for real (skipped without ncu on PATH): every launching op of decode_2 profiled (--layers 0),
    each kernel matched to its op and named by the op's NVTX range, event times from one graph replay."""
    import shutil
    import subprocess
    import sys
    if shutil.which("ncu") is None:
        pytest.skip("ncu is not on PATH")
    r = subprocess.run([sys.executable, "-m", "xserv_aot.cli", "profile", str(plan.dir), "--bucket", "decode_2",
                        "--context", "40", "--ncu", "--layers", "0", "--out", str(tmp_path / "d2")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.splitlines()
    bk = next(b for b in plan.buckets if b.name == "decode_2")
    launching = [i for i, op in enumerate(bk.ops) if op.cuda.launch]
    first = [ln.split() for ln in out if ln[:4].strip().isdigit()]
    assert sorted({int(x[0]) for x in first}) == launching, r.stdout
    n = sum(len(bk.ops[i].cuda.launch) for i in launching)
    assert f"nvtx: {n} of {n} profiled kernels carry their op's NVTX range" in out, r.stdout
    assert any(ln.startswith("agreement:") and "events inside one graph replay" in ln for ln in out), r.stdout
    assert (tmp_path / "d2.ncu-rep").is_file()

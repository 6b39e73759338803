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


def test_run_one_step(plan):  # noqa: F811
    from xserv_aot.runtime.cuda.profile import run_one_step
    assert "decode_1" in run_one_step(plan.dir, "decode_1", 64)
    with pytest.raises(ValueError, match="no bucket"):
        run_one_step(plan.dir, "decode_3", 64)

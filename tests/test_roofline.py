"""Per-op bytes/FLOPs and the floor they imply (plan/roofline.py), and `inspect --roofline`: checked against
counts taken from the plan's own weights and the model shape by hand."""
from __future__ import annotations

import numpy as np
import pytest

from tests.test_cli import assert_one_line_error, cli
from xserv_aot.plan import roofline as rl


@pytest.fixture(scope="module")
def gpu_plan(tmp_path_factory):
    """A tiny Qwen3 compiled for sm_90a (NVRTC, no GPU needed): ops carry kernels and launches."""
    pytest.importorskip("cuda.core")
    from tests.test_kernel_build import compile_tiny
    mp = pytest.MonkeyPatch()
    try:
        yield compile_tiny(tmp_path_factory.mktemp("roofline"), mp)
    finally:
        mp.undo()


def linear_weight_elems(plan) -> int:
    names = [n for n in plan.weights if n.endswith((".qkv", ".o_proj", ".gate_up", ".down"))]
    head = "embed_tokens" if plan.model.tie_word_embeddings else "lm_head"
    return sum(int(np.prod(plan.weights[n].shape)) for n in names + [head])


def test_decode_costs_match_the_weights_and_shape(gpu_plan):
    plan, m = gpu_plan, gpu_plan.model
    bk = next(b for b in plan.buckets if b.name == "decode_1")
    costs = rl.bucket_costs(plan, bk, 128)
    lin = [c for c in costs if c[1].op == "linear"]
    assert sum(c[3] for c in lin) == 2 * linear_weight_elems(plan)             # a GEMV: 2 FLOPs per weight
    assert sum(c[2] for c in lin) >= 2 * linear_weight_elems(plan)             # bf16: each weight read once
    attn = [c for c in costs if c[1].op == "attention"]
    assert [c[3] for c in attn] == [4 * m.num_heads * m.head_dim * 128] * m.num_layers
    kv_bytes = 128 * m.num_kv_heads * m.head_dim * 2 * 2                       # K and V, bf16
    assert [c[2] - 2 * m.num_heads * m.head_dim * 2 for c in attn] == [kv_bytes] * m.num_layers


def test_ops_that_launch_nothing_have_no_row(gpu_plan):
    for bk in gpu_plan.buckets:
        fused = [i for i, op in enumerate(bk.ops) if op.cuda.kernel in ("fused_into_previous", "fused_into_next")]
        assert all(not bk.ops[i].cuda.launch for i in fused)
        rows = [c[0] for c in rl.bucket_costs(gpu_plan, bk, 128)]
        assert not set(fused) & set(rows)
        assert len(rows) == len(bk.ops) - len(fused)
    kinds = {op.cuda.kernel for op in gpu_plan.buckets[0].ops}
    assert {"fused_into_previous", "fused_into_next"} <= kinds


def test_floor_takes_the_binding_ceiling():
    c = rl.TARGETS["sm_90a"]
    assert (c.read_bytes_per_s, c.flops_per_s) == (4.6e12, 790e12)
    assert rl.floor_s(4.6e9, 1e9, c) == (pytest.approx(1e-3), "memory")
    assert rl.floor_s(1e6, 790e9, c) == (pytest.approx(1e-3), "compute")
    assert rl.ceilings_for("cpu") is c


def test_e4m3_gemms_count_at_their_own_peak():
    from xserv_aot.plan.op_records import Linear
    c = rl.TARGETS["sm_90a"]
    w8a8 = Linear(rows=256, n=4096, k=4096, inp="xq", inp_scale="xs", weight="w", bias=None, out="o",
                  weight_scale="w.scale", quant="fp8_block128")
    w8a16 = Linear(rows=256, n=4096, k=4096, inp="h", weight="w", bias=None, out="o", weight_scale="w.scale",
                   quant="fp8_block128")
    bf16 = Linear(rows=256, n=4096, k=4096, inp="h", weight="w", bias=None, out="o")
    flops = 2 * 256 * 4096 * 4096
    assert [rl.fp8_mma(op) for op in (w8a8, w8a16, bf16)] == [True, False, False]
    assert rl.compute_s(w8a8, flops, c) == pytest.approx(flops / 1580e12)
    assert rl.compute_s(w8a16, flops, c) == rl.compute_s(bf16, flops, c) == pytest.approx(flops / 790e12)
    costs = [(0, w8a8, 1000, 1580e9), (1, bf16, 1000, 790e9)]          # 1 ms + 1 ms of FLOPs, bytes negligible
    assert rl.costs_floor_s(costs, c) == (pytest.approx(2e-3), "compute")


def test_profile_table_rates_e4m3_gemms_against_their_peak():
    from xserv_aot.runtime.cuda.profile import format_table
    prof = {"bucket": "decode_256", "context": 1024, "graph_ms": 2.0, "ops_ms": 2.0, "timing": "graph",
            "ops": [(0, "linear", "cutlass_fp8", 1.0, 10 ** 6, 790e9), (1, "linear", "cutlass", 1.0, 10 ** 6, 395e9)],
            "fp8_ops": [0]}
    rows = {line.split()[0]: line.split() for line in format_table(prof).splitlines()[2:]}
    assert rows["linear:cutlass_fp8"][-2:] == ["compute", "50.0%"]    # 790 TFLOP/s of e4m3's 1580
    assert rows["linear:cutlass"][-2:] == ["compute", "50.0%"]        # 395 of bf16's 790
    assert "e4m3 1580" in format_table(prof).splitlines()[0]


def test_prefill_attention_flops_are_causal(gpu_plan):
    m = gpu_plan.model
    op = next(op for op in gpu_plan.buckets[-1].ops if op.op == "attention")
    t = op.rows
    keys = sum(range(1, t + 1))                                                # row i sees i + 1 keys
    assert rl.op_flops(op, gpu_plan, t, 1) == 4 * m.num_heads * m.head_dim * keys


def test_kv_bytes_follow_the_kv_cache_dtype(gpu_plan):
    import copy
    m = gpu_plan.model
    wide = copy.copy(gpu_plan)
    wide.kv_cache = {**gpu_plan.kv_cache, "dtype": "float32"}
    bk = next(b for b in gpu_plan.buckets if b.name == "decode_2")
    attn = next(op for op in bk.ops if op.op == "attention")
    rope = next(op for op in bk.ops if op.op == "qk_norm_rope_cache")
    assert gpu_plan.kv_cache["dtype"] == "bfloat16"
    extra = rl.op_bytes(attn, wide, 128, 2) - rl.op_bytes(attn, gpu_plan, 128, 2)
    assert extra == 2 * 128 * m.num_kv_heads * m.head_dim * 2 * (4 - 2)          # 2 seqs x 128 keys, K and V
    assert rl.op_bytes(rope, wide, 128, 2) - rl.op_bytes(rope, gpu_plan, 128, 2) == 2 * 2 * m.kv_size * (4 - 2)


def test_cpu_plans_count_every_op(tmp_path, monkeypatch):
    from tests.test_kernel_build import compile_tiny
    plan = compile_tiny(tmp_path, monkeypatch, target="cpu", dtype="float32")
    for bk in plan.buckets:
        assert all(op.cuda is None for op in bk.ops)
        assert [c[0] for c in rl.bucket_costs(plan, bk, 64)] == list(range(len(bk.ops)))


def test_op_names_come_from_the_plan(gpu_plan):
    bk = gpu_plan.buckets[0]
    i = next(i for i, op in enumerate(bk.ops) if op.op == "linear")
    assert rl.op_name(bk.name, i, bk.ops[i]) == f"decode_1/{i} L0 linear qkv {bk.ops[i].cuda.kernel}"


def test_inspect_roofline_cli(gpu_plan):
    r = cli("inspect", str(gpu_plan.dir), "--roofline", "--context", "256")
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines()[2:]}
    assert set(lines) == {b.name for b in gpu_plan.buckets}
    c = rl.TARGETS["sm_90a"]
    bk = gpu_plan.buckets[0]
    nbytes = sum(x[2] for x in rl.bucket_costs(gpu_plan, bk, 256))
    assert float(lines["decode_1"][2]) == pytest.approx(nbytes / 1e9, abs=1e-4)
    assert float(lines["decode_1"][6]) == pytest.approx(nbytes / c.read_bytes_per_s * 1e3, abs=1e-3)
    assert lines["decode_1"][7] == "memory" and "at context 256" in r.stdout
    bad = cli("inspect", str(gpu_plan.dir), "--roofline", "--context", "0")
    assert_one_line_error(bad, "--context must be >= 1")


class ClockDevice:
    """Events read a clock that each launch advances by 1 ms: an op's time is its number of launches. A captured
    graph is its body, run again at each replay (events recorded in it read the clock then); can_capture=False
    fails capture as a driver without event nodes would."""

    def __init__(self, can_capture: bool = True):
        self.now, self.stream, self.can_capture = 0.0, None, can_capture

    def event(self):
        return [0.0]

    def record(self, ev):
        ev[0] = self.now

    record_in_graph = record

    def capture(self, body):
        from xserv_aot.runtime.cuda.driver import CudaError
        if not self.can_capture:
            raise CudaError("cuEventRecordWithFlags failed: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
        return body

    def graph_launch(self, graph):
        graph(self.stream)

    def elapsed_ms(self, a, b):
        return b[0] - a[0]

    def sync(self):
        pass


def fake_runner(plan, bk, dev):
    from types import SimpleNamespace

    from xserv_aot.runtime import nvtx

    def tick(_stream):
        dev.now += 1.0

    lns = [[tick] * len(op.cuda.launch) for op in bk.ops]
    return SimpleNamespace(plan=plan, dev=dev, buckets={bk.name: bk}, launches={bk.name: lns}, graphs={},
                           nvtx=nvtx.OFF, op_names={}, stage=lambda batch, b: None,
                           enqueue=lambda name, lns=lns: [ln(None) for op_lns in lns for ln in op_lns])


@pytest.mark.parametrize("can_capture, timing", [(True, "graph"), (False, "eager")])
def test_profile_runner_rows_are_the_launching_ops(gpu_plan, can_capture, timing):
    from xserv_aot.runtime.cuda.profile import format_table, profile_runner
    dev = ClockDevice(can_capture)
    skipped = {}
    for bk in (gpu_plan.buckets[0], next(b for b in gpu_plan.buckets if b.kind == "prefill")):
        prof = profile_runner(fake_runner(gpu_plan, bk, dev), bk.name, 64, reps=3)
        launching = [i for i, op in enumerate(bk.ops) if op.cuda.launch]
        assert [r[0] for r in prof["ops"]] == launching
        assert [r[3] for r in prof["ops"]] == [float(len(bk.ops[i].cuda.launch)) for i in launching]
        total = sum(len(op.cuda.launch) for op in bk.ops)
        assert prof["ops_ms"] == prof["graph_ms"] == float(total) and prof["timing"] == timing
        table = format_table(prof, gpu_plan.build.target)
        assert f"graph step {total:.3f} ms, sum of ops {total:.3f} ms" in table
        assert ("events inside one graph replay" if can_capture else "events between eager launches") in table
        skipped[bk.kind] = len(bk.ops) - len(prof["ops"])
    assert skipped["decode"] > 0 and skipped["prefill"] == 0                     # decode_1: silu_mul fused, no row
    attn = next(r for r in prof["ops"] if r[1] == "attention")
    assert attn[3] == 2.0 and attn[2] == bk.ops[attn[0]].cuda.kernel                # prefill + batched decode


def test_profiled_step_brackets_the_chosen_ops(gpu_plan):
    from xserv_aot.runtime.cuda.profile import profiled_step
    from xserv_aot.runtime.ncu_report import profiled_ops
    bk = gpu_plan.buckets[0]
    runner, log = fake_runner(gpu_plan, bk, ClockDevice()), []
    for i, lns in enumerate(runner.launches[bk.name]):
        lns[:] = [lambda _s, i=i: log.append(i)] * len(lns)
    chosen = profiled_ops(bk, 1)
    profiled_step(runner, bk.name, chosen, lambda: log.append("start"), lambda: log.append("stop"))
    on, seen = False, []
    for e in log:
        if e in ("start", "stop"):
            assert on == (e == "stop")                                            # alternating, starts off
            on = e == "start"
        else:
            assert on == (e in chosen)
            seen.append(e)
    assert not on and log.count("start") == 2                                    # layer 0, then the head
    assert seen == [i for i, op in enumerate(bk.ops) if op.cuda.launch]          # every launch, in order

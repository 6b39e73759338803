"""profile --nsys / --ncu on the CPU: the command lines built, the no-tool message, fake nsys/ncu executables on
PATH (what they are called with, the report they leave), the ncu CSV parser on a hand-written sample in ncu's
documented `--csv --page details` layout, and NVTX ranges (off by default; named ranges around engine stages)."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from tests.test_cli import assert_one_line_error
from tests.test_roofline import gpu_plan  # noqa: F401 (module fixture: a tiny sm_90a plan)
from xserv_aot.runtime import nsight, nvtx

SAMPLE = Path(__file__).parent / "data" / "ncu_gemv_sample.csv"


def run_cli(*args, path: str):
    import subprocess
    env = dict(os.environ, PATH=path)
    return subprocess.run([sys.executable, "-m", "xserv_aot.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)


def fake_tool(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    p = bin_dir / name
    p.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {bin_dir}/{name}.args\n{body}\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


def test_nsys_command():
    cmd = nsight.nsys_command(Path("p"), "decode_64", 256, Path("out/run"))
    assert cmd == ["nsys", "profile", "--trace", "cuda,nvtx", "--output", "out/run", "--force-overwrite", "true",
                   sys.executable, "-m", "xserv_aot.cli", "profile", "p", "--bucket", "decode_64", "--context", "256",
                   "--nvtx"]


def test_ncu_command():
    cmd = nsight.ncu_command(Path("p"), "decode_1", 128, Path("/tmp/x.csv"), kernel="gemv")
    assert cmd[:2] == ["ncu", "--clock-control"] and cmd[2] == "none"
    metrics = cmd[cmd.index("--metrics") + 1].split(",")
    assert set(metrics) == {"gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
                            "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                            "sm__throughput.avg.pct_of_peak_sustained_elapsed",
                            "sm__warps_active.avg.pct_of_peak_sustained_active"}
    for flag, value in (("--profile-from-start", "off"), ("--page", "details"), ("--print-units", "base"),
                        ("--log-file", "/tmp/x.csv"), ("--kernel-name", "regex:gemv")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--csv" in cmd and "--nvtx" in cmd
    assert cmd[-10:] == [sys.executable, "-m", "xserv_aot.cli", "profile", "p", "--bucket", "decode_1",
                         "--context", "128", "--nvtx", "--one-step"][-10:]
    assert "--kernel-name" not in nsight.ncu_command(Path("p"), "decode_1", 128, Path("x"))


@pytest.mark.parametrize("flag, tool", [("--nsys", "nsys"), ("--ncu", "ncu")])
def test_missing_tool_is_one_line(tmp_path, flag, tool):
    r = run_cli("profile", tmp_path, flag, path=str(tmp_path))         # an empty PATH directory
    assert_one_line_error(r, f"{tool} is not on PATH")


def test_parse_ncu_csv_sample():
    ks = nsight.parse_ncu_csv(SAMPLE.read_text())
    assert [(k.id, k.name) for k in ks] == [(0, "gemv_m1_bf16"), (1, "gemv_m1_bf16"), (2, "gemv_gate_m1"),
                                            (3, "gemv_m1_bf16")]
    k = ks[2].metrics
    assert k[nsight.TIME] == pytest.approx(3744e-9) and k[nsight.DRAM_READ] == 786432
    assert k[nsight.DRAM_WRITE] == 1536 and k[nsight.OCCUPANCY] == pytest.approx(55.90)
    assert ks[2].dram_gb_per_s == pytest.approx((786432 + 1536) / 3744e-9 / 1e9)
    with pytest.raises(ValueError, match="no header"):
        nsight.parse_ncu_csv("==PROF== No kernels were profiled.\n")
    with pytest.raises(ValueError, match="unknown unit"):
        nsight.parse_ncu_csv(SAMPLE.read_text().replace('"nsecond"', '"fortnight"'))


def test_kernels_match_plan_ops_in_order(gpu_plan):  # noqa: F811
    bk = gpu_plan.buckets[0]
    matched = nsight.match_kernels(nsight.parse_ncu_csv(SAMPLE.read_text()), bk, "gemv")
    gemv_ops = [i for i, op in enumerate(bk.ops) if op.cuda.launch and op.cuda.kernel.startswith("gemv")]
    assert [m[1] for m in matched] == gemv_ops[:4] and all(m[3] for m in matched)


CUTLASS_KERNEL = ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int, int>, "
                  "cutlass::gemm::collective::CollectiveMma<...>>>(T1::Params)")


def hand_bucket():
    """Ops laid out as a Qwen3 decode/mixed bucket of the lent H200 plan: CUTLASS library calls, an attention op
    with two launches (prefill + batched decode), a fused silu_mul that launches nothing."""
    from types import SimpleNamespace

    from xserv_aot.plan.op_records import KernelChoice, LaunchRecord

    def k(*fns):
        return KernelChoice(fns[0], tuple(LaunchRecord(f, (), (1, 1, 1), (32, 1, 1)) for f in fns))

    lib = KernelChoice("cutlass", (LaunchRecord("xserv_gemm_bf16_ex", (), library="gemm_library"),))
    cuda = [k("rmsnorm"), lib, k("qk_norm_rope_cache_hd128"), k("attn_prefill_hd128", "attn_decode_tc_s2_hd128"),
            lib, k("add_rmsnorm"), lib, KernelChoice("fused_into_previous"), lib, k("sample_rows")]
    return SimpleNamespace(name="prefill_64", ops=[SimpleNamespace(op=f"op{i}", cuda=c) for i, c in enumerate(cuda)])


def test_kernels_match_ops_with_several_launches_and_library_calls():
    names = ["rmsnorm", CUTLASS_KERNEL, CUTLASS_KERNEL, "qk_norm_rope_cache_hd128", "attn_prefill_hd128",
             "attn_decode_tc_s2_hd128", "memset_like_helper", CUTLASS_KERNEL, "add_rmsnorm", CUTLASS_KERNEL,
             CUTLASS_KERNEL, "sample_rows"]
    kernels = [nsight.KernelMetrics(i, n) for i, n in enumerate(names)]
    got = [(m[1], m[3]) for m in nsight.match_kernels(kernels, hand_bucket())]
    assert got == [(0, True), (1, True), (1, False), (2, True), (3, True), (3, False), (None, False), (4, True),
                   (5, True), (6, True), (8, True), (9, True)]
    filtered = nsight.match_kernels(kernels[4:6], hand_bucket(), "attn_decode")     # --kernel attn_decode
    assert [(m[1], m[3]) for m in filtered] == [(None, False), (3, True)]


def test_kernel_base_name():
    assert nsight.kernel_base_name("rmsnorm") == "rmsnorm"
    assert nsight.kernel_base_name("void f<int>(T1::Params)") == "f<int>"
    assert not nsight.launch_matches(hand_bucket().ops[0].cuda.launch[0], "add_rmsnorm")


def test_profile_nsys_with_a_fake_nsys(gpu_plan, tmp_path):  # noqa: F811
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "nsys", "exit 0")
    r = run_cli("profile", gpu_plan.dir, "--nsys", "--bucket", "decode_2", "--out", tmp_path / "rep",
                path=f"{bin_dir}:{os.environ['PATH']}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"nsys report: {tmp_path / 'rep'}.nsys-rep"
    args = (bin_dir / "nsys.args").read_text().split("\n")[:-1]
    assert args == nsight.nsys_command(gpu_plan.dir, "decode_2", 128, tmp_path / "rep")[1:]
    fake_tool(bin_dir, "nsys", "exit 3")
    bad = run_cli("profile", gpu_plan.dir, "--nsys", path=f"{bin_dir}:{os.environ['PATH']}")
    assert_one_line_error(bad, "nsys exited with status 3")
    assert_one_line_error(run_cli("profile", gpu_plan.dir, "--nsys", "--bucket", "decode_9",
                                  path=f"{bin_dir}:{os.environ['PATH']}"), "no bucket 'decode_9'")


def test_profile_ncu_with_a_fake_ncu(gpu_plan, tmp_path):  # noqa: F811
    bin_dir = tmp_path / "bin"
    # the fake writes the sample where --log-file points, as ncu does
    fake_tool(bin_dir, "ncu", f'while [ "$1" != "--log-file" ]; do shift; done; cp {SAMPLE} "$2"')
    r = run_cli("profile", gpu_plan.dir, "--ncu", "--kernel", "gemv", path=f"{bin_dir}:{os.environ['PATH']}")
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines()[2:]]
    assert [int(x[0]) for x in rows] == [i for i, op in enumerate(gpu_plan.buckets[0].ops)
                                         if op.cuda.launch and op.cuda.kernel.startswith("gemv")][:4]
    from xserv_aot.plan.roofline import op_bytes
    op = gpu_plan.buckets[0].ops[int(rows[2][0])]
    assert float(rows[2][7]) == pytest.approx(op_bytes(op, gpu_plan, 128, 1) / 1e6, abs=0.01)
    assert float(rows[2][3]) == pytest.approx((786432 + 1536) / 3744e-9 / 1e9, abs=1)      # DRAM GB/s
    assert [float(x) for x in rows[2][4:7]] == pytest.approx([21.07, 14.56, 55.90], abs=0.051)
    args = (bin_dir / "ncu.args").read_text().split("\n")[:-1]
    assert args[args.index("--kernel-name") + 1] == "regex:gemv" and args[-1] == "--one-step"


def test_nvtx_off_is_a_shared_no_op():
    off = nvtx.ranges(False)
    assert off is nvtx.OFF and not off.enabled and off.range("a") is off.range("b")
    off.push("x")
    off.pop()


def test_nvtx_on_loads_an_implementation():
    try:
        on = nvtx.ranges(True)
    except RuntimeError as e:
        assert "nvidia-nvtx" in str(e)
        pytest.skip("no NVTX implementation installed here")
    assert on.enabled
    with on.range("xserv-test"):
        pass


class Recorder:
    enabled = True

    def __init__(self):
        self.events: list[str] = []

    def push(self, name):
        self.events.append("+" + name)

    def pop(self):
        self.events.append("-")

    def range(self, name):
        return nvtx.NvtxRanges(self.push, self.pop).range(name)


def test_engine_step_ranges():
    from tests.fake_runner import FakeRunner
    from xserv_aot.config import BuildConfig
    from xserv_aot.engine.api import SamplingParams
    from xserv_aot.engine.llm_engine import LLMEngine

    build = BuildConfig(max_num_seqs=2, decode_buckets=[1, 2], prefill_buckets=[8], max_seq_len=32, block_size=4,
                        num_blocks=16)
    engine = LLMEngine(FakeRunner(build))
    assert engine.nvtx is nvtx.OFF
    engine.nvtx = rec = Recorder()
    engine.generate([[3, 4, 5]], SamplingParams(max_tokens=2, temperature=0.0))
    assert rec.events == ["+schedule", "-", "+run", "-", "+postprocess", "-"] * 2

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
from xserv_aot.runtime import ncu_report, nsight, nvtx

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
    cmd = nsight.ncu_command(Path("p"), "decode_64", 1024, Path("r/d64.ncu-rep"), layers=3, kernel="gemv")
    assert cmd[0] == "ncu"
    one_pass = {"gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum"}
    assert set(cmd[cmd.index("--metrics") + 1].split(",")) == one_pass
    full = nsight.ncu_command(Path("p"), "decode_64", 1024, Path("r"), all_metrics=True)
    assert set(full[full.index("--metrics") + 1].split(",")) == one_pass | {
        "dram__throughput.avg.pct_of_peak_sustained_elapsed", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__warps_active.avg.pct_of_peak_sustained_active"}
    child = cmd.index(sys.executable)
    for flag, value in (("--clock-control", "none"), ("--cache-control", "all"), ("--profile-from-start", "off"),
                        ("--export", "r/d64.ncu-rep"), ("--kernel-name", "regex:gemv")):
        assert cmd[cmd.index(flag) + 1] == value and cmd.index(flag) < child
    assert "--nvtx" in cmd[:child] and "--force-overwrite" in cmd[:child]
    assert cmd[child:] == [sys.executable, "-m", "xserv_aot.cli", "profile", "p", "--bucket", "decode_64",
                           "--context", "1024", "--nvtx", "--one-step", "--layers", "3"]
    assert nsight.events_command(Path("p"), "decode_64", 1024, Path("/tmp/ev.json"), 3) == cmd[child:] + [
        "--events-out", "/tmp/ev.json"]                                       # the same step, not under ncu
    plain = nsight.ncu_command(Path("p"), "decode_1", 128, Path("x.ncu-rep"))
    assert "--kernel-name" not in plain and plain[plain.index("--layers") + 1] == str(ncu_report.DEFAULT_LAYERS)


def test_ncu_import_commands():
    assert nsight.ncu_import_command(Path("r/a.ncu-rep")) == [
        "ncu", "--import", "r/a.ncu-rep", "--csv", "--page", "details", "--print-units", "base",
        "--print-metric-name", "name"]
    assert nsight.ncu_import_command(Path("a.ncu-rep"), nvtx_names=True)[-2:] == ["--print-nvtx-rename", "kernel"]
    assert nsight.report_path(Path("o/d1")) == Path("o/d1.ncu-rep")
    assert nsight.report_path(Path("o/d1.ncu-rep")) == Path("o/d1.ncu-rep")


def test_profiled_ops_are_the_first_layers_and_the_ops_outside(gpu_plan):  # noqa: F811
    bk = gpu_plan.buckets[0]
    weights = [str(getattr(op, "weight", "")) for op in bk.ops]
    layer1, head = weights.index("layers.1.input_norm"), weights.index("final_norm")    # first ops of L1, head
    launching = {i for i, op in enumerate(bk.ops) if op.cuda.launch}
    assert layer1 > 3 and head > layer1 and gpu_plan.model.num_layers == 2
    assert ncu_report.profiled_ops(bk, 1) == {i for i in launching if i < layer1 or i >= head}
    assert ncu_report.profiled_ops(bk, 0) == ncu_report.profiled_ops(bk, 2) == launching
    assert not any(bk.ops[i].op == "silu_mul" for i in launching)                # fused: launches nothing


@pytest.mark.parametrize("flag, tool", [("--nsys", "nsys"), ("--ncu", "ncu")])
def test_missing_tool_is_one_line(tmp_path, flag, tool):
    r = run_cli("profile", tmp_path, flag, path=str(tmp_path))         # an empty PATH directory
    assert_one_line_error(r, f"{tool} is not on PATH")


def test_parse_ncu_csv_sample():
    ks = ncu_report.parse_ncu_csv(SAMPLE.read_text())
    assert [(k.id, k.name) for k in ks] == [(0, "gemv_m1_bf16"), (1, "gemv_m1_bf16"), (2, "gemv_gate_m1"),
                                            (3, "gemv_m1_bf16")]
    k = ks[2].metrics
    assert k[ncu_report.TIME] == pytest.approx(3744e-9) and k[ncu_report.DRAM_READ] == 786432
    assert k[ncu_report.DRAM_WRITE] == 1536 and k[ncu_report.OCCUPANCY] == pytest.approx(55.90)
    assert ks[2].dram_gb_per_s == pytest.approx((786432 + 1536) / 3744e-9 / 1e9)
    with pytest.raises(ValueError, match="no header"):
        ncu_report.parse_ncu_csv("==PROF== No kernels were profiled.\n")
    with pytest.raises(ValueError, match="unknown unit"):
        ncu_report.parse_ncu_csv(SAMPLE.read_text().replace('"nsecond"', '"fortnight"'))
    # a row of another section (a label, a unit not in UNITS) and an "n/a" value are left out
    other = SAMPLE.read_text().replace('"gpu__time_duration.sum","nsecond","2,880"',
                                       '"Duration","cycle/usecond","2,880"')
    other = other.replace('"sm__throughput.avg.pct_of_peak_sustained_elapsed","%","9.05"',
                          '"sm__throughput.avg.pct_of_peak_sustained_elapsed","%","n/a"')
    first = ncu_report.parse_ncu_csv(other)[0].metrics
    assert ncu_report.TIME not in first and ncu_report.SM_PCT not in first and first[ncu_report.DRAM_READ] == 393216


def test_kernels_match_plan_ops_in_order(gpu_plan):  # noqa: F811
    bk = gpu_plan.buckets[0]
    matched = ncu_report.match_kernels(ncu_report.parse_ncu_csv(SAMPLE.read_text()), bk, "gemv")
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
    kernels = [ncu_report.KernelMetrics(i, n) for i, n in enumerate(names)]
    got = [(m[1], m[3]) for m in ncu_report.match_kernels(kernels, hand_bucket())]
    assert got == [(0, True), (1, True), (1, False), (2, True), (3, True), (3, False), (None, False), (4, True),
                   (5, True), (6, True), (8, True), (9, True)]
    filtered = ncu_report.match_kernels(kernels[4:6], hand_bucket(), "attn_decode")     # --kernel attn_decode
    assert [(m[1], m[3]) for m in filtered] == [(None, False), (3, True)]


def test_kernel_base_name():
    assert ncu_report.kernel_base_name("rmsnorm") == "rmsnorm"
    assert ncu_report.kernel_base_name("void f<int>(T1::Params)") == "f<int>"
    assert not ncu_report.launch_matches(hand_bucket().ops[0].cuda.launch[0], "add_rmsnorm")


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




def gemv_ops(plan) -> list[int]:
    return [i for i, op in enumerate(plan.buckets[0].ops) if op.cuda.launch and op.cuda.kernel.startswith("gemv")][:4]


def renamed_sample(plan) -> str:
    """SAMPLE as `--print-nvtx-rename kernel` prints it: each kernel named by its op's NVTX range."""
    import csv
    import io
    from xserv_aot.plan.roofline import op_name
    lines = SAMPLE.read_text().splitlines()
    rows = list(csv.DictReader(io.StringIO("\n".join(ln for ln in lines if ln.startswith('"')))))
    names = {str(n): op_name("decode_1", i, plan.buckets[0].ops[i]) for n, i in enumerate(gemv_ops(plan))}
    out = io.StringIO()
    w = csv.DictWriter(out, rows[0].keys(), quoting=csv.QUOTE_ALL)
    w.writeheader()
    w.writerows([{**r, "Kernel Name": names[r["ID"]]} for r in rows])
    return out.getvalue()


def fake_ncu(bin_dir: Path, plan) -> None:
    """Collection: an empty report at --export (event times come from a run outside ncu, nsight.events_command);
    --import: SAMPLE, or the renamed sample with --print-nvtx-rename; every call's arguments appended to ncu.args."""
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "renamed.csv").write_text(renamed_sample(plan))
    p = bin_dir / "ncu"
    p.write_text(f"""#!/bin/sh
printf '%s\\n' "$@" -- >> {bin_dir}/ncu.args
case " $* " in
  *" --version "*) echo "Version 2099.1 (fake)" ;;
  *" --print-nvtx-rename kernel "*) cat {bin_dir}/renamed.csv ;;
  *" --import "*) cat {SAMPLE} ;;
  *) while [ $# -gt 0 ]; do case "$1" in --export) rep=$2;; esac; shift; done
     : > "$rep" ;;
esac
""")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


def ncu_calls(bin_dir: Path) -> list[list[str]]:
    text = (bin_dir / "ncu.args").read_text().split("\n")[:-1]
    calls, cur = [], []
    for a in text:
        if a == "--":
            calls.append(cur)
            cur = []
        else:
            cur.append(a)
    return calls


def test_profile_ncu_with_a_fake_ncu(gpu_plan, tmp_path):  # noqa: F811
    from xserv_aot.plan.roofline import op_bytes, op_name
    bin_dir, ops = tmp_path / "bin", gemv_ops(gpu_plan)
    fake_ncu(bin_dir, gpu_plan)
    r = run_cli("profile", gpu_plan.dir, "--ncu", "--kernel", "gemv", "--out", tmp_path / "rep" / "d1",
                path=f"{bin_dir}:{os.environ['PATH']}")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    rows = [ln.split() for ln in out[2:6]]
    assert [int(x[0]) for x in rows] == ops
    op = gpu_plan.buckets[0].ops[ops[2]]
    nbytes = op_bytes(op, gpu_plan, 128, 1)
    assert float(rows[2][7]) == pytest.approx(nbytes / 1e6, abs=0.01)
    dram_gbs = (786432 + 1536) / 3744e-9 / 1e9
    assert float(rows[2][3]) == pytest.approx(dram_gbs, abs=1)                         # DRAM GB/s
    assert [float(x) for x in rows[2][4:7]] == pytest.approx([21.07, 14.56, 55.90], abs=0.051)
    assert "no event times (the event-timed run wrote none)" in r.stdout   # its child needs a GPU: none here
    assert " ".join(rows[2][12:]) == op_name("decode_1", ops[2], op)                     # the op's NVTX range
    assert "nvtx: 4 of 4 profiled kernels carry their op's NVTX range" in out
    assert any(ln.startswith("agreement: 0 of 0 ops of >= 4 MB") for ln in out)         # a tiny model's ops
    assert out[-1] == f"ncu report: {tmp_path / 'rep' / 'd1.ncu-rep'}"
    collect, plain, renamed = ncu_calls(bin_dir)
    assert collect == nsight.ncu_command(gpu_plan.dir, "decode_1", 128, tmp_path / "rep" / "d1.ncu-rep", 2,
                                         "gemv")[1:]
    assert plain == nsight.ncu_import_command(tmp_path / "rep" / "d1.ncu-rep")[1:]
    assert renamed == nsight.ncu_import_command(tmp_path / "rep" / "d1.ncu-rep", nvtx_names=True)[1:]


def test_profile_ncu_without_events_or_ranges(gpu_plan, tmp_path):  # noqa: F811
    bin_dir = tmp_path / "bin"
    fake_ncu(bin_dir, gpu_plan)
    (bin_dir / "renamed.csv").write_text("==PROF== no NVTX\n")
    r = run_cli("profile", gpu_plan.dir, "--ncu", "--layers", "1", "--all-metrics",
                path=f"{bin_dir}:{os.environ['PATH']}")
    assert r.returncode == 0, r.stderr
    assert "no event times (the event-timed run wrote none)" in r.stdout
    assert "nvtx: ncu gave no NVTX range names" in r.stdout and "ncu report" not in r.stdout
    collect = ncu_calls(bin_dir)[0]
    assert collect[-2:] == ["--layers", "1"] and ncu_report.SM_PCT in collect[collect.index("--metrics") + 1]
    assert_one_line_error(run_cli("profile", gpu_plan.dir, "--ncu", "--layers", "-1",
                                  path=f"{bin_dir}:{os.environ['PATH']}"), "--layers must be >= 0")
    fake_tool(bin_dir, "ncu", "exit 3")
    assert_one_line_error(run_cli("profile", gpu_plan.dir, "--ncu", path=f"{bin_dir}:{os.environ['PATH']}"),
                          "ncu exited with status 3")


def test_ncu_check_script(gpu_plan, tmp_path):  # noqa: F811
    import subprocess
    bin_dir = tmp_path / "bin"
    fake_ncu(bin_dir, gpu_plan)
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    script = Path(__file__).parents[1] / "scripts" / "ncu_check.sh"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    r = subprocess.run(["bash", str(script), str(gpu_plan.dir), str(tmp_path / "out"), "--kernel", "gemv"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1                                   # the tiny plan has no decode_64
    lines = r.stdout.splitlines()
    assert lines[0] == "Version 2099.1 (fake)"
    assert lines[1].startswith("decode_1 (decode_1 context 128 --kernel gemv): exit 0 in ")
    assert lines[2].startswith("  agreement: 0 of 0 ops") and lines[3].startswith("  nvtx: 4 of 4 profiled")
    assert lines[4].startswith("decode_64 (decode_64 context 1024 --kernel gemv): exit 1 in ")
    assert "no bucket 'decode_64'" in lines[5]
    assert lines[6].startswith("decode_1_all_metrics (decode_1 context 128 --all-metrics --layers 1 --kernel gemv): "
                               "exit 0 in ")
    assert (tmp_path / "out" / "decode_1.ncu-rep").is_file()
    assert (tmp_path / "out" / "decode_1_all_metrics.txt").is_file()
    assert (tmp_path / "out" / "summary.txt").read_text() == r.stdout
    collect = ncu_calls(bin_dir)[1]
    assert collect[collect.index("--kernel-name") + 1] == "regex:gemv"


def test_agreement_counts_ops_within_the_tolerance(gpu_plan, monkeypatch):  # noqa: F811
    assert ncu_report.agreement([0.95, 1.09, 1.2, 0.85, 1.0]).startswith(
        "agreement: 3 of 5 ops of >= 4 MB of plan bytes have ncu DRAM GB/s within 10% of the event-timed GB/s")
    assert "(ncu/event 0.85 - 1.20)" in ncu_report.agreement([0.95, 1.2, 0.85])
    # the table counts the ops above AGREE_MIN_BYTES only: lowered below the tiny model's weights, all four count
    from xserv_aot.plan.roofline import op_bytes
    ops, bk = gemv_ops(gpu_plan), gpu_plan.buckets[0]
    kernels = ncu_report.parse_ncu_csv(SAMPLE.read_text())
    dram = [k.dram_bytes / k.metrics[ncu_report.TIME] for k in kernels]
    # event times giving ratios 1.0, 1.09, 0.8 and 1.3
    want = [1.0, 1.09, 0.8, 1.3]
    ms = [op_bytes(bk.ops[i], gpu_plan, 128, 1) * w / d * 1e3 for i, d, w in zip(ops, dram, want)]
    events = {"timing": "eager", "ops": {str(i): m for i, m in zip(ops, ms)}}
    monkeypatch.setattr(ncu_report, "AGREE_MIN_BYTES", 1e5)
    table = ncu_report.format_ncu(gpu_plan, bk, 128, kernels, "gemv", 0, events, {})
    assert "agreement: 2 of 4 ops" in table and "(ncu/event 0.80 - 1.30)" in table
    assert "events: events between eager launches" in table


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


H200_DECODE64 = Path(__file__).parent / "data" / "ncu_h200_decode64.csv"       # ncu 2025.3.1, main 8be0667
H200_DECODE1_NVTX = Path(__file__).parent / "data" / "ncu_h200_decode1_nvtx.csv"  # the same, --print-nvtx-rename


@pytest.fixture(scope="module")
def q8_plan(tmp_path_factory):
    """Qwen3-8B with plans/h200.build.json (dummy weights: nothing written but the plan): the plan those CSVs were
    taken from on the H200 (kernels 0-10 and 326-330 of decode_64 at context 1024, the ones --layers 1 profiles;
    0-11 of decode_1)."""
    pytest.importorskip("cuda.core")
    import json
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan
    root = Path(__file__).parents[1] / "plans"
    build = BuildConfig.from_dict({**json.loads((root / "h200.build.json").read_text()),
                                   "gemv": "cuda_cores"})                  # the GEMVs of 8be0667 (before gemv_tc.cu)
    return compile_plan(root / "qwen3-8b.config.json", tmp_path_factory.mktemp("q8") / "plan", build,
                        dummy_weights=True)


def launching(bk) -> list[int]:
    return [i for i, op in enumerate(bk.ops) if op.cuda.launch]


def test_h200_csv_matches_the_8b_plan(q8_plan):
    bk = next(b for b in q8_plan.buckets if b.name == "decode_64")
    assert sum(len(op.cuda.launch) for op in bk.ops) == len(launching(bk)) == 331      # what ncu profiled: 0-330
    kernels = ncu_report.parse_ncu_csv(H200_DECODE64.read_text())
    assert [k.id for k in kernels] == [*range(11), *range(326, 331)]
    matched = ncu_report.match_kernels(kernels, bk, ops=ncu_report.profiled_ops(bk, 1))
    assert [m[1] for m in matched] == [launching(bk)[k.id] for k in kernels] and all(m[3] for m in matched)
    qkv = kernels[3]
    assert bk.ops[matched[3][1]].weight == "layers.0.qkv" and qkv.name.startswith("void cutlass::device_kernel<")
    assert set(qkv.metrics) == {ncu_report.TIME, ncu_report.DRAM_READ}                 # what that run asked for
    assert qkv.metrics[ncu_report.TIME] == pytest.approx(21.95e-6, abs=0.01e-6)         # "ns" in base units
    table = ncu_report.format_ncu(q8_plan, bk, 1024, kernels, layers=1)
    row = next(ln.split() for ln in table.splitlines() if ln.startswith("   3 "))
    assert row[-9:-5] == ["-", "-", "-", f"{op_bytes_mb(q8_plan, bk, 3):.2f}"]          # no DRAM/SM %, occupancy


def op_bytes_mb(plan, bk, i) -> float:
    from xserv_aot.plan.roofline import op_bytes
    return op_bytes(bk.ops[i], plan, 1024, bk.num_seqs) / 1e6


def test_h200_nvtx_names_are_the_ops_ranges(q8_plan):
    from xserv_aot.plan.roofline import op_name
    bk = next(b for b in q8_plan.buckets if b.name == "decode_1")
    names = ncu_report.parse_kernel_names(H200_DECODE1_NVTX.read_text())
    assert sorted(names) == list(range(12))
    # the fixture is decode_1 of main at 8be0667; since then its qk_norm_rope_cache (kernel 4) runs inside the
    # attention kernel, so only kernels 0-3 (resolve_input_ids, embedding, rmsnorm, qkv) are today's launches
    names = {n: name for n, name in names.items() if n < 4}
    for n, name in names.items():
        i = launching(bk)[n]
        assert ncu_report.range_name(name, bk.ops[i].cuda.launch[0].fn) == op_name("decode_1", i, bk.ops[i])
    assert ncu_report.range_name("rmsnorm", "rmsnorm") == "-"
    # a kernel renamed with a differently spelled kernel part still counts as carrying its op's range
    kernels = [ncu_report.KernelMetrics(n, bk.ops[launching(bk)[n]].cuda.launch[0].fn) for n in range(4)]
    odd = {n: name.rsplit("/", 1)[0] + "/other_spelling(int)" for n, name in names.items()}
    table = ncu_report.format_ncu(q8_plan, bk, 128, kernels, nvtx_names=odd)
    assert "nvtx: 4 of 4 profiled kernels carry their op's NVTX range" in table


def test_profiled_ops_of_the_8b_plan(q8_plan):
    bk = next(b for b in q8_plan.buckets if b.name == "decode_64")
    ops = ncu_report.profiled_ops(bk, 2)
    silu = [i for i, op in enumerate(bk.ops) if op.op == "silu_mul"]              # unfused at 64 rows, no layer field
    assert silu[:3] == [9, 18, 27] and {9, 18} <= ops and 27 not in ops
    assert ops == set(range(20)) | set(range(326, 331)) and len(bk.ops) == 331

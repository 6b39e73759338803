"""libxserv_gemm.so on the GPU: bf16 TN GEMMs vs a float64 reference, CUDA-graph replay, timings vs cuBLAS.

The library comes from --gemm-lib, else build/cutlass/kernels/libxserv_gemm.so (written by
cutlass_build.build_gemm_library(Path("build/cutlass"))), else it is built here.
Timings: --gemm-bench-out file.json writes the table; --gemm-sweep adds an M sweep per config.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

from xserv_aot.plan import cutlass_build as cb  # noqa: E402
from xserv_aot.runtime.cuda.cutlass_gemm import CutlassGemm, CutlassGemmError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Qwen3-8B linears: (name, N, K)
SHAPES = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
MS = [1, 7, 48, 128, 256, 300, 2048]
PAD_ROWS = 5


@pytest.fixture(scope="module")
def gemm(tmp_path_factory, pytestconfig) -> CutlassGemm:
    given = pytestconfig.getoption("--gemm-lib")
    path = Path(given) if given else ROOT / "build" / "cutlass" / "kernels" / cb.LIBRARY_NAME
    if not path.is_file():
        try:
            out = tmp_path_factory.mktemp("gemm")
            path = out / cb.build_gemm_library(out)["file"]
        except cb.GemmBuildError as e:
            pytest.skip(str(e))
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        pytest.skip(f"needs sm_90 (got sm_{major}{minor})")
    return CutlassGemm(path)


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


_WS: dict = {}


def _run(g: CutlassGemm, cfg: int, a, b, c, bias, m: int, splits: int = 0) -> None:
    """Every config through the workspace entry point (swap-AB configs need one; the tile configs take none)."""
    n, k = b.shape
    need = g.workspace_size_ex(cfg, m, n, k, splits)
    if _WS.get("ws") is None or _WS["ws"].numel() < need:
        _WS["ws"] = torch.empty(max(need, 1 << 20), dtype=torch.uint8, device="cuda")
    ws = _WS["ws"]
    g.gemm_ex(cfg, a.data_ptr(), b.data_ptr(), c.data_ptr(), bias.data_ptr() if bias is not None else 0,
              m, n, k, splits, ws.data_ptr(), ws.numel(), _stream())


def _operands(m_max: int, n: int, k: int, gen):
    a = torch.randn(m_max, k, generator=gen, device="cuda").to(torch.bfloat16)
    b = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)
    return a, b, bias


def _check(out, ref) -> None:
    out = out.double()
    assert torch.isfinite(out).all()
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    fro = ((out - ref).norm() / ref.norm()).item()
    assert err <= 1e-2 and fro <= 1e-2, (err, fro)


def _splits(cfg: int) -> tuple[int, ...]:
    """Scheduler modes a config takes: stream-K / data-parallel / split-K 4 for the swap-AB and stream-K tiles."""
    return (0, 1, 4) if "streamk" in cb.GEMM_CONFIGS[cfg] else (0,)


RESIDUAL = frozenset(cb.RESIDUAL_TWIN.values())


@pytest.mark.parametrize("name,n,k", SHAPES)
def test_matches_float64_reference(gemm, name, n, k, seed):
    """Every config; the residual configs' C starts as a random residual (their epilogue adds it in place)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a, b, bias = _operands(max(MS), n, k, gen)
    for m in MS:
        ref = a[:m].double() @ b.double().T
        for cfg in range(len(gemm.configs)):
            swap = "swap" in gemm.configs[cfg]
            if swap and m > 256:
                continue
            dtype = torch.float32 if gemm.out_bytes(cfg) == 4 else torch.bfloat16
            for splits in _splits(cfg):
                use_bias = (cfg + m + splits) % 2 == 0
                c = torch.full((m + PAD_ROWS, n), float("nan"), dtype=dtype, device="cuda")
                want = ref + bias.double() if use_bias else ref
                if cfg in RESIDUAL:
                    c[:m] = torch.randn(m, n, generator=gen, device="cuda").to(dtype)
                    want = want + c[:m].double()
                _run(gemm, cfg, a, b, c, bias if use_bias else None, m, splits)
                torch.cuda.synchronize()
                _check(c[:m], want)
                assert torch.isnan(c[m:]).all(), f"{gemm.configs[cfg]} splits {splits} wrote past row {m}"


@pytest.mark.parametrize("m", [128, 300, 2048])
def test_residual_epilogue_rounds_like_the_unfused_add(gemm, m, seed):
    """D = bf16(bf16(A B^T + bias) + D) bit for bit: the twin's output equals its plain config's output rounded,
    then added to the residual in float32 and rounded (add_rmsnorm's residual update), on o_proj / down shapes."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for n, k in ((4096, 4096), (4096, 12288)):
        a, b, bias = _operands(m, n, k, gen)
        residual = torch.randn(m, n, generator=gen, device="cuda").to(torch.bfloat16)
        for plain, twin in cb.RESIDUAL_TWIN.items():
            for use_bias in (False, True):
                c = torch.full((m + PAD_ROWS, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                _run(gemm, plain, a, b, c, bias if use_bias else None, m)
                d = torch.full((m + PAD_ROWS, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                d[:m] = residual
                _run(gemm, twin, a, b, d, bias if use_bias else None, m)
                torch.cuda.synchronize()
                want = (c[:m].float() + residual.float()).to(torch.bfloat16)
                diff = (d[:m].float() - want.float()).abs().max().item()
                assert torch.equal(d[:m], want), (gemm.configs[twin], m, n, k, use_bias, diff)
                assert torch.isnan(d[m:]).all(), f"{gemm.configs[twin]} wrote past row {m}"


def test_rejects_misaligned_and_bad_shapes(gemm):
    a = torch.zeros(64, 72, dtype=torch.bfloat16, device="cuda")
    b = torch.zeros(64, 72, dtype=torch.bfloat16, device="cuda")
    c = torch.zeros(64, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(CutlassGemmError, match="misaligned"):
        gemm.gemm(0, a.data_ptr() + 2, b.data_ptr(), c.data_ptr(), 0, 8, 64, 64, _stream())
    with pytest.raises(CutlassGemmError, match="misaligned"):
        gemm.gemm(0, a.data_ptr(), b.data_ptr(), c.data_ptr(), 0, 8, 64, 68, _stream())


def test_cuda_graph_replay_equals_eager(gemm, seed):
    n, k, m = 6144, 4096, 200
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a, b, bias = _operands(m, n, k, gen)
    for cfg in range(len(gemm.configs)):
        dtype = torch.float32 if gemm.out_bytes(cfg) == 4 else torch.bfloat16
        c_graph = torch.zeros(m, n, dtype=dtype, device="cuda")
        c_eager = torch.zeros(m, n, dtype=dtype, device="cuda")
        _run(gemm, cfg, a, b, c_graph, bias, m)  # warm up eagerly: loads the module outside capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            _run(gemm, cfg, a, b, c_graph, bias, m)
        a.copy_(torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16))
        c_graph.fill_(0.0 if cfg in RESIDUAL else float("nan"))   # residual configs read C: start from 0
        g.replay()
        _run(gemm, cfg, a, b, c_eager, bias, m)
        torch.cuda.synchronize()
        assert torch.equal(c_graph, c_eager), gemm.configs[cfg]
        _check(c_graph, a.double() @ b.double().T + bias.double())


def _time_ms(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _bench(gemm, n: int, k: int, m: int, configs) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k * 7 + m)
    a = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    b = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    flop = 2.0 * m * n * k
    row = {"torch": flop / _time_ms(lambda: torch.matmul(a, b.T, out=c)) / 1e9}
    for cfg in configs:
        row[gemm.configs[cfg]] = flop / _time_ms(lambda: _run(gemm, cfg, a, b, c, None, m)) / 1e9
    row["chosen"] = gemm.configs[cb.choose_gemm_config(m, n, k)]
    return row


def test_timing_table(gemm, pytestconfig):
    bf16_cfgs = [i for i in range(len(gemm.configs)) if gemm.out_bytes(i) == 2]
    ms = [2048]
    if pytestconfig.getoption("--gemm-sweep"):
        ms = [16, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    table = {f"{name} N={n} K={k} M={m}": _bench(gemm, n, k, m, bf16_cfgs) for name, n, k in SHAPES for m in ms}
    table["logits N=151936 K=4096 M=2048 f32out"] = _bench_f32(gemm, 151936, 4096, 2048)
    table["host overhead"] = {"us_per_call": _host_us_per_call(gemm)}
    print()
    for key, row in table.items():
        print(f"{key:36s} " + "  ".join(f"{n}={v:.0f}" if isinstance(v, float) else f"{n}={v}" for n, v in row.items()))
    if pytestconfig.getoption("--gemm-bench-out"):
        Path(pytestconfig.getoption("--gemm-bench-out")).write_text(json.dumps(table, indent=1))
    # a printed table for docs/cutlass-notes.md, no speed assertion (timings vary with load and clocks); what this
    # checks is that every config runs at every benchmark shape


def _host_us_per_call(gemm, calls: int = 200) -> float:
    """CPU time of one eager launch (ctypes + CUTLASS argument setup); graph replay does not pay it."""
    a, b, c = (torch.zeros(16, 4096, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    _run(gemm, 0, a, b, c, None, 16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        _run(gemm, 0, a, b, c, None, 16)
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e6


def _bench_f32(gemm, n: int, k: int, m: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k * 7 + m)
    a = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    b = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
    c = torch.empty(m, n, dtype=torch.float32, device="cuda")
    cfg = cb.choose_gemm_config(m, n, k, out_dtype="float32")
    flop = 2.0 * m * n * k
    return {"torch_bf16out": flop / _time_ms(lambda: torch.matmul(a, b.T)) / 1e9,
            gemm.configs[cfg]: flop / _time_ms(lambda: _run(gemm, cfg, a, b, c, None, m)) / 1e9}

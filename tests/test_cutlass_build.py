"""Builds libxserv_gemm.so with nvcc on this (GPU-less) machine and checks its ABI and the build cache."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from xserv_aot.plan import cutlass_build as cb
from xserv_aot.runtime.cuda.cutlass_gemm import CutlassGemm, CutlassGemmError

EXPORTS = ("xserv_gemm_bf16", "xserv_gemm_num_configs", "xserv_gemm_config_name", "xserv_gemm_config_out_bytes",
           "xserv_gemm_workspace_size", "xserv_gemm_status_string", "xserv_gemm_bf16_ex", "xserv_gemm_workspace_size_ex")
HAS_GPU = Path("/dev/nvidiactl").exists()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict, list[str]]:
    try:
        cb.find_nvcc()
    except cb.GemmBuildError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("plan")
    log: list[str] = []
    info = cb.build_gemm_library(out, progress=log.append)
    return out, info, log


def test_build_writes_library_with_hash_and_configs(built):
    out, info, _ = built
    lib = out / info["file"]
    assert info["file"] == "kernels/libxserv_gemm.so" and lib.is_file()
    assert info["hash"] == "sha256:" + hashlib.sha256(lib.read_bytes()).hexdigest()
    assert info["configs"] == list(cb.GEMM_CONFIGS)


def test_exports_and_no_dynamic_cuda_dependency(built):
    out, info, _ = built
    lib = out / info["file"]
    if shutil.which("nm"):
        syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
        for name in EXPORTS:
            assert f" T {name}\n" in syms, name
    if shutil.which("readelf"):
        needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
        assert "libcudart" not in needed and "libcuda.so" not in needed


def test_config_table_through_ctypes(built):
    out, info, _ = built
    g = CutlassGemm(out / info["file"])
    assert g.configs == list(cb.GEMM_CONFIGS)
    for i, name in enumerate(g.configs):
        assert g.out_bytes(i) == (4 if "f32out" in name else 2)
        for m, n, k in ((1, 4096, 4096), (2048, 24576, 4096), (300, 4096, 12288)):
            if "streamk" not in name:
                assert g.workspace_size(i, m, n, k) == 0                 # persistent data-parallel tiles: no scratch
        assert ("streamk" in name) == (i in cb.SPLIT_TILE_CONFIGS or "swap" in name)
        if "streamk" in name:                                            # stream-K / split-K scratch
            assert g.workspace_size_ex(i, 64, 4096, 4096, 1) == 0        # data-parallel
            assert g.workspace_size_ex(i, 64, 4096, 4096, 0) > 0         # stream-K fixup partials + flags
            assert g.workspace_size_ex(i, 64, 4096, 12288, 4) > 0        # split-K 4
    with pytest.raises(CutlassGemmError):
        g.out_bytes(len(g.configs))


def test_host_side_validation_without_gpu(built):
    out, info, _ = built
    g = CutlassGemm(out / info["file"])
    with pytest.raises(CutlassGemmError, match="status 100"):
        g.gemm(len(g.configs), 256, 256, 256, 0, 16, 64, 64)   # one past the table
    with pytest.raises(CutlassGemmError, match="status 1:"):
        g.gemm(0, 256 + 8, 256, 256, 0, 16, 64, 64)           # A not 16-byte aligned
    with pytest.raises(CutlassGemmError, match="status 1:"):
        g.gemm(0, 256, 256, 256, 0, 16, 60, 64)               # N not a multiple of 8
    with pytest.raises(CutlassGemmError, match="status 1:"):
        g.gemm(0, 256, 256, 256, 256 + 2, 16, 64, 64)         # bias misaligned
    with pytest.raises(CutlassGemmError, match="status 4:"):
        g.gemm(0, 0, 256, 256, 0, 16, 64, 64)                 # null A
    g.gemm(0, 256, 256, 256, 0, 0, 64, 64)                    # M == 0 launches nothing
    if not HAS_GPU:
        with pytest.raises(CutlassGemmError, match="status 7:"):
            g.gemm(0, 256, 256, 256, 0, 16, 64, 64)           # no CUDA device


def test_fp8_entry_table_and_host_side_validation(built):
    """xserv_gemm_fp8 (the W8A8 configs): names and output widths, and the checks made before any CUDA call."""
    import ctypes
    out, info, _ = built
    so = ctypes.CDLL(str(out / info["file"]))
    assert cb.library_fp8_config_names(out / info["file"]) == list(cb.FP8_CONFIGS)
    for i, name in enumerate(cb.FP8_CONFIGS):
        assert so.xserv_gemm_fp8_config_out_bytes(i) == (4 if "f32out" in name else 2)
    assert set(cb.FP8_CONFIG.values()) | set(cb.FP8_PINGPONG.values()) | cb.FP8_SPLIT_CONFIGS == \
        set(range(len(cb.FP8_CONFIGS)))
    so.xserv_gemm_fp8.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    call = lambda cfg, a=256, m=16, n=64, k=64, sa=512: so.xserv_gemm_fp8(cfg, a, sa, 256, 512, 256, None, m, n, k,
                                                                          None)
    assert call(len(cb.FP8_CONFIGS)) == 100                   # one past the table
    assert call(0, a=256 + 8) == 1                            # A not 16-byte aligned
    assert call(0, k=72) == 1                                 # K not a multiple of 16
    assert call(0, n=60) == 1                                 # N not a multiple of 8
    assert call(0, sa=0) == 4                                 # no activation scales
    assert call(0, m=0) == 0                                  # M == 0 launches nothing
    if not HAS_GPU:
        assert call(2) == 7                                   # no CUDA device


def test_fp8_workspace_only_for_stream_k_configs(built):
    """Stream-K FP8 configs ask for scratch (partial tiles and their flags) where the tiles are fewer than the SMs,
    and for split-K; the persistent ones never do, so their calls stay xserv_gemm_fp8 without a workspace."""
    out, info, _ = built
    lib = out / info["file"]
    for i, name in enumerate(cb.FP8_CONFIGS):
        sizes = [cb.library_fp8_workspace_size(lib, i, m, 4096, k, splits)
                 for m, k, splits in ((256, 12288, 0), (96, 4096, 0), (256, 4096, 2))]
        assert (i in cb.FP8_SPLIT_CONFIGS) == ("streamk" in name)
        assert all(sizes) if i in cb.FP8_SPLIT_CONFIGS else sizes == [0, 0, 0], name
    assert cb.library_fp8_workspace_size(lib, len(cb.FP8_CONFIGS), 256, 4096, 4096, 0) == 0   # past the table


def test_rebuild_is_a_cache_hit(built, tmp_path):
    _, info, log = built
    log2: list[str] = []
    again = cb.build_gemm_library(tmp_path, progress=log2.append)
    assert again["hash"] == info["hash"] and again["build_key"] == info["build_key"]
    assert any("cached" in m for m in log2)


def test_build_key_tracks_sources_compiler_and_headers(tmp_path):
    inc = tmp_path / "include"
    (inc / "cutlass").mkdir(parents=True)
    (inc / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 4\n")
    src = tmp_path / "gemm_sm90.cu"
    src.write_text("int x;\n")
    k1 = cb.build_key([src], "nvcc 13.0", [inc])
    assert k1 == cb.build_key([src], "nvcc 13.0", [inc])
    assert k1 != cb.build_key([src], "nvcc 13.1", [inc])
    src.write_text("int y;\n")
    k2 = cb.build_key([src], "nvcc 13.0", [inc])
    (inc / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 5\n")
    assert len({k1, k2, cb.build_key([src], "nvcc 13.0", [inc])}) == 3


def test_missing_tools_give_one_line_errors(monkeypatch, tmp_path):
    monkeypatch.setenv("XSERV_NVCC", str(tmp_path / "no-nvcc"))
    with pytest.raises(cb.GemmBuildError, match="XSERV_NVCC") as e:
        cb.build_gemm_library(tmp_path)
    assert "\n" not in str(e.value)
    monkeypatch.delenv("XSERV_NVCC")
    monkeypatch.setattr(cb.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(cb.GemmBuildError, match="CUTLASS headers not found"):
        cb.find_cutlass_includes()
    with pytest.raises(cb.GemmBuildError, match="unsupported target"):
        cb.build_gemm_library(tmp_path, target="sm_80")


@pytest.mark.parametrize("m", [1, 7, 64, 65, 128, 300, 2048, 8192])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)])
def test_choose_gemm_config_is_valid(m, n, k):
    i = cb.choose_gemm_config(m, n, k)
    assert 0 <= i < len(cb.GEMM_CONFIGS) and "f32out" not in cb.GEMM_CONFIGS[i]
    assert "f32out" in cb.GEMM_CONFIGS[cb.choose_gemm_config(m, n, k, out_dtype="float32")]
    if m <= 64:
        assert "_64x" in cb.GEMM_CONFIGS[i]


def test_choose_gemm_config_rejects_bad_shapes():
    for m, n, k in ((0, 64, 64), (4, 60, 64), (4, 64, 60)):
        with pytest.raises(cb.GemmBuildError):
            cb.choose_gemm_config(m, n, k)
    with pytest.raises(cb.GemmBuildError):
        cb.choose_gemm_config(4, 64, 64, out_dtype="float16")


@pytest.mark.parametrize("quant", ["fp8_channel", "fp8_block128"])
def test_fp8_config_follows_the_warpgroup_count(quant):
    """The W8A8 rule on the Qwen3-8B shapes (the H200 sweep of session 9: each cell the fastest config measured)."""
    scheme = quant.removeprefix("fp8_")
    pp, coop = f"sm90_fp8_{scheme}_64x128x128_pingpong", f"sm90_fp8_{scheme}_128x128x128_coop"
    pick = lambda rows, n, k, out="bfloat16": (cb.FP8_CONFIGS[cb.fp8_config(quant, out, rows, n, k)[0]],
                                               cb.fp8_config(quant, out, rows, n, k)[1])
    assert pick(128, 6144, 4096) == (pp, 0)             # qkv: 96 ping-pong tiles, one a SM
    assert pick(256, 6144, 4096) == (coop, 0)           # ... 192 ping-pong tiles, 96 cooperative ones
    assert pick(256, 4096, 4096) == (pp, 0)             # o_proj: 128 ping-pong tiles
    assert pick(128, 24576, 4096) == (pp, 0)            # gate_up, several waves: ping-pong up to 128 rows
    assert pick(192, 24576, 4096) == (coop, 0)          # ... cooperative above
    assert pick(96, 4096, 12288) == (f"sm90_fp8_{scheme}_128x128x128_streamk", cb.FP8_SPLIT_K)   # down: split-K
    assert pick(256, 4096, 12288) == (pp, 0)
    assert pick(2048, 4096, 12288) == (coop, 0)         # prefill rows
    assert pick(256, 4096, 4096, "float32") == (f"sm90_fp8_{scheme}_f32out_128x128x128_coop", 0)   # no f32 variant


def _sleeper(tmp_path: Path, i: int) -> list[str]:
    """A stand-in compiler unit that records its pid (written aside, then renamed: a unit killed mid-write leaves no
    empty pid file), then runs for ten minutes."""
    return ["sh", "-c", f"echo $$ > {tmp_path}/tmp{i} && mv {tmp_path}/tmp{i} {tmp_path}/pid{i}; exec sleep 600",
            f"unit{i}.o"]


def _alive(tmp_path: Path) -> list[int]:
    pids = []
    for f in tmp_path.glob("pid*"):
        pid = int(f.read_text())
        try:
            os.kill(pid, 0)
            pids.append(pid)
        except ProcessLookupError:
            pass
    return pids


def test_a_failed_unit_stops_the_build_at_once(tmp_path):
    """The first compiler error is raised without waiting for the queued and running units, which are killed."""
    units = [_sleeper(tmp_path, 0), ["sh", "-c", "sleep 0.5; echo 'x.cu(3): error: bad' >&2; exit 2", "bad.o"],
             *(_sleeper(tmp_path, i) for i in range(1, 6))]
    t0 = time.monotonic()
    with pytest.raises(cb.GemmBuildError, match=r"nvcc failed \(bad.o\): x.cu\(3\): error: bad"):
        cb.run_compilers(units, jobs=3, progress=lambda m: None)
    assert time.monotonic() - t0 < 120          # the sleepers alone would take 600 s
    assert (tmp_path / "pid0").exists() and _alive(tmp_path) == []


def test_an_interrupted_build_kills_its_compilers(tmp_path):
    """SIGTERM's SystemExit (cli_compile) raised while units run: nothing keeps compiling behind the exit."""
    def progress(msg):
        raise SystemExit(143)
    units = [["true", "fast.o"], *(_sleeper(tmp_path, i) for i in range(4))]
    t0 = time.monotonic()
    with pytest.raises(SystemExit):
        cb.run_compilers(units, jobs=2, progress=progress)
    assert time.monotonic() - t0 < 120 and _alive(tmp_path) == []

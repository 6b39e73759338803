"""Build libxserv_gemm.so (CUTLASS 3 sm90a bf16 GEMMs, kernels/cutlass/) with nvcc, cached by content hash.

The library's C ABI is documented in kernels/cutlass/gemm_sm90.cu and wrapped by
xserv_aot/runtime/cuda/cutlass_gemm.py. Building needs nvcc and the nvidia-cutlass wheel's headers, no GPU.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from xserv_aot.config import cache_root
from xserv_aot.errors import XservError
from xserv_aot.plan.nvrtc_build import KERNEL_DIR

LIBRARY_NAME = "libxserv_gemm.so"
SOURCE_DIR = KERNEL_DIR / "cutlass"
# Index = the library's config argument; must match kernels/cutlass/gemm_sm90_configs.h (checked by the tests).
GEMM_CONFIGS = (
    "sm90_bf16_128x128x64_c2x1_coop",
    "sm90_bf16_128x256x64_c2x1_coop",
    "sm90_bf16_64x128x64_c1x1_pingpong",
    "sm90_f32out_128x128x64_c2x1_coop",
    "sm90_bf16_swap_128x32x128_streamk",
    "sm90_bf16_swap_128x64x128_streamk",
    "sm90_bf16_swap_128x128x64_streamk",
    "sm90_bf16_swap_128x256x64_streamk",
    "sm90_f32out_swap_128x64x128_streamk",
    "sm90_f32out_swap_128x128x64_streamk",
    "sm90_f32out_swap_128x256x64_streamk",
    "sm90_bf16_256x128x64_c2x1_coop",
    "sm90_bf16_128x256x64_c1x2_coop",
    "sm90_bf16_128x128x64_c1x2_pingpong",
    "sm90_bf16_128x256x64_c2x1_streamk",
    "sm90_bf16res_128x256x64_c2x1_coop",
    "sm90_bf16res_256x128x64_c2x1_coop",
)
CFG_128x128, CFG_128x256, CFG_64x128_PINGPONG, CFG_F32OUT = range(4)
CFG_256x128, CFG_128x256_C1x2, CFG_128x128_PINGPONG, CFG_128x256_STREAMK = range(11, 15)
# bf16-output tile configs a build config's gemm_configs table may name (prefill linears, rows >= 128).
TABLE_CONFIGS = {GEMM_CONFIGS[i]: i for i in (CFG_128x128, CFG_128x256, CFG_64x128_PINGPONG, CFG_256x128,
                                              CFG_128x256_C1x2, CFG_128x128_PINGPONG, CFG_128x256_STREAMK)}
SPLIT_TILE_CONFIGS = frozenset({CFG_128x256_STREAMK})   # tile configs called with splits and a workspace
# Tile config -> its twin whose epilogue adds the residual in place (D = bf16(bf16(acc + bias) + D)).
RESIDUAL_TWIN = {CFG_128x256: 15, CFG_256x128: 16}
# The W8A8 configs of xserv_gemm_fp8; must match kernels/cutlass/gemm_sm90_fp8_configs.h.
FP8_CONFIGS = (
    "sm90_fp8_channel_128x128x128_coop",
    "sm90_fp8_channel_f32out_128x128x128_coop",
    "sm90_fp8_block128_128x128x128_coop",
    "sm90_fp8_block128_f32out_128x128x128_coop",
    "sm90_fp8_channel_64x128x128_pingpong",
    "sm90_fp8_block128_64x128x128_pingpong",
    "sm90_fp8_block128_128x128x128_streamk",
    "sm90_fp8_channel_128x128x128_streamk",
)
FP8_CONFIG = {("fp8_channel", "bfloat16"): 0, ("fp8_channel", "float32"): 1, ("fp8_block128", "bfloat16"): 2,
              ("fp8_block128", "float32"): 3}
FP8_PINGPONG = {"fp8_channel": 4, "fp8_block128": 5}    # 64 x 128 tiles, bf16 out
FP8_STREAMK = {"fp8_channel": 7, "fp8_block128": 6}     # 128 x 128 stream-K / split-K tiles, bf16 out
FP8_SPLIT_CONFIGS = frozenset(FP8_STREAMK.values())      # called with splits and a workspace
FP8_SPLIT_K, FP8_SPLIT_K_MIN_K = 3, 8192                 # split-K 3 for K >= 8192 at <= 128 rows (one M tile)
# Swap-AB decode configs: activation rows on the tile's N side (width -> config index), per output dtype.
SWAP_CONFIGS = {"bfloat16": {32: 4, 64: 5, 128: 6, 256: 7}, "float32": {64: 8, 128: 9, 256: 10}}
NUM_SMS_H200 = 132
SUPPORTED_TARGETS = ("sm_90a", "sm_90")  # both build sm_90a machine code: wgmma needs the "a" target

COMPILE_FLAGS = (
    "-gencode=arch=compute_90a,code=sm_90a",
    "-std=c++17",
    "-O3",
    "--expt-relaxed-constexpr",
    "-Xcompiler", "-fPIC",
    "-DNDEBUG",
)
LINK_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a", "-shared", "-cudart", "static", "-Xcompiler", "-fPIC")


def fp8_config(quant: str, out_dtype: str, rows: int, n: int, k: int) -> tuple[int, int]:
    """(config, splits) of a W8A8 linear, from the H200 sweep at 96 - 256 rows (docs/cuda-notes.md, session 9): a
    consumer warpgroup runs about one 128-k step per 0.4 us whatever the tile, so what counts is how many
    warpgroups work and how many padded rows they multiply. 64 x 128 ping-pong tiles where one of them per SM
    covers the output; else 128 x 128 cooperative tiles where those do (qkv at 192 - 256 rows); else (several
    waves) ping-pong up to 128 rows, cooperative above. Long K (down_proj) at <= 128 rows: split-K 3."""
    sms = NUM_SMS_H200
    if out_dtype != "bfloat16":
        return FP8_CONFIG[(quant, out_dtype)], 0
    if rows <= 128 and k >= FP8_SPLIT_K_MIN_K:
        return FP8_STREAMK[quant], FP8_SPLIT_K
    pingpong_tiles, coop_tiles = -(-rows // 64) * -(-n // 128), -(-rows // 128) * -(-n // 128)
    if pingpong_tiles <= sms or (coop_tiles > sms and rows <= 128):
        return FP8_PINGPONG[quant], 0
    return FP8_CONFIG[(quant, out_dtype)], 0


class GemmBuildError(XservError, ValueError):
    """The GEMM library cannot be built (missing nvcc/CUTLASS, unsupported target, compiler error)."""


def find_nvcc() -> Path:
    env = os.environ.get("XSERV_NVCC")
    if env:
        if not (Path(env).is_file() and os.access(env, os.X_OK)):
            raise GemmBuildError(f"XSERV_NVCC={env} is not an executable nvcc")
        return Path(env)
    for cand in (shutil.which("nvcc"), "/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return Path(cand)
    raise GemmBuildError("nvcc not found (set XSERV_NVCC or put CUDA 12.4+ nvcc on PATH)")


def find_cutlass_includes() -> list[Path]:
    """[cutlass/include (with cute/), tools/util/include] from the installed nvidia-cutlass wheel."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or spec.origin is None:
        raise GemmBuildError("CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0")
    src = Path(spec.origin).parent / "source"
    dirs = [src / "include", src / "tools" / "util" / "include"]
    if not (dirs[0] / "cute" / "tensor.hpp").is_file() or not (dirs[1] / "cutlass" / "util" / "packed_stride.hpp").is_file():
        raise GemmBuildError(f"CUTLASS headers not found under {src} (nvidia-cutlass wheel without source/include?)")
    return dirs


def nvcc_version(nvcc: Path) -> str:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False).stdout
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


def source_files(src_dir: Path = SOURCE_DIR) -> list[Path]:
    files = sorted(p for p in src_dir.iterdir() if p.suffix in (".cu", ".cuh", ".h"))
    if not any(p.name == "gemm_sm90.cu" for p in files):
        raise GemmBuildError(f"GEMM sources not found: {src_dir}/gemm_sm90.cu")
    return files


def build_key(sources: list[Path], nvcc_ver: str, includes: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sources:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update((includes[0] / "cutlass" / "version.h").read_bytes())
    h.update("\0".join((nvcc_ver, *COMPILE_FLAGS, *LINK_FLAGS)).encode())
    return h.hexdigest()[:32]


def default_cache_dir() -> Path:
    return cache_root() / "cutlass"


def _check(cmd: list[str], returncode: int, out: str, err: str) -> None:
    if returncode != 0:
        errs = [ln for ln in (err + out).splitlines() if "error" in ln.lower()] or err.splitlines()[-1:]
        raise GemmBuildError(f"nvcc failed ({Path(cmd[-1]).name}): {errs[0].strip() if errs else 'no output'}")


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    _check(cmd, r.returncode, r.stdout, r.stderr)


class _Compilers:
    """The running compiler processes of one build. stop() (the first failure, or an interruption: SIGTERM's
    SystemExit, Ctrl-C) kills them and every one started after it, so a build that is given up stops at once
    instead of finishing its queue (a 25-unit build is ~45 min of one core)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.procs: set[subprocess.Popen] = set()
        self.stopped = False

    def run(self, cmd: list[str]) -> None:
        with self.lock:
            if self.stopped:
                raise GemmBuildError("build stopped")
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.procs.add(proc)
        try:
            out, err = proc.communicate()
        finally:
            with self.lock:
                self.procs.discard(proc)
        _check(cmd, proc.returncode, out, err)

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            for proc in self.procs:
                proc.kill()


def run_compilers(units: list[list[str]], jobs: int, progress) -> None:
    """Run every command (jobs at a time), progress(f"compiled {output}") after each; the first failure or an
    interruption stops the rest (_Compilers.stop) and is raised."""
    compilers = _Compilers()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = {pool.submit(compilers.run, cmd): cmd[-1] for cmd in units}
        for fut in concurrent.futures.as_completed(futures):
            fut.result()
            progress(f"compiled {Path(futures[fut]).name}")
    except BaseException:
        compilers.stop()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _compile(nvcc: Path, includes: list[Path], src_dir: Path, work: Path, jobs: int, progress) -> Path:
    inc = [f"-I{d}" for d in (src_dir, *includes)]
    base = [str(nvcc), *COMPILE_FLAGS, *inc, "-c"]
    units = [base + [str(src_dir / f"{stem}.cu"), "-o", str(work / f"{stem}.o")]
             for stem in ("gemm_sm90", "gemm_sm90_fp8")]
    for i in range(len(GEMM_CONFIGS)):
        units.append(base + [f"-DXSERV_GEMM_CONFIG={i}", str(src_dir / "gemm_sm90_config.cu"),
                             "-o", str(work / f"gemm_config_{i}.o")])
    for i in range(len(FP8_CONFIGS)):
        units.append(base + [f"-DXSERV_FP8_CONFIG={i}", str(src_dir / "gemm_sm90_fp8_config.cu"),
                             "-o", str(work / f"gemm_fp8_config_{i}.o")])
    run_compilers(units, jobs, progress)
    lib = work / LIBRARY_NAME
    _run([str(nvcc), *LINK_FLAGS, *(cmd[-1] for cmd in units), "-o", str(lib)])
    return lib


def _config_names(lib: Path, table: str) -> list[str]:
    """Names of a built library's config table "gemm" or "gemm_fp8" (no GPU needed: cudart is linked statically)."""
    so = ctypes.CDLL(str(lib))
    name = getattr(so, f"xserv_{table}_config_name")
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.c_int]
    return [name(i).decode() for i in range(getattr(so, f"xserv_{table}_num_configs")())]


def library_config_names(lib: Path) -> list[str]:
    """Config names exported by a built library (xserv_gemm_bf16's config table)."""
    return _config_names(lib, "gemm")


def library_fp8_config_names(lib: Path) -> list[str]:
    """FP8 config names exported by a built library (xserv_gemm_fp8's config table)."""
    return _config_names(lib, "gemm_fp8")


def _workspace_size(lib: Path, entry: str, config: int, M: int, N: int, K: int, splits: int, num_sms: int) -> int:
    """entry(config, M, N, K, splits, num_sms): a library's workspace query (host code only, no GPU needed)."""
    fn = getattr(ctypes.CDLL(str(lib)), entry)
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_int] * 6
    return int(fn(config, M, N, K, splits, num_sms))


def library_workspace_size(lib: Path, config: int, M: int, N: int, K: int, splits: int,
                           num_sms: int = NUM_SMS_H200) -> int:
    """Bytes of device workspace a config needs for this problem on num_sms SMs (no GPU needed)."""
    return _workspace_size(lib, "xserv_gemm_workspace_size_ex", config, M, N, K, splits, num_sms)


def library_fp8_workspace_size(lib: Path, config: int, M: int, N: int, K: int, splits: int,
                               num_sms: int = NUM_SMS_H200) -> int:
    """Bytes of device workspace an FP8 config needs (stream-K / split-K scratch; 0 for the others; no GPU)."""
    return _workspace_size(lib, "xserv_gemm_fp8_workspace_size", config, M, N, K, splits, num_sms)


def build_gemm_library(out_dir: Path, target: str = "sm_90a", progress: Callable[[str], None] | None = None,
                       cache_dir: Path | None = None, jobs: int | None = None) -> dict:
    """Write out_dir/kernels/libxserv_gemm.so; returns {file (relative to out_dir), hash, configs, build_key}."""
    progress = progress or (lambda msg: None)
    if target not in SUPPORTED_TARGETS:
        raise GemmBuildError(f"CUTLASS GEMM library: unsupported target {target!r} (supported: sm_90a)")
    nvcc, includes, sources = find_nvcc(), find_cutlass_includes(), source_files()
    key = build_key(sources, nvcc_version(nvcc), includes)
    cached = (cache_dir or default_cache_dir()) / key / LIBRARY_NAME
    if cached.is_file():
        progress(f"gemm library: cached {key}")
    else:
        t0 = time.monotonic()
        cached.parent.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent.parent, prefix=f"{key}.tmp-") as tmp:
            lib = _compile(nvcc, includes, SOURCE_DIR, Path(tmp), jobs or max(1, os.cpu_count() or 1), progress)
            cached.parent.mkdir(exist_ok=True)
            os.replace(lib, cached)
        progress(f"gemm library: built {key} in {time.monotonic() - t0:.0f}s")
    return install_library(cached, out_dir, key)


def install_library(lib: Path, out_dir: Path, key: str) -> dict:
    """Copy a built library into out_dir/kernels after checking its config tables; build_gemm_library's result."""
    dest = Path(out_dir) / "kernels" / LIBRARY_NAME
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(lib, dest)
    names = library_config_names(dest)
    if tuple(names) != GEMM_CONFIGS:
        raise GemmBuildError(f"{dest}: config table {names} does not match cutlass_build.GEMM_CONFIGS")
    if tuple(library_fp8_config_names(dest)) != FP8_CONFIGS:
        raise GemmBuildError(f"{dest}: FP8 config table does not match cutlass_build.FP8_CONFIGS")
    return {"file": f"kernels/{LIBRARY_NAME}", "hash": "sha256:" + hashlib.sha256(dest.read_bytes()).hexdigest(),
            "configs": names, "build_key": key}


# (tile_m, tile_n, TFLOP/s with every SM busy) per bf16-output config, from the H200 sweep in docs/cutlass-notes.md.
_TILE_MODEL = {CFG_128x128: (128, 128, 740.0), CFG_128x256: (128, 256, 780.0), CFG_64x128_PINGPONG: (64, 128, 640.0)}


def _predicted_rate(cfg: int, M: int, N: int, num_sms: int) -> float:
    """Full-tile rate scaled by the useful fraction of the SM slots the tile waves occupy."""
    tm, tn, rate = _TILE_MODEL[cfg]
    tiles = -(-M // tm) * -(-N // tn)
    waves = -(-tiles // num_sms)
    return rate * (M * N / (tm * tn)) / (waves * num_sms)


def pick_gemm_config(M: int, N: int, K: int, out_dtype: str = "bfloat16", table: dict | None = None,
                     num_sms: int = NUM_SMS_H200) -> int:
    """The config of a prefill linear: the build config's gemm_configs entry for "MxNxK", else for "NxK" (bf16
    output only), else the tile model (choose_gemm_config)."""
    name = (table or {}).get(f"{M}x{N}x{K}") or (table or {}).get(f"{N}x{K}")
    if name is None or out_dtype != "bfloat16":
        return choose_gemm_config(M, N, K, out_dtype, num_sms)
    if name not in TABLE_CONFIGS:
        raise GemmBuildError(f"gemm_configs: {name!r} is not a bf16 tile config (known: {', '.join(TABLE_CONFIGS)})")
    return TABLE_CONFIGS[name]


def check_gemm_table(table: dict) -> None:
    """A build config's gemm_configs: keys "NxK" or "MxNxK" (positive integers), values TABLE_CONFIGS names."""
    for key, name in table.items():
        parts = key.split("x")
        if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise GemmBuildError(f"gemm_configs key {key!r}: expected NxK or MxNxK")
        if name not in TABLE_CONFIGS:
            raise GemmBuildError(f"gemm_configs[{key!r}] = {name!r}: not a bf16 tile config "
                                 f"(known: {', '.join(TABLE_CONFIGS)})")


def choose_gemm_config(M: int, N: int, K: int, out_dtype: str = "bfloat16", num_sms: int = NUM_SMS_H200) -> int:
    """Config index for a [M,K] x [N,K]^T GEMM (wave-quantization model; see docs/cutlass-notes.md)."""
    if N % 8 or K % 8 or M < 1:
        raise GemmBuildError(f"gemm M={M} N={N} K={K}: needs M >= 1 and N, K multiples of 8")
    if out_dtype == "float32":
        return CFG_F32OUT
    if out_dtype != "bfloat16":
        raise GemmBuildError(f"gemm output dtype {out_dtype!r}: expected bfloat16 or float32")
    return max(_TILE_MODEL, key=lambda cfg: _predicted_rate(cfg, M, N, num_sms))

"""NVRTC build of kernels/*.cu into cubins, cached by a hash of the (header-inlined) source, options and NVRTC
version under config.cache_root()."""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
from pathlib import Path
from typing import NamedTuple

from xserv_aot.config import cache_root
from xserv_aot.errors import XservError
from xserv_aot.plan.kernel_constants import nvrtc_defines


def _kernel_dir() -> Path:
    """The CUDA sources: installed as package data (xserv_aot/_kernels, from a wheel) or a checkout's kernels/."""
    here = Path(__file__).resolve().parents[1]
    installed, checkout = here / "_kernels", here.parent / "kernels"
    return installed if installed.is_dir() else checkout


KERNEL_DIR = _kernel_dir()
KERNEL_SOURCES = ("elementwise.cu", "gemv.cu", "gemm_mma.cu", "gemm_skinny.cu", "rope_cache.cu", "attention_decode.cu",
                  "attention_decode_batched.cu", "attention_decode_tc.cu", "attention_prefill.cu",
                  "attention_prefill_pipe.cu", "attention_prefill_wgmma.cu", "sample.cu", "collectives.cu", "gemv_fp8.cu",
                  "gemm_skinny_fp8.cu", "gemv_tc.cu", "decode_megakernel.cu",
                  "gemm_skinny_w8a8.cu", "gemm_w8a8_wgmma.cu", "gemm_w8a8_tma.cu", "rows_prefill.cu")
SUPPORTED_TARGETS = ("sm_90a", "sm_90")


class KernelBuildError(XservError, ValueError):
    """The plan cannot get CUDA kernels (unsupported shape/dtype/target, NVRTC error); one line."""


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as e:                           # noqa: BLE001  (the loader raises its own error types)
        raise KernelBuildError(f"the NVRTC library cannot be loaded ({' '.join(str(e).split())[:200]}); "
                               f"pip install 'xserv-aot[cuda]'") from None
    return f"{major}.{minor}"


def cache_dir() -> Path:
    return cache_root() / "nvrtc"


def expand_source(path: Path) -> str:
    """The .cu text with `#include "x.cuh"` inlined, nested headers too, each once (so the hash covers headers and
    NVRTC needs no paths)."""
    seen: set[str] = set()

    def expand(p: Path) -> str:
        def repl(m):
            if m.group(1) in seen:
                return ""
            seen.add(m.group(1))
            return expand(KERNEL_DIR / m.group(1))
        return re.sub(r'^#include "([\w.]+)"\s*$', repl, p.read_text(), flags=re.M)
    return expand(path)


def compile_options(target: str) -> dict:
    return {"arch": "sm_90a" if target in ("sm_90a", "sm_90") else target, "std": "c++17",
            "ptxas_options": ["-v"], "define_macro": nvrtc_defines()}


class Compiled(NamedTuple):
    cubin: bytes
    key: str                  # hash of source, options and NVRTC version
    log: str                  # ptxas -v report
    waits: tuple[str, ...]    # entry functions with a griddepcontrol.wait (may launch under PDL)


def pdl_waiters(ptx: str) -> tuple[str, ...]:
    """Entry functions of a PTX module whose body executes griddepcontrol.wait somewhere (kernels/common.cuh
    pdl_entry): the ones a plan may launch under programmatic dependent launch."""
    entries = re.split(r"^\.(?:visible|weak) \.entry ", ptx, flags=re.M)[1:]
    return tuple(sorted(e.split("(", 1)[0].strip() for e in entries if "griddepcontrol.wait" in e))


def compile_source(name: str, target: str) -> Compiled:
    """Uses the on-disk cache when source, options and NVRTC agree (a cubin counts only with its .log and .waits,
    which are written before it)."""
    from cuda.bindings import nvrtc
    from cuda.core import Program, ProgramOptions

    src = expand_source(KERNEL_DIR / name)
    opts = compile_options(target)
    key = hashlib.sha256(repr((src, sorted(opts.items()), nvrtc_version())).encode()).hexdigest()
    cached = cache_dir() / f"{Path(name).stem}-{key[:24]}.cubin"
    log_file, waits_file = cached.with_suffix(".log"), cached.with_suffix(".waits")
    if cached.is_file() and log_file.is_file() and waits_file.is_file():
        return Compiled(cached.read_bytes(), key, log_file.read_text(), tuple(waits_file.read_text().split()))

    class Log:
        def __init__(self):
            self.text = ""

        def write(self, s):
            self.text += s if isinstance(s, str) else s.decode(errors="replace")

    try:
        prog = Program(src, "c++", ProgramOptions(name=Path(name).stem, **opts))
        log = Log()
        code = bytes(prog.compile("cubin", logs=log).code)
        err, size = nvrtc.nvrtcGetPTXSize(prog.handle)
        ptx = b" " * size
        if err == nvrtc.nvrtcResult.NVRTC_SUCCESS:
            (err,) = nvrtc.nvrtcGetPTX(prog.handle, ptx)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"nvrtcGetPTX error: {err}")
    except Exception as e:
        first = str(e).strip().splitlines()
        msg = next((l for l in first if "error" in l), first[0] if first else type(e).__name__)
        raise KernelBuildError(f"kernels/{name}: NVRTC failed: {msg}") from None
    waits = pdl_waiters(ptx.decode(errors="replace"))
    cached.parent.mkdir(parents=True, exist_ok=True)
    for path, data in ((log_file, log.text.encode()), (waits_file, "\n".join(waits).encode()), (cached, code)):
        tmp = path.with_suffix(f"{path.suffix}.tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return Compiled(code, key, log.text, waits)


def compile_all(out_dir: Path, target: str, progress=None, sources: tuple[str, ...] = KERNEL_SOURCES) -> dict:
    """Write out_dir/kernels/<stem>.cubin for every source (of `sources`: a subset, tests). Returns {source: {file,
    hash (of the cubin), build_key, functions, resources, pdl_waits}}."""
    (out_dir / "kernels").mkdir(parents=True, exist_ok=True)
    import cuda.core  # noqa: F401  (import once here: concurrent first imports race)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        results = dict(zip(sources, pool.map(lambda n: compile_source(n, target), sources)))
    cubins = {}
    for name, (code, key, log, waits) in results.items():
        rel = f"kernels/{Path(name).stem}.cubin"
        (out_dir / rel).write_bytes(code)
        resources = ptxas_summary(log)
        if not resources:
            raise KernelBuildError(f"kernels/{name}: no entry functions in the ptxas report")
        cubins[name] = {"file": rel, "hash": "sha256:" + hashlib.sha256(code).hexdigest(), "build_key": key,
                        "functions": sorted(resources), "resources": resources, "pdl_waits": list(waits)}
        if progress:
            progress("kernels", len(cubins), len(results))
    return cubins


def ptxas_summary(log: str) -> dict:
    """{function: "R regs, S B smem[, X B spill]"} from the ptxas -v log."""
    out, fn, spill = {}, None, 0
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            fn, spill = m.group(1), 0
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            spill = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and fn:
            smem = re.search(r"(\d+) bytes smem", line)
            out[fn] = f"{m.group(1)} regs, {smem.group(1) if smem else 0} B smem" + (f", {spill} B spill" if spill else "")
    return out

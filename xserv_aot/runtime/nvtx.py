"""NVTX ranges for Nsight Systems / Nsight Compute, off by default.

`ranges(False)` (the default everywhere) is OFF: push/pop do nothing and `range()` returns one shared null context,
so a disabled range costs one attribute lookup and call. `ranges(True)` loads an NVTX implementation: the `nvtx`
package if importable, else the NVTX C API through ctypes from the nvidia-nvtx wheel (libnvtx3interop.so.1 under
nvidia/cu13/lib, or libnvToolsExt.so.1 of older wheels) or the system; without any, one clear RuntimeError.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.util
from pathlib import Path

LIBRARIES = ("cu13/lib/libnvtx3interop.so.1", "nvtx/lib/libnvtx3interop.so.1", "cu12/lib/libnvToolsExt.so.1",
             "nvtx/lib/libnvToolsExt.so.1")
_NULL = contextlib.nullcontext()


class _Off:
    enabled = False

    def push(self, name: str) -> None:
        pass

    def pop(self) -> None:
        pass

    def range(self, name: str):
        return _NULL


OFF = _Off()


class NvtxRanges:
    enabled = True

    def __init__(self, push, pop):
        self.push, self.pop = push, pop

    @contextlib.contextmanager
    def range(self, name: str):
        self.push(name)
        try:
            yield
        finally:
            self.pop()


def _ctypes_library():
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    candidates = [str(r / rel) for r in roots for rel in LIBRARIES if (r / rel).is_file()]
    candidates += [n for n in (ctypes.util.find_library("nvtx3interop"), ctypes.util.find_library("nvToolsExt")) if n]
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            lib.nvtxRangePushA.argtypes, lib.nvtxRangePushA.restype = [ctypes.c_char_p], ctypes.c_int
            lib.nvtxRangePop.argtypes, lib.nvtxRangePop.restype = [], ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


def ranges(enabled: bool):
    if not enabled:
        return OFF
    try:
        import nvtx  # the `nvtx` package
        return NvtxRanges(lambda name: nvtx.push_range(name), nvtx.pop_range)
    except ImportError:
        pass
    lib = _ctypes_library()
    if lib is None:
        raise RuntimeError("NVTX ranges need the nvtx package or nvidia-nvtx (pip install nvidia-nvtx)")
    return NvtxRanges(lambda name: lib.nvtxRangePushA(name.encode()), lib.nvtxRangePop)

"""Standalone access to the kernels (no plan): compile/load every cubin, move NumPy arrays to and from the
device, launch a kernel by name. For kernel tests and micro-benchmarks."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from xserv_aot.dtypes import STORAGE, decode, encode
from xserv_aot.runtime.cuda.driver import Device, Launch, allow_dynamic_smem


class DeviceArray:
    def __init__(self, lib: "KernelLib", ptr: int, shape, dtype: str):
        self.lib, self.ptr, self.shape, self.dtype = lib, ptr, tuple(shape), dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(STORAGE.get(self.dtype, self.dtype)).itemsize

    def numpy(self) -> np.ndarray:
        """float32 for bfloat16 buffers, else the stored dtype."""
        return decode(self.lib.dev.dtoh(self.ptr, self.shape, np.dtype(STORAGE.get(self.dtype, self.dtype))), self.dtype)


class KernelLib:
    def __init__(self, target: str = "sm_90a", device: Device | None = None, sources: tuple[str, ...] | None = None):
        """sources: the kernels/*.cu files to build (default: all)."""
        from xserv_aot.plan.kernel_build import KERNEL_SOURCES, compile_all
        self.dev = device or Device()
        self.tmp = Path(tempfile.mkdtemp(prefix="xserv-kernels-"))
        cubins = compile_all(self.tmp, target, sources=sources or KERNEL_SOURCES)
        self.where = {fn: name for name, c in cubins.items() for fn in c["functions"]}
        self.modules = {name: self.dev.load_module((self.tmp / c["file"]).read_bytes()) for name, c in cubins.items()}
        self._funcs, self._smem = {}, {}

    def func(self, name: str, smem: int = 0):
        """The kernel, opted in to at least `smem` dynamic bytes (the largest any launch of it asked for so far)."""
        if name not in self._funcs:
            self._funcs[name] = self.dev.function(self.modules[self.where[name]], name, smem)
            self._smem[name] = smem
        elif smem > self._smem[name]:
            allow_dynamic_smem(self._funcs[name], smem, name)
            self._smem[name] = smem
        return self._funcs[name]

    def to_device(self, x: np.ndarray, dtype: str | None = None) -> DeviceArray:
        """dtype "bfloat16" rounds a float array to bf16 bits; otherwise the array's own dtype is kept."""
        dtype = dtype or str(x.dtype)
        raw = encode(x, dtype) if dtype == "bfloat16" else np.ascontiguousarray(x)
        arr = DeviceArray(self, self.dev.alloc(raw.nbytes), x.shape, dtype)
        self.dev.htod(arr.ptr, raw)
        return arr

    def empty(self, shape, dtype: str, poison: bool = True) -> DeviceArray:
        """Device buffer filled with NaN (floats) or 0x7f bytes (ints), so unwritten elements show."""
        arr = DeviceArray(self, 0, shape, dtype)
        arr.ptr = self.dev.alloc(arr.nbytes)
        if poison:
            if dtype == "bfloat16":
                self.dev.htod(arr.ptr, np.full(arr.shape, 0x7FC0, np.uint16))
            elif dtype == "float32":
                self.dev.htod(arr.ptr, np.full(arr.shape, np.nan, np.float32))
            else:
                self.dev.memset(arr.ptr, 0x7F, arr.nbytes)
                self.dev.sync()
        return arr

    def launch(self, fn: str, grid, block, args: list[tuple[str, object]], smem: int = 0, sync: bool = True,
               pdl: bool = False):
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        args = [(t, v.ptr if isinstance(v, DeviceArray) else v) for t, v in args]
        Launch(fn, self.func(fn, smem), g, b, smem, args, pdl)(self.dev.stream)
        if sync:
            self.dev.sync()

    def launch_record(self, rec, buffers: dict[str, DeviceArray | None], sync: bool = True):
        """Run a plan LaunchRecord (plan.kernel_build) with its ("ptr", name) and ("tmap", spec) arguments bound to
        buffers."""
        self.launch(rec.fn, rec.grid, rec.block, self.bind(rec, buffers), smem=rec.smem, sync=sync, pdl=rec.pdl)

    def bind(self, rec, buffers: dict[str, DeviceArray | None]) -> list[tuple[str, object]]:
        """rec's arguments with buffer names replaced by device pointers and tensor maps encoded over them."""
        from xserv_aot.runtime.cuda.tensor_map import encode

        def one(a):
            if a[0] == "ptr":
                return "ptr", buffers[a[1]].ptr if buffers.get(a[1]) is not None else 0
            if a[0] == "tmap":
                return "tmap", encode(a[1], buffers[a[1]["buffer"]].ptr)
            return a[0], a[1]
        return [one(a) for a in rec.args]

"""Thin layer over the CUDA driver API (cuda.bindings.driver): context, memory, modules, launches, graphs.

Every call is checked; a failure raises CudaError naming the call. Device pointers are plain ints.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


def _cu():
    from cuda.bindings import driver
    return driver


def check(result, what: str = "CUDA call"):
    cu = _cu()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise CudaError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def allow_dynamic_smem(fn, smem: int, name: str) -> None:
    """Opt fn in to `smem` bytes of dynamic shared memory (needed once static + dynamic pass 48 KB; set for any)."""
    if smem > 0:
        cu = _cu()
        check(cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    smem), f"cuFuncSetAttribute({name})")


C_TYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int, "u32": ctypes.c_uint, "f32": ctypes.c_float,
           "u64": ctypes.c_ulonglong}
TMAP_BYTES, TMAP_ALIGN = 128, 64           # an encoded tensor map (CUtensorMap), passed by value


class TensorMapParam:
    """A "tmap" launch argument: the encoded map's bytes at a 64-byte aligned host address."""

    def __init__(self, raw: bytes):
        if len(raw) != TMAP_BYTES:
            raise ValueError(f"an encoded tensor map has {TMAP_BYTES} bytes, got {len(raw)}")
        self._buf = (ctypes.c_uint8 * (TMAP_BYTES + TMAP_ALIGN))()
        self.address = ctypes.addressof(self._buf) + (-ctypes.addressof(self._buf)) % TMAP_ALIGN
        ctypes.memmove(self.address, raw, TMAP_BYTES)


def param_value(kind: str, value):
    """(ctypes object, its address) of one resolved launch argument."""
    if kind == "tmap":
        p = TensorMapParam(value)
        return p, p.address
    v = C_TYPES[kind](value if kind != "ptr" else (value or None))
    return v, ctypes.addressof(v)


@dataclass
class Launch:
    """One prepared kernel launch: the packed parameter block is built once and reused for every replay.
    pdl: launch with programmatic stream serialization (every kernel waits for its predecessor before touching
    memory: kernels/common.cuh pdl_entry); a plan's build.pdl."""
    name: str
    func: object
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    args: list[tuple[str, object]]
    pdl: bool = False
    _vals: list = field(default_factory=list, repr=False)
    _ptrs: object = field(default=None, repr=False)
    _config: object = field(default=None, repr=False)

    def __post_init__(self):
        vals = [param_value(t, v) for t, v in self.args]
        self._vals = [v for v, _ in vals]
        self._ptrs = (ctypes.c_void_p * max(1, len(vals)))(*[a for _, a in vals])

    def _launch_config(self, stream):
        cu = _cu()
        c = cu.CUlaunchConfig()
        c.gridDimX, c.gridDimY, c.gridDimZ = self.grid
        c.blockDimX, c.blockDimY, c.blockDimZ = self.block
        c.sharedMemBytes = self.smem
        c.hStream = stream
        a = cu.CUlaunchAttribute()
        a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        a.value.programmaticStreamSerializationAllowed = 1
        c.attrs = [a]
        c.numAttrs = 1
        return c

    def __call__(self, stream) -> None:
        cu = _cu()
        if self.pdl:
            if self._config is None or self._config[0] is not stream:
                self._config = (stream, self._launch_config(stream))
            check(cu.cuLaunchKernelEx(self._config[1], self.func, ctypes.addressof(self._ptrs), 0),
                  f"launch {self.name}")
            return
        check(cu.cuLaunchKernel(self.func, *self.grid, *self.block, self.smem, stream,
                                ctypes.addressof(self._ptrs), 0), f"launch {self.name}")


@dataclass
class HostCall:
    """A host-library launch (e.g. the CUTLASS GEMM) that enqueues work on the given stream."""
    name: str
    fn: object

    def __call__(self, stream) -> None:
        self.fn(int(stream))


class Device:
    def __init__(self, ordinal: int = 0):
        cu = _cu()
        check(cu.cuInit(0), "cuInit")
        self.dev = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self.name = check(cu.cuDeviceGetName(256, self.dev), "cuDeviceGetName").split(b"\0")[0].decode()
        attr = cu.CUdevice_attribute
        self.num_sms = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.dev), "attr")
        self._allocs: list[int] = []
        self._host: list[int] = []

    @staticmethod
    def count() -> int:
        cu = _cu()
        check(cu.cuInit(0), "cuInit")
        return int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))

    def make_current(self) -> None:
        check(_cu().cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def mem_info(self) -> tuple[int, int]:
        return check(_cu().cuMemGetInfo(), "cuMemGetInfo")

    def alloc(self, nbytes: int) -> int:
        ptr = int(check(_cu().cuMemAlloc(max(256, int(nbytes))), f"cuMemAlloc({nbytes})"))
        self._allocs.append(ptr)
        return ptr

    def free(self, ptr: int) -> None:
        """Free one alloc() (a setup scratch buffer) now instead of at close()."""
        self._allocs.remove(ptr)
        check(_cu().cuMemFree(ptr), "cuMemFree")

    def alloc_host(self, nbytes: int, dtype=np.uint8) -> np.ndarray:
        """Pinned host memory as a NumPy array (valid until close())."""
        nbytes = max(256, int(nbytes))
        ptr = int(check(_cu().cuMemHostAlloc(nbytes, 0), f"cuMemHostAlloc({nbytes})"))
        self._host.append(ptr)
        buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        return np.frombuffer(buf, dtype=np.uint8).view(dtype)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        check(_cu().cuMemsetD8Async(ptr, value, nbytes, self.stream), "cuMemsetD8Async")

    def htod(self, dst: int, src: np.ndarray, stream=None) -> None:
        src = np.ascontiguousarray(src)
        check(_cu().cuMemcpyHtoDAsync(dst, src.ctypes.data, src.nbytes, stream or self.stream), "cuMemcpyHtoDAsync")
        if stream is None:
            self.sync()

    def htod_async(self, dst: int, src_ptr: int, nbytes: int) -> None:
        check(_cu().cuMemcpyHtoDAsync(dst, src_ptr, nbytes, self.stream), "cuMemcpyHtoDAsync")

    def dtoh_async(self, dst_ptr: int, src: int, nbytes: int) -> None:
        check(_cu().cuMemcpyDtoHAsync(dst_ptr, src, nbytes, self.stream), "cuMemcpyDtoHAsync")

    def dtod_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int) -> None:
        """Copy `height` rows of `width` bytes between device buffers with the given row pitches (async)."""
        cu = _cu()
        c = cu.CUDA_MEMCPY2D()
        c.srcMemoryType = c.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        c.srcDevice, c.srcPitch, c.dstDevice, c.dstPitch = src, src_pitch, dst, dst_pitch
        c.WidthInBytes, c.Height = width, height
        check(cu.cuMemcpy2DAsync(c, self.stream), "cuMemcpy2DAsync")

    def dtoh(self, src: int, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        check(_cu().cuMemcpyDtoHAsync(out.ctypes.data, src, out.nbytes, self.stream), "cuMemcpyDtoHAsync")
        self.sync()
        return out

    def sync(self) -> None:
        check(_cu().cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def load_module(self, cubin: bytes):
        return check(_cu().cuModuleLoadData(cubin), "cuModuleLoadData")

    def function(self, module, name: str, max_smem: int = 0, carveout: int = -1):
        """A kernel of a loaded module, opted in to max_smem bytes of dynamic shared memory; carveout >= 0: its
        preferred shared-memory carveout in percent (a plan's build.smem_carveout)."""
        cu = _cu()
        fn = check(cu.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")
        allow_dynamic_smem(fn, max_smem, name)
        if carveout >= 0:
            check(cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                        carveout), f"cuFuncSetAttribute({name}, carveout)")
        return fn

    def capture(self, body) -> object:
        """Run body(stream) under stream capture; returns the instantiated graph exec."""
        cu = _cu()
        check(cu.cuStreamBeginCapture(self.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
              "cuStreamBeginCapture")
        try:
            body(self.stream)
        except BaseException:
            cu.cuStreamEndCapture(self.stream)
            raise
        graph = check(cu.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        gexec = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        check(cu.cuGraphDestroy(graph), "cuGraphDestroy")
        return gexec

    def graph_launch(self, gexec) -> None:
        check(_cu().cuGraphLaunch(gexec, self.stream), "cuGraphLaunch")

    def event(self):
        return check(_cu().cuEventCreate(0), "cuEventCreate")

    def record(self, ev) -> None:
        check(_cu().cuEventRecord(ev, self.stream), "cuEventRecord")

    def record_in_graph(self, ev) -> None:
        """Under stream capture: ev becomes an event node of the graph (CU_EVENT_RECORD_EXTERNAL), recorded at each
        replay, so elapsed_ms between two such events times the nodes between them."""
        cu = _cu()
        check(cu.cuEventRecordWithFlags(ev, self.stream, int(cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL)),
              "cuEventRecordWithFlags")

    def wait_event(self, ev) -> None:
        check(_cu().cuEventSynchronize(ev), "cuEventSynchronize")

    def elapsed_ms(self, start, end) -> float:
        check(_cu().cuEventSynchronize(end), "cuEventSynchronize")
        return float(check(_cu().cuEventElapsedTime(start, end), "cuEventElapsedTime"))

    def close(self) -> None:
        cu = _cu()
        for p in self._allocs:
            cu.cuMemFree(p)
        for p in self._host:
            cu.cuMemFreeHost(p)
        self._allocs, self._host = [], []

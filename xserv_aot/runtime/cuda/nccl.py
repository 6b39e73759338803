"""ctypes binding of NCCL (libnccl.so.2 from the nvidia-nccl-cu13 wheel): the unique id, one communicator per rank
process, and the plan's collective records (plan/nccl_records.py) as host calls on the capturing stream, so each
all-reduce / all-gather is a node of the bucket's CUDA graph.

NOT RUN on a GPU yet (no multi-GPU machine in the session that wrote it): tests/test_cuda_tp.py holds the checks.
NVLink SHARP stays off: NCCL_NVLS_ENABLE=0 is set before the library is loaded; nothing here calls cuMulticastCreate.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from xserv_aot.plan.nccl_records import ENV, SIGNATURES

UNIQUE_ID_BYTES = 128               # NCCL_UNIQUE_ID_BYTES (nccl.h)
_c_ptr = ctypes.c_void_p


class NcclError(RuntimeError):
    """An NCCL call that failed; one line with the call and NCCL's error string."""


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


def library_path() -> Path:
    """libnccl.so.2 of the installed nvidia-nccl wheel."""
    try:
        import nvidia.nccl
    except ImportError:
        raise NcclError("tensor-parallel plans need NCCL: pip install nvidia-nccl-cu13") from None
    for root in nvidia.nccl.__path__:
        path = Path(root) / "lib" / "libnccl.so.2"
        if path.is_file():
            return path
    raise NcclError(f"no lib/libnccl.so.2 in {list(nvidia.nccl.__path__)}")


class Nccl:
    def __init__(self, path: Path | None = None):
        for k, v in ENV.items():
            if os.environ.get(k, v) != v:
                raise NcclError(f"{k}={os.environ[k]} in the environment; tensor-parallel ranks need {k}={v}")
            os.environ[k] = v
        self._lib = lib = ctypes.CDLL(str(path or library_path()))
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(_c_ptr), ctypes.c_int, UniqueId, ctypes.c_int]
        lib.ncclAllReduce.argtypes = [_c_ptr, _c_ptr, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _c_ptr, _c_ptr]
        lib.ncclAllGather.argtypes = [_c_ptr, _c_ptr, ctypes.c_size_t, ctypes.c_int, _c_ptr, _c_ptr]
        lib.ncclCommDestroy.argtypes = [_c_ptr]
        lib.ncclCommAbort.argtypes = [_c_ptr]
        self.comm: _c_ptr | None = None

    def check(self, status: int, call: str) -> None:
        if status != 0:
            raise NcclError(f"{call}: NCCL error {status}: {self._lib.ncclGetErrorString(status).decode()}")

    def version(self) -> int:
        v = ctypes.c_int()
        self.check(self._lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        return v.value

    def unique_id(self) -> bytes:
        """Rank 0 makes it; every rank passes the same bytes to init_rank."""
        uid = UniqueId()
        self.check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)

    def init_rank(self, nranks: int, uid: bytes, rank: int) -> None:
        """Collective over all ranks (each in its own process, its GPU's context current)."""
        if len(uid) != UNIQUE_ID_BYTES or not 0 <= rank < nranks:
            raise NcclError(f"ncclCommInitRank: bad arguments (id of {len(uid)} bytes, rank {rank} of {nranks})")
        comm, u = _c_ptr(), UniqueId()
        ctypes.memmove(ctypes.addressof(u), uid, UNIQUE_ID_BYTES)
        self.check(self._lib.ncclCommInitRank(ctypes.byref(comm), nranks, u, rank), "ncclCommInitRank")
        self.comm = comm

    def entry(self, fn: str, args: list[tuple[str, object]]):
        """A collective launch record (args resolved to (C type, value)) -> call(stream_handle), the communicator
        and the stream appended as nccl.h orders them."""
        from xserv_aot.runtime.cuda.driver import C_TYPES
        if fn not in SIGNATURES:
            raise NcclError(f"no NCCL entry point {fn!r} (known: {', '.join(SIGNATURES)})")
        if len(args) != len(SIGNATURES[fn]) - 2:
            raise NcclError(f"{fn}: {len(args)} arguments for {len(SIGNATURES[fn]) - 2} parameters")
        if self.comm is None:
            raise NcclError(f"{fn}: no communicator (init_rank first)")
        cfn, vals = getattr(self._lib, fn), [C_TYPES[t](v if t != "ptr" else (v or None)) for t, v in args]

        def call(stream_handle: int) -> None:
            self.check(cfn(*vals, self.comm, _c_ptr(stream_handle or None)), fn)
        return call

    def close(self, abort: bool = False) -> None:
        if self.comm is not None:
            (self._lib.ncclCommAbort if abort else self._lib.ncclCommDestroy)(self.comm)
            self.comm = None

"""ctypes wrapper of libxserv_gemm.so (kernels/cutlass/gemm_sm90.cu): bf16 TN GEMMs on a caller's stream.

C[M,N] = A[M,K] @ B[N,K]^T (+ bias[N]); A, B, bias bf16 row-major, C bf16 or fp32 (by config), all device
pointers 16-byte aligned, N and K multiples of 8, any M >= 0. Launches only: no allocation, no sync, so calls
can be captured into a CUDA graph.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

_c_ptr = ctypes.c_void_p


class CutlassGemmError(RuntimeError):
    """A nonzero status from the GEMM library (bad config, misaligned operand, launch failure)."""


def as_stream_handle(stream) -> int:
    """cudaStream_t as an int from an int, a torch stream (.cuda_stream) or a cuda.core Stream (.handle)."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "handle"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    raise TypeError(f"not a CUDA stream: {type(stream).__name__}")


class CutlassGemm:
    def __init__(self, lib_path: str | Path):
        self.path = Path(lib_path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GEMM library not found: {self.path}")
        lib = ctypes.CDLL(str(self.path))
        lib.xserv_gemm_bf16.restype = ctypes.c_int
        lib.xserv_gemm_bf16.argtypes = [ctypes.c_int, _c_ptr, _c_ptr, _c_ptr, _c_ptr,
                                        ctypes.c_int, ctypes.c_int, ctypes.c_int, _c_ptr]
        lib.xserv_gemm_num_configs.restype = ctypes.c_int
        lib.xserv_gemm_config_name.restype = ctypes.c_char_p
        lib.xserv_gemm_config_name.argtypes = [ctypes.c_int]
        lib.xserv_gemm_config_out_bytes.restype = ctypes.c_int
        lib.xserv_gemm_config_out_bytes.argtypes = [ctypes.c_int]
        lib.xserv_gemm_workspace_size_ex.restype = ctypes.c_size_t
        lib.xserv_gemm_workspace_size_ex.argtypes = [ctypes.c_int] * 6
        lib.xserv_gemm_workspace_size.restype = ctypes.c_size_t
        lib.xserv_gemm_workspace_size.argtypes = [ctypes.c_int] * 4
        lib.xserv_gemm_bf16_ex.restype = ctypes.c_int
        lib.xserv_gemm_bf16_ex.argtypes = [ctypes.c_int, _c_ptr, _c_ptr, _c_ptr, _c_ptr, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_int, _c_ptr, ctypes.c_size_t, _c_ptr]
        lib.xserv_gemm_status_string.restype = ctypes.c_char_p
        lib.xserv_gemm_status_string.argtypes = [ctypes.c_int]
        self._lib = lib
        self.configs = [lib.xserv_gemm_config_name(i).decode() for i in range(lib.xserv_gemm_num_configs())]

    def out_bytes(self, config: int) -> int:
        """2 for a bf16-output config, 4 for fp32."""
        self._check_config(config)
        return self._lib.xserv_gemm_config_out_bytes(config)

    def workspace_size(self, config: int, M: int, N: int, K: int) -> int:
        self._check_config(config)
        return self._lib.xserv_gemm_workspace_size(config, M, N, K)

    def workspace_size_ex(self, config: int, M: int, N: int, K: int, splits: int, num_sms: int = 132) -> int:
        self._check_config(config)
        return self._lib.xserv_gemm_workspace_size_ex(config, M, N, K, splits, num_sms)

    def gemm(self, config: int, a_ptr: int, b_ptr: int, c_ptr: int, bias_ptr: int | None,
             M: int, N: int, K: int, stream_handle: int = 0) -> None:
        status = self._lib.xserv_gemm_bf16(config, a_ptr, b_ptr, c_ptr, bias_ptr or None, M, N, K,
                                           stream_handle or None)
        if status != 0:
            msg = self._lib.xserv_gemm_status_string(status).decode()
            name = self.configs[config] if 0 <= config < len(self.configs) else config
            raise CutlassGemmError(f"xserv_gemm_bf16(config={name}, M={M}, N={N}, K={K}): status {status}: {msg}")

    def gemm_ex(self, config: int, a_ptr: int, b_ptr: int, c_ptr: int, bias_ptr: int | None, M: int, N: int, K: int,
                splits: int, workspace_ptr: int, workspace_bytes: int, stream_handle: int = 0) -> None:
        """As gemm, for the swap-AB decode configs: splits 0 stream-K, 1 data-parallel, > 1 split-K, reduced
        in a fixed order in `workspace` (device memory, zeroed by the call itself)."""
        status = self._lib.xserv_gemm_bf16_ex(config, a_ptr, b_ptr, c_ptr, bias_ptr or None, M, N, K, splits,
                                              workspace_ptr, workspace_bytes, stream_handle or None)
        if status != 0:
            msg = self._lib.xserv_gemm_status_string(status).decode()
            raise CutlassGemmError(f"xserv_gemm_bf16_ex(config={self.configs[config]}, M={M}, N={N}, K={K}, "
                                   f"splits={splits}): status {status}: {msg}")

    def entry(self, fn: str, args: list[tuple[str, object]]):
        """A launch record's call of entry point fn: args packed once; returns call(stream_handle)."""
        from xserv_aot.runtime.cuda.driver import C_TYPES
        cfn = getattr(self._lib, fn)
        vals = [C_TYPES[t](v if t != "ptr" else (v or None)) for t, v in args]

        def call(stream_handle: int) -> None:
            status = cfn(*vals, _c_ptr(stream_handle or None))
            if status != 0:
                msg = self._lib.xserv_gemm_status_string(status).decode()
                raise CutlassGemmError(f"{fn}({', '.join(str(v.value) for v in vals)}): status {status}: {msg}")
        return call

    def _check_config(self, config: int) -> None:
        if not 0 <= config < len(self.configs):
            raise CutlassGemmError(f"GEMM config {config} out of range 0..{len(self.configs) - 1}")

"""Tensor-map launch arguments on the device (plan.tensor_maps): encoded once per launch record at plan load by
cuTensorMapEncodeTiled into the 128 opaque bytes a `const __grid_constant__ TmaDesc` kernel parameter takes."""
from __future__ import annotations

import ctypes

from xserv_aot.plan.tensor_maps import SWIZZLES, TMA_DTYPES, TensorMapError, check_tensor_map
from xserv_aot.runtime.cuda.driver import TMAP_BYTES, check

OOB = {"zero": "NONE", "nan": "NAN_REQUEST_ZERO_FMA"}        # spec oob_fill -> CU_TENSOR_MAP_FLOAT_OOB_FILL_*


def encode(spec: dict, address: int) -> bytes:
    """The map of spec over device memory at address (the named buffer's base) -> its 128 bytes."""
    from cuda.bindings import driver as cu
    check_tensor_map(spec)
    if address % 16:
        raise TensorMapError(f"tensor map of {spec['buffer']!r}: address {address:#x} is not 16-byte aligned")
    rank = len(spec["dims"])
    swizzle = "NONE" if SWIZZLES[spec["swizzle"]] == 0 else spec["swizzle"]
    l2 = "NONE" if spec["l2_promotion"] == "none" else f"L2_{spec['l2_promotion']}"
    tm = check(cu.cuTensorMapEncodeTiled(
        getattr(cu.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{TMA_DTYPES[spec['dtype']]}"), rank, address,
        [cu.cuuint64_t(d) for d in spec["dims"]], [cu.cuuint64_t(s) for s in spec["strides"]],
        [cu.cuuint32_t(b) for b in spec["box"]], [cu.cuuint32_t(e) for e in spec["element_strides"]],
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(cu.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swizzle}"),
        getattr(cu.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{l2}"),
        getattr(cu.CUtensorMapFloatOOBfill, f"CU_TENSOR_MAP_FLOAT_OOB_FILL_{OOB[spec['oob_fill']]}")),
        f"cuTensorMapEncodeTiled({spec['buffer']})")
    return ctypes.string_at(tm.getPtr(), TMAP_BYTES)

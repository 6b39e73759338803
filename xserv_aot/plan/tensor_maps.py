"""Tensor-map launch arguments (docs/plan-format.md "Tensor maps"): plain data describing a TMA view of one plan
buffer, ["tmap", spec], which the CUDA runtime encodes once at plan load (runtime/cuda/tensor_map.py) and passes by
value as a `const __grid_constant__ TmaDesc` kernel parameter. The rules here are the TMA's own
(cuTensorMapEncodeTiled), checked when a plan is written and when it is loaded."""
from __future__ import annotations

import math

from xserv_aot.dtypes import ITEMSIZE

SWIZZLES = {"none": 0, "32B": 32, "64B": 64, "128B": 128}     # name -> bytes of the swizzle span (0: none)
INTERLEAVES = ("none",)
L2_PROMOTIONS = ("none", "64B", "128B", "256B")
OOB_FILLS = ("zero", "nan")                                  # nan: floating-point element types only
TMA_DTYPES = {"float8_e4m3fn": "UINT8", "bfloat16": "BFLOAT16", "float32": "FLOAT32", "int32": "INT32",
              "int64": "INT64"}                               # plan dtype -> CU_TENSOR_MAP_DATA_TYPE_*
FLOAT_DTYPES = ("bfloat16", "float32")
FIELDS = ("buffer", "dtype", "dims", "strides", "box", "element_strides", "swizzle", "interleave", "l2_promotion",
          "oob_fill")
MAX_RANK, MAX_BOX, MAX_ELEMENT_STRIDE = 5, 256, 8


class TensorMapError(ValueError):
    """A tensor-map spec that TMA would refuse or that does not fit its buffer; one line."""


def tensor_map(buffer: str, dtype: str, dims, strides, box, swizzle: str = "128B", element_strides=None,
               l2_promotion: str = "256B", oob_fill: str = "zero") -> tuple:
    """The launch argument ("tmap", spec); dims / box / element_strides innermost first, strides: bytes between
    consecutive indices of dims 1.. (rank - 1 entries)."""
    spec = {"buffer": buffer, "dtype": dtype, "dims": [int(x) for x in dims], "strides": [int(x) for x in strides],
            "box": [int(x) for x in box], "element_strides": [int(x) for x in element_strides or [1] * len(dims)],
            "swizzle": swizzle, "interleave": "none", "l2_promotion": l2_promotion, "oob_fill": oob_fill}
    check_tensor_map(spec)
    return ("tmap", spec)


def matrix_map(buffer: str, dtype: str, rows: int, cols: int, box_rows: int, box_cols: int, **kw) -> tuple:
    """A row-major [rows, cols] matrix (rows of cols elements, densely packed) in boxes of box_rows x box_cols."""
    return tensor_map(buffer, dtype, [cols, rows], [cols * ITEMSIZE[dtype]], [box_cols, box_rows], **kw)


def extent_bytes(spec: dict) -> int:
    """Bytes from the map's base to the end of its last element."""
    return ITEMSIZE[spec["dtype"]] + sum((d - 1) * s for d, s in zip(spec["dims"][1:], spec["strides"])) + \
        (spec["dims"][0] - 1) * ITEMSIZE[spec["dtype"]]


def check_tensor_map(spec) -> None:
    """The spec's own rules (no buffer needed): fields, rank, dtype, dims, strides (multiples of 16, < 2^40, each
    dimension past the previous one), box (1..256 a dimension, within dims, inner bytes a multiple of 16 and
    within the swizzle span), element strides 1..8, the enums."""
    if not isinstance(spec, dict) or set(spec) != set(FIELDS):
        raise TensorMapError(f"tensor map: fields {sorted(spec) if isinstance(spec, dict) else spec!r}, "
                             f"expected {sorted(FIELDS)}")
    name = spec["buffer"]
    where = f"tensor map of {name!r}"
    if not isinstance(name, str) or not name:
        raise TensorMapError(f"{where}: buffer must be a buffer name")
    if spec["dtype"] not in TMA_DTYPES:
        raise TensorMapError(f"{where}: dtype {spec['dtype']!r} is not one of {', '.join(TMA_DTYPES)}")
    dims, strides, box, es = spec["dims"], spec["strides"], spec["box"], spec["element_strides"]
    lists = {"dims": dims, "strides": strides, "box": box, "element_strides": es}
    if not all(isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
               for v in lists.values()):
        raise TensorMapError(f"{where}: dims, strides, box and element_strides must be lists of integers")
    rank = len(dims)
    if not 1 <= rank <= MAX_RANK or len(strides) != rank - 1 or len(box) != rank or len(es) != rank:
        raise TensorMapError(f"{where}: rank {rank} with {len(strides)} strides, {len(box)} box and {len(es)} "
                             f"element strides (rank 1..{MAX_RANK}, rank - 1 strides)")
    if any(not 1 <= d <= 1 << 32 for d in dims):
        raise TensorMapError(f"{where}: dims {dims} must be in 1..2^32")
    item = ITEMSIZE[spec["dtype"]]
    span = dims[0] * item
    for i, s in enumerate(strides):
        if s % 16 or not 0 < s < 1 << 40:
            raise TensorMapError(f"{where}: stride {s} of dim {i + 1} must be a positive multiple of 16 below 2^40")
        if s < span:
            raise TensorMapError(f"{where}: stride {s} of dim {i + 1} overlaps dim {i} ({span} bytes)")
        span = s * dims[i + 1]
    if any(not 1 <= b <= MAX_BOX for b in box) or any(b > d for b, d in zip(box, dims)):
        raise TensorMapError(f"{where}: box {box} must be 1..{MAX_BOX} a dimension and within dims {dims}")
    if box[0] * item % 16:
        raise TensorMapError(f"{where}: box inner dimension {box[0]} x {item} bytes is not a multiple of 16")
    if any(not 1 <= e <= MAX_ELEMENT_STRIDE for e in es):
        raise TensorMapError(f"{where}: element strides {es} must be 1..{MAX_ELEMENT_STRIDE}")
    if spec["swizzle"] not in SWIZZLES:
        raise TensorMapError(f"{where}: swizzle {spec['swizzle']!r} is not one of {', '.join(SWIZZLES)}")
    if SWIZZLES[spec["swizzle"]] and box[0] * item > SWIZZLES[spec["swizzle"]]:
        raise TensorMapError(f"{where}: box inner dimension {box[0] * item} bytes exceeds the {spec['swizzle']} "
                             f"swizzle")
    for key, allowed in (("interleave", INTERLEAVES), ("l2_promotion", L2_PROMOTIONS), ("oob_fill", OOB_FILLS)):
        if spec[key] not in allowed:
            raise TensorMapError(f"{where}: {key} {spec[key]!r} is not one of {', '.join(allowed)}")
    if spec["oob_fill"] == "nan" and spec["dtype"] not in FLOAT_DTYPES:
        raise TensorMapError(f"{where}: oob_fill nan needs a floating-point dtype ({', '.join(FLOAT_DTYPES)})")


def check_fits(spec: dict, dtype: str, shape=None, offset: int = 0) -> None:
    """The map against the buffer it names: the same dtype, its extent within the buffer's bytes (shape None: not
    checked), the buffer's offset in its allocation 16-byte aligned (allocations are at least 256-byte aligned)."""
    where = f"tensor map of {spec['buffer']!r}"
    if dtype != spec["dtype"]:
        raise TensorMapError(f"{where}: dtype {spec['dtype']} but the buffer is {dtype}")
    nbytes = math.prod(shape) * ITEMSIZE[dtype] if shape is not None else None
    if nbytes is not None and extent_bytes(spec) > nbytes:
        raise TensorMapError(f"{where}: spans {extent_bytes(spec)} bytes, the buffer has {nbytes}")
    if offset % 16:
        raise TensorMapError(f"{where}: buffer offset {offset} is not 16-byte aligned")

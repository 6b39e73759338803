"""Tensor-map launch arguments as plan data (plan/tensor_maps.py, docs/plan-format.md "Tensor maps"), no GPU: the
spec a builder writes, every TMA rule the validation enforces (one bad field at a time), the checks against the
named buffer at compile time, the record round trip and its refusal at load, the kernel-signature type, and the
64-byte aligned parameter block the launcher passes."""
from __future__ import annotations

import copy
import ctypes

import pytest

from xserv_aot.plan import launch_records as lr
from xserv_aot.plan.nvrtc_build import KernelBuildError
from xserv_aot.plan.op_records import LaunchRecord, OpRecordError
from xserv_aot.plan.signatures import TYPE_BYTES, parse_param
from xserv_aot.plan.tensor_maps import TensorMapError, check_fits, check_tensor_map, extent_bytes, matrix_map
from xserv_aot.runtime.cuda.driver import TMAP_ALIGN, TMAP_BYTES, TensorMapParam, param_value

FP8 = "float8_e4m3fn"


def spec():
    return matrix_map("w", FP8, 6144, 4096, 128, 128)[1]


def test_matrix_map_is_the_row_major_view():
    s = spec()
    assert s == {"buffer": "w", "dtype": FP8, "dims": [4096, 6144], "strides": [4096], "box": [128, 128],
                 "element_strides": [1, 1], "swizzle": "128B", "interleave": "none", "l2_promotion": "256B",
                 "oob_fill": "zero"}
    assert extent_bytes(s) == 6144 * 4096
    bf = matrix_map("x", "bfloat16", 40, 96, 8, 64, swizzle="none")[1]
    assert bf["strides"] == [192] and extent_bytes(bf) == 40 * 96 * 2


@pytest.mark.parametrize("field,value,match", [
    ("dims", [4096, 0], "dims"),
    ("dims", [1 << 33, 6144], "dims"),
    ("strides", [4100], "multiple of 16"),
    ("strides", [2048], "overlaps"),
    ("strides", [1 << 40], "below 2"),
    ("strides", [], "rank"),
    ("box", [128, 257], "1..256"),
    ("box", [120, 128], "multiple of 16"),          # 120 e4m3 bytes
    ("box", [256, 128], "128B"),                    # 256 bytes > the 128-byte swizzle span
    ("box", [128], "rank"),
    ("element_strides", [1, 9], "element strides"),
    ("swizzle", "256B", "swizzle"),
    ("interleave", "32B", "interleave"),
    ("l2_promotion", "512B", "l2_promotion"),
    ("oob_fill", "nan", "floating-point"),          # e4m3 maps as bytes: no NaN fill
    ("oob_fill", "ones", "oob_fill"),
    ("dtype", "float64", "dtype"),
    ("buffer", "", "buffer"),
    ("dims", [4096.0, 6144], "integers"),
])
def test_each_tma_rule_is_enforced(field, value, match):
    s = spec()
    s[field] = value
    with pytest.raises(TensorMapError, match=match):
        check_tensor_map(s)


def test_box_within_dims_and_rank_limits():
    s = matrix_map("xq", FP8, 40, 4096, 40, 128)[1]          # box rows = all 40 rows: fine
    s["box"] = [128, 64]
    with pytest.raises(TensorMapError, match="within dims"):
        check_tensor_map(s)
    s = spec()
    s.update(dims=[16] * 6, strides=[16 << i for i in range(5)], box=[16] * 6, element_strides=[1] * 6)
    with pytest.raises(TensorMapError, match="rank 6"):
        check_tensor_map(s)
    s = spec()
    del s["oob_fill"]
    with pytest.raises(TensorMapError, match="fields"):
        check_tensor_map(s)


def test_fits_its_buffer():
    s = spec()
    check_fits(s, FP8, [6144, 4096], 256)
    with pytest.raises(TensorMapError, match="dtype"):
        check_fits(s, "bfloat16", [6144, 4096], 0)
    with pytest.raises(TensorMapError, match="spans"):
        check_fits(s, FP8, [6143, 4096], 0)
    with pytest.raises(TensorMapError, match="16-byte"):
        check_fits(s, FP8, [6144, 4096], 8)


PARAMS = [{"name": "tw", "type": "tmap"}, {"name": "out", "type": "ptr", "pointee": "float32"},
          {"name": "M", "type": "i32"}]
BUFFERS = {"w": (FP8, [6144, 4096], 0), "y": ("float32", [64, 6144], 1 << 20), "x": ("bfloat16", [6144, 4096], 0)}


def check(args):
    rec = lr.launch("k", [1], [288], 0, args)
    lr.check_launch(rec, PARAMS, lambda n: BUFFERS[n][0], "bfloat16", lambda n: BUFFERS[n][1:])


def test_check_launch_takes_a_tensor_map_for_a_tmap_parameter():
    check([("tmap", spec()), lr.ptr("y"), lr.i32(64)])
    with pytest.raises(KernelBuildError, match="parameter tw is tmap, the record passes ptr"):
        check([lr.ptr("w"), lr.ptr("y"), lr.i32(64)])
    with pytest.raises(KernelBuildError, match="parameter out is ptr, the record passes tmap"):
        check([("tmap", spec()), ("tmap", spec()), lr.i32(64)])
    bad = dict(spec(), buffer="x")
    with pytest.raises(KernelBuildError, match="parameter tw: tensor map of 'x': dtype"):
        check([("tmap", bad), lr.ptr("y"), lr.i32(64)])
    with pytest.raises(KernelBuildError, match="neither an arena buffer nor a weight"):
        check([("tmap", dict(spec(), buffer="nope")), lr.ptr("y"), lr.i32(64)])
    big = dict(spec(), dims=[4096, 6145])
    with pytest.raises(KernelBuildError, match="spans"):
        check([("tmap", big), lr.ptr("y"), lr.i32(64)])


def test_record_round_trip_and_refusal_at_load():
    rec = lr.launch("k", [48, 2], [288], 199680, [("tmap", spec()), lr.ptr("y"), lr.i32(64)])
    d = rec.to_dict()
    assert d["args"][0] == ["tmap", spec()]
    assert LaunchRecord.from_dict(copy.deepcopy(d), "bucket decode_64 op 3") == rec
    d["args"][0][1]["strides"] = [4104]
    with pytest.raises(OpRecordError, match="decode_64 op 3: launch k: tensor map of 'w': stride 4104"):
        LaunchRecord.from_dict(d, "bucket decode_64 op 3")
    d["args"][0] = ["tmap"]
    with pytest.raises(OpRecordError, match="tensor map"):
        LaunchRecord.from_dict(d, "bucket decode_64 op 3")


def test_kernel_signature_and_parameter_block():
    assert parse_param("const __grid_constant__ TmaDesc tw") == {"name": "tw", "type": "tmap"}
    assert TYPE_BYTES["tmap"] == TMAP_BYTES == 128
    raw = bytes(range(128))
    obj, addr = param_value("tmap", raw)
    assert isinstance(obj, TensorMapParam) and addr % TMAP_ALIGN == 0
    assert ctypes.string_at(addr, TMAP_BYTES) == raw
    with pytest.raises(ValueError, match="128 bytes"):
        param_value("tmap", b"\0" * 64)


def test_inspect_names_the_map():
    from xserv_aot.plan.inspect import format_launch
    rec = lr.launch("k", [48, 2], [288], 199680, [("tmap", spec()), lr.ptr("y"), lr.i32(64)])
    assert format_launch(rec, PARAMS) == "k<<<(48, 2, 1), (288, 1, 1), 199680>>>(tw=tmap(w, box 128x128, 128B), out=y, M=64)"

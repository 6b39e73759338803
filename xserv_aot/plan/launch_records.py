"""Launch records (docs/plan-format.md "Launch records"): how plan.kernel_build writes them and how they are checked
against the parsed kernel signatures (plan.signatures) at compile time."""
from __future__ import annotations

from xserv_aot.plan.nvrtc_build import KernelBuildError
from xserv_aot.plan.op_records import KernelChoice, LaunchRecord
from xserv_aot.plan.signatures import SCALAR_TYPES
from xserv_aot.plan.tensor_maps import TensorMapError, check_fits

ARG_KINDS = ("ptr", "kv", "tmap", *sorted(set(SCALAR_TYPES.values())))
APPENDED_PARAMS = {"gemm_library": ("stream",), "nccl": ("comm", "stream")}   # passed by the launcher, per library


def launch(fn: str, grid, block, smem: int = 0, args: list | None = None, pdl: bool = False) -> LaunchRecord:
    """A kernel launch: grid and block padded to three dimensions; pdl: under programmatic dependent launch (the
    kernel waits for its predecessor's output itself: kernels/common.cuh pdl_wait)."""
    g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
    b = tuple(int(x) for x in block) + (1,) * (3 - len(block))
    return LaunchRecord(fn, tuple(args or ()), g, b, int(smem), pdl=bool(pdl))


def kernel(rec: LaunchRecord, **facts) -> KernelChoice:
    """The choice of one kernel launch for an op."""
    return KernelChoice(rec.fn, (rec,), **facts)


def library_call(library: str, fn: str, args: list) -> LaunchRecord:
    """A call of a host library's entry point (the launcher appends the stream)."""
    return LaunchRecord(fn, tuple(args), library=library)


def ptr(name: str | None) -> tuple:
    return ("ptr", name)


def kv(layer: int) -> tuple:
    return ("kv", int(layer))


def i32(v) -> tuple:
    return ("i32", int(v))


def f32(v) -> tuple:
    return ("f32", float(v))


def check_launch(rec: LaunchRecord, params: list[dict], buffer_dtype, kv_dtype: str, buffer_layout=None) -> None:
    """Arguments of one launch record against the function's parameters: count, kind, scalar type, pointee dtype;
    a tensor map against its buffer (plan.tensor_maps.check_fits). buffer_dtype(name) -> dtype of an arena buffer
    or weight (KeyError if neither); buffer_layout(name) -> (shape, byte offset), for tensor maps."""
    fn, args = rec.fn, rec.args
    if len(args) != len(params):
        raise KernelBuildError(f"launch {fn}: {len(args)} arguments for {len(params)} parameters")
    for arg, p in zip(args, params):
        kind, where = arg[0], f"launch {fn}: parameter {p['name']}"
        if kind not in ARG_KINDS:
            raise KernelBuildError(f"{where}: unknown argument kind {kind!r}")
        if (kind in ("ptr", "kv")) != (p["type"] == "ptr") or (p["type"] != "ptr" and kind != p["type"]):
            raise KernelBuildError(f"{where} is {p['type']}, the record passes {kind}")
        if kind == "tmap":
            check_tmap_arg(arg[1], where, buffer_dtype, buffer_layout)
            continue
        if kind == "kv":
            dtype = kv_dtype
        elif kind == "ptr" and arg[1] is not None:
            try:
                dtype = buffer_dtype(arg[1])
            except KeyError:
                raise KernelBuildError(f"{where}: {arg[1]!r} is neither an arena buffer nor a weight") from None
        else:
            continue
        if p["pointee"] is not None and dtype != p["pointee"]:
            raise KernelBuildError(f"{where} points to {p['pointee']}, {arg[1]!r} is {dtype}")


def check_tmap_arg(spec: dict, where: str, buffer_dtype, buffer_layout) -> None:
    try:
        dtype = buffer_dtype(spec["buffer"])
    except KeyError:
        raise KernelBuildError(f"{where}: tensor map of {spec['buffer']!r}, which is neither an arena buffer nor a "
                               f"weight") from None
    shape, offset = buffer_layout(spec["buffer"]) if buffer_layout else (None, 0)
    try:
        check_fits(spec, dtype, shape, offset)
    except TensorMapError as e:
        raise KernelBuildError(f"{where}: {e}") from None


def check_launches(manifest: dict, records, signatures: dict) -> None:
    """Every (bucket name, launch record) against the parsed signature of its function (count, kinds, types,
    pointee dtypes); buffer dtypes from the manifest's arena and weights."""
    arena, weights = manifest["arena"]["buffers"], manifest["weights"]["tensors"]

    def dtype_of(name):
        return (arena.get(name) or weights[name])["dtype"]

    def layout_of(name):
        info = arena.get(name) or weights[name]
        return info["shape"], info["offset"]

    for bucket, rec in records:
        params = signatures.get(rec.fn)
        if params is None:
            raise KernelBuildError(f"bucket {bucket}: launch of {rec.fn!r}, which no kernel defines")
        if rec.library:
            appended = APPENDED_PARAMS.get(rec.library)
            if appended is None:
                raise KernelBuildError(f"bucket {bucket}: launch of {rec.fn!r} from unknown library {rec.library!r}")
            params = params[:-len(appended)]
        check_launch(rec, params, dtype_of, manifest["kv_cache"]["dtype"], layout_of)

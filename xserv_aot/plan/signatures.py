"""`extern "C"` signatures of the kernels (and of the GEMM library's entry point), parsed from the sources and
checked against the compiler's parameter table in each cubin."""
from __future__ import annotations

import re
import struct
from pathlib import Path

from xserv_aot.plan.nvrtc_build import KERNEL_DIR, KernelBuildError, expand_source

SCALAR_TYPES = {"int": "i32", "unsigned": "u32", "unsigned int": "u32", "float": "f32", "u64": "u64",
                "unsigned long long": "u64", "size_t": "u64", "long long": "i64"}
POINTEE_DTYPES = {"bf16": "bfloat16", "float": "float32", "int": "int32", "long long": "int64", "e4m3": "float8_e4m3fn",
                  "void": None}
TYPE_BYTES = {"ptr": 8, "i32": 4, "u32": 4, "f32": 4, "u64": 8, "i64": 8, "tmap": 128}
TENSOR_MAP_TYPE = "TmaDesc"            # kernels/tma.cuh: a tensor map passed by value (`const __grid_constant__`)
_KPARAM_INFO, _SVAL = 0x17, 0x04       # .nv.info attribute: one kernel parameter (ordinal, offset, size)

_DEFINE = re.compile(r"^#define[ \t]+(\w+)\(([^)]*)\)((?:[^\n]*\\\n)*[^\n]*)", re.M)
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?'
                     r'(?:__cluster_dims__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)')


def _expand_macros(text: str) -> str:
    """Expand the function-like macros whose bodies define `extern "C"` kernels, directly or through such macros
    (parameter substitution, ##), outermost first."""
    macros = {}
    for m in _DEFINE.finditer(text):
        macros[m.group(1)] = ([p.strip() for p in m.group(2).split(",")], m.group(3).replace("\\\n", " "))
    kernel_macros = {n for n, (_, body) in macros.items() if 'extern "C"' in body}
    while grown := {n for n, (_, body) in macros.items() if n not in kernel_macros and
                    any(re.search(rf"\b{k}\(", body) for k in kernel_macros)}:
        kernel_macros |= grown
    text = _DEFINE.sub("", text)

    def expand(call):
        params, body = macros[call.group(1)]
        sub = dict(zip(params, (a.strip() for a in call.group(2).split(","))))
        out = re.sub(r"\b\w+\b", lambda t: sub.get(t.group(0), t.group(0)), body)
        return re.sub(r"\s*##\s*", "", out)
    call = re.compile(rf"\b({'|'.join(sorted(kernel_macros))})\(([^)]*)\)") if kernel_macros else None
    while call and call.search(text):
        text = call.sub(expand, text)
    return text


def parse_param(decl: str) -> dict:
    """'const bf16* __restrict__ inp' -> {name, type: ptr|i32|..., pointee: dtype|None}; a tensor map
    'const __grid_constant__ TmaDesc tw' -> {name, type: tmap}."""
    words = decl.replace("*", " * ").replace("__restrict__", " ").replace("__grid_constant__", " ")
    words = words.replace("const", " ").split()
    name, words = words[-1], words[:-1]
    if words == [TENSOR_MAP_TYPE]:
        return {"name": name, "type": "tmap"}
    if "*" in words:
        base = " ".join(w for w in words if w != "*")
        if base not in POINTEE_DTYPES:
            raise KernelBuildError(f"kernel parameter {decl!r}: unknown pointee type {base!r}")
        return {"name": name, "type": "ptr", "pointee": POINTEE_DTYPES[base]}
    base = " ".join(words)
    if base not in SCALAR_TYPES:
        raise KernelBuildError(f"kernel parameter {decl!r}: unknown scalar type {base!r}")
    return {"name": name, "type": SCALAR_TYPES[base]}


def _params(text: str) -> list[dict]:
    text = text.strip()
    return [parse_param(p) for p in text.split(",")] if text else []


def kernel_signatures(source: str) -> dict[str, list[dict]]:
    """{function: [param, ...]} for every `extern "C" __global__` function of kernels/<source>."""
    text = _expand_macros(expand_source(KERNEL_DIR / source))
    return {m.group(1): _params(m.group(2)) for m in _KERNEL.finditer(text)}


def host_signature(path: Path, fn: str) -> list[dict]:
    """Parameters of a host library's `extern "C"` entry point (e.g. xserv_gemm_bf16 in kernels/cutlass/)."""
    m = re.search(rf"\bint\s+{fn}\s*\(([^)]*)\)\s*{{", Path(path).read_text())
    if m is None:
        raise KernelBuildError(f"{path}: no definition of {fn}")
    return _params(m.group(1))


def cubin_param_sizes(cubin: bytes) -> dict[str, list[int]]:
    """{function: [parameter size in bytes, by ordinal]} from the cubin's .nv.info.<function> sections (ELF64)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = secs[shstrndx][4]
    out = {}
    for name_off, _, _, _, off, size in secs:
        name = cubin[names_at + name_off:cubin.index(b"\0", names_at + name_off)].decode()
        if not name.startswith(".nv.info."):
            continue
        params, i, data = {}, 0, cubin[off:off + size]
        while i + 4 <= len(data):
            fmt, attr = data[i], data[i + 1]
            n = struct.unpack_from("<H", data, i + 2)[0] if fmt == _SVAL else 0
            if fmt == _SVAL and attr == _KPARAM_INFO:
                _, ordinal, _, flags = struct.unpack_from("<IHHI", data, i + 4)
                params[ordinal] = (flags >> 18) & 0x3FFF
            i += 4 + n
        out[name[len(".nv.info."):]] = [params[k] for k in sorted(params)]
    return out


def check_sizes(fn: str, params: list[dict], sizes: list[int]) -> None:
    """The parsed signature against the compiler's parameter table of the cubin."""
    mine = [TYPE_BYTES[p["type"]] for p in params]
    if mine != sizes:
        raise KernelBuildError(f"kernel {fn}: parsed parameter sizes {mine} differ from the cubin's {sizes}")

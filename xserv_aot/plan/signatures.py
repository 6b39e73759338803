"""`extern "C"` signatures of the kernels (and of the GEMM library's entry point), parsed from the sources, and the
check of a launch record's arguments against them (docs/plan-format.md, "Launch records")."""
from __future__ import annotations

import re
from pathlib import Path

from xserv_aot.plan.nvrtc_build import KERNEL_DIR, KernelBuildError, expand_source

SCALAR_TYPES = {"int": "i32", "unsigned": "u32", "unsigned int": "u32", "float": "f32", "u64": "u64",
                "unsigned long long": "u64", "size_t": "u64", "long long": "i64"}
POINTEE_DTYPES = {"bf16": "bfloat16", "float": "float32", "int": "int32", "long long": "int64", "void": None}
ARG_KINDS = ("ptr", "kv", *sorted(set(SCALAR_TYPES.values())))

_DEFINE = re.compile(r"^#define[ \t]+(\w+)\(([^)]*)\)((?:[^\n]*\\\n)*[^\n]*)", re.M)
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)')


def _expand_macros(text: str) -> str:
    """Expand the function-like macros whose bodies define `extern "C"` kernels (parameter substitution, ##)."""
    macros = {}
    for m in _DEFINE.finditer(text):
        body = m.group(3).replace("\\\n", " ")
        if 'extern "C"' in body:
            macros[m.group(1)] = ([p.strip() for p in m.group(2).split(",")], body)
    text = _DEFINE.sub("", text)
    for name, (params, body) in macros.items():
        def expand(call, params=params, body=body):
            args = [a.strip() for a in call.group(1).split(",")]
            sub = dict(zip(params, args))
            out = re.sub(r"\b\w+\b", lambda t: sub.get(t.group(0), t.group(0)), body)
            return re.sub(r"\s*##\s*", "", out)
        text = re.sub(rf"^{name}\(([^)]*)\)", expand, text, flags=re.M)
    return text


def parse_param(decl: str) -> dict:
    """'const bf16* __restrict__ inp' -> {name, type: ptr|i32|..., pointee: dtype|None}."""
    words = decl.replace("*", " * ").replace("__restrict__", " ").replace("const", " ").split()
    name, words = words[-1], words[:-1]
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


def check_launch(rec: dict, params: list[dict], buffer_dtype, kv_dtype: str) -> None:
    """Arguments of one launch record against the function's parameters: count, kind, scalar type, pointee dtype.
    buffer_dtype(name) -> dtype of an arena buffer or weight (KeyError if neither)."""
    fn, args = rec["fn"], rec["args"]
    if len(args) != len(params):
        raise KernelBuildError(f"launch {fn}: {len(args)} arguments for {len(params)} parameters")
    for arg, p in zip(args, params):
        kind, where = arg[0], f"launch {fn}: parameter {p['name']}"
        if kind not in ARG_KINDS:
            raise KernelBuildError(f"{where}: unknown argument kind {kind!r}")
        if (kind in ("ptr", "kv")) != (p["type"] == "ptr") or (p["type"] != "ptr" and kind != p["type"]):
            raise KernelBuildError(f"{where} is {p['type']}, the record passes {kind}")
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

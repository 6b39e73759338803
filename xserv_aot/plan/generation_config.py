"""Sampling defaults from the model's generation_config.json, copied into the plan at compile time
(manifest["generation_defaults"]); the server applies them to every request field the request leaves out.

--generation-config auto   the source directory's generation_config.json, when there is one (a GGUF file has none)
                   vllm   no model defaults: the API's own (temperature 1, top_p 1, ...)
                   PATH   a generation_config.json, or a directory holding one
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from xserv_aot.config import ConfigError

FILE = "generation_config.json"
# generation_config key -> (request field, type, lo, hi)
KEYS = {"temperature": ("temperature", float, 0.0, 2.0), "top_p": ("top_p", float, 0.0, 1.0),
        "top_k": ("top_k", int, 0, 2 ** 31 - 1), "min_p": ("min_p", float, 0.0, 1.0),
        "repetition_penalty": ("repetition_penalty", float, 0.01, 2.0), "max_new_tokens": ("max_tokens", int, 1, None)}


def _find(source: Path, choice: str) -> Path | None:
    if choice == "vllm":
        return None
    if choice == "auto":
        d = source if source.is_dir() else source.parent
        return d / FILE if (d / FILE).is_file() and source.suffix != ".gguf" else None
    path = Path(choice)
    path = path / FILE if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"--generation-config {choice}: no {FILE} there (use auto, vllm or a path)")
    return path


def read_generation_defaults(source: Path, choice: str = "auto") -> dict:
    """{request field: default} from the chosen generation_config.json (only the keys the API knows)."""
    path = _find(Path(source), choice)
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable JSON file ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    out = {}
    for key, (field, typ, lo, hi) in KEYS.items():
        v = data.get(key)
        if v is None:
            continue
        ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and \
            (typ is float or float(v).is_integer())
        if not ok or v < lo or (hi is not None and v > hi):
            raise ConfigError(f"{path}: {key} must be a {typ.__name__} in [{lo}, {hi if hi is not None else 'inf'}]"
                              f", got {v!r}")
        out[field] = typ(v)
    return out

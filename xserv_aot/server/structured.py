"""Structured-output request fields -> one GuidedDecoding (plain data the engine compiles with llguidance).

Accepted spellings, at most one per request:
  response_format  {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema",
                   "strict"}} (OpenAI)
  structured_outputs {"json": schema | "regex": str | "choice": [str] | "grammar": str | "json_object": true} (vLLM)
  guided_json / guided_regex / guided_choice / guided_grammar (older vLLM)
"""
from __future__ import annotations

import json

from xserv_aot.engine.api import GuidedDecoding, InvalidRequestError
from xserv_aot.engine.grammar import check_syntax
from xserv_aot.server.request_error import RequestError

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
INVALID = "invalid_structured_output"          # error code of a constraint that does not compile
FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)


def _schema_text(v, where: str) -> str:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise _bad(f"'{where}' must be a JSON schema (an object or its JSON text)", where) from None
    if not isinstance(v, (dict, bool)):
        raise _bad(f"'{where}' must be a JSON schema object", where)
    return json.dumps(v)                        # property order is kept: outputs follow it


def _bad(message: str, where: str) -> RequestError:
    return RequestError(message, param=where.split(".")[0], code=INVALID)


def spec(kind: str, v, where: str) -> GuidedDecoding:
    g = _spec(kind, v, where)
    try:
        check_syntax(g)
    except InvalidRequestError as e:
        raise _bad(f"'{where}': {e}", where) from None
    return g


def _spec(kind: str, v, where: str) -> GuidedDecoding:
    if kind == "json":
        return GuidedDecoding("json", _schema_text(v, where))
    if kind == "json_object":
        if v is not True:
            raise RequestError(f"'{where}' must be true", param=where.split(".")[0])
        return GuidedDecoding("json_object", "")
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise RequestError(f"'{where}' must be a non-empty list of non-empty strings", param=where.split(".")[0])
        return GuidedDecoding("choice", json.dumps(v))
    if not isinstance(v, str) or not v:
        raise RequestError(f"'{where}' must be a non-empty string", param=where.split(".")[0])
    return GuidedDecoding(kind, v)


def _response_format(f) -> GuidedDecoding | None:
    if not isinstance(f, dict) or f.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError("'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                           param="response_format")
    if set(f) - {"type", *(("json_schema",) if f["type"] == "json_schema" else ())}:
        raise RequestError("'response_format' takes only 'type' (and 'json_schema' with type json_schema)",
                           param="response_format")
    if f["type"] == "text":
        return None
    if f["type"] == "json_object":
        return GuidedDecoding("json_object", "")
    js = f.get("json_schema")
    if not isinstance(js, dict) or "schema" not in js or not isinstance(js.get("name", ""), str) or \
            not isinstance(js.get("strict", False), (bool, type(None))):
        raise RequestError("'response_format.json_schema' must be an object with a 'schema' (and optionally a "
                           "string 'name', 'description' and a boolean 'strict')", param="response_format")
    return spec("json", js["schema"], "response_format.json_schema.schema")


def _structured_outputs(so) -> GuidedDecoding:
    if not isinstance(so, dict) or len(so) != 1 or next(iter(so)) not in STRUCTURED_KEYS:
        raise RequestError(f"'structured_outputs' must be an object with exactly one of {', '.join(STRUCTURED_KEYS)}",
                           param="structured_outputs")
    (key, value), = so.items()
    return spec(key, value, f"structured_outputs.{key}")


def parse_guided(body: dict) -> GuidedDecoding | None:
    """The request's structured-output constraint, or None."""
    given = [k for k in FIELDS if body.get(k) is not None]
    if len(given) > 1:
        raise RequestError(f"'{given[0]}' and '{given[1]}' both constrain the output; send one", param=given[1])
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        return _response_format(body[name])
    if name == "structured_outputs":
        return _structured_outputs(body[name])
    return spec(GUIDED_FIELDS[name], body[name], name)

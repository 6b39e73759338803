"""The server's OpenAPI 3.1 document (GET /openapi.json), built from protocol.py's field tables and limits so the
published request schema is the one the parser enforces."""
from __future__ import annotations

from xserv_aot import __version__
from xserv_aot.server import messages as M
from xserv_aot.server import protocol as P
from xserv_aot.server.body import MAX_JSON_DEPTH

NULL = {"type": "null"}
TEMPLATE_KWARG_NAME = M.TEMPLATE_KWARG_NAME


def scalar_schema(s: P.Scalar) -> dict:
    out: dict = {"type": [s.type, "null"]}
    if s.lo is not None:
        out["exclusiveMinimum" if s.lo_open else "minimum"] = s.lo
    if s.hi is not None:
        out["maximum"] = s.hi
    if s.default is not None:
        out["default"] = s.default
    if s.doc:
        out["description"] = s.doc
    return out


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, NULL]}


TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": P.INT64 - 1}}
TEXT = {"type": "string"}


def _common_properties(fields: dict[str, P.Scalar]) -> dict:
    props = {name: scalar_schema(s) for name, s in {**P.SAMPLING_FIELDS, **P.COMMON_FIELDS, **fields}.items()}
    props.update({
        "model": _nullable({"type": "string", "description": "must be the served model's name when set"}),
        "stop": _nullable({"anyOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "maxItems": P.MAX_STOP,
                                      "items": {"type": "string", "minLength": 1}}]}),
        "stop_token_ids": _nullable(TOKEN_IDS),
        "stream_options": _nullable({"type": "object", "description": "needs stream: true",
                                     "properties": {"include_usage": {"type": ["boolean", "null"]}}}),
        "logit_bias": _nullable({"type": "object", "propertyNames": {"pattern": "^[0-9]{1,11}$"},
                                 "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                                 "description": "token id (a string) -> added to its logit"}),
        **STRUCTURED_PROPERTIES,
    })
    return props


SCHEMA = {"type": ["object", "boolean"]}
STRUCTURED_PROPERTIES = {
    "response_format": _nullable({"anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}},
         "propertyNames": {"enum": ["type"]}},
        {"type": "object", "required": ["type", "json_schema"], "propertyNames": {"enum": ["type", "json_schema"]},
         "properties": {"type": {"const": "json_schema"}, "json_schema": {
             "type": "object", "required": ["schema"],
             "properties": {"schema": SCHEMA, "name": TEXT, "description": TEXT,
                            "strict": {"type": ["boolean", "null"]}}}}}]}),
    "structured_outputs": _nullable({"type": "object", "maxProperties": 1, "anyOf": [
        {"required": ["json"], "properties": {"json": {"anyOf": [SCHEMA, TEXT]}}},
        {"required": ["regex"], "properties": {"regex": {"type": "string", "minLength": 1}}},
        {"required": ["choice"], "properties": {"choice": {"type": "array", "minItems": 1,
                                                           "items": {"type": "string", "minLength": 1}}}},
        {"required": ["grammar"], "properties": {"grammar": {"type": "string", "minLength": 1}}},
        {"required": ["json_object"], "properties": {"json_object": {"const": True}}}],
        "description": "vLLM: exactly one of json (a JSON schema), regex, choice, grammar (Lark or GBNF), "
                       "json_object"}),
    "guided_json": _nullable({"anyOf": [SCHEMA, TEXT]}),
    "guided_regex": _nullable({"type": "string", "minLength": 1}),
    "guided_choice": _nullable({"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}),
    "guided_grammar": _nullable({"type": "string", "minLength": 1}),
}
FUNCTION_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.:-]{1,64}$"}
TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": FUNCTION_NAME, "description": _nullable(TEXT), "parameters": _nullable({"type": "object"}),
        "strict": {"type": ["boolean", "null"]}}}}}
TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"],
    "properties": {"type": {"const": "function"},
                   "function": {"type": "object", "required": ["name"], "properties": {"name": TEXT}}}}],
    "description": "required / named: enforced by structured decoding; named must be in tools"}


MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"enum": list(M.ROLES)},
        "content": {"anyOf": [TEXT, NULL, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": TEXT}}}]},
        **{k: _nullable(TEXT) for k in M.MESSAGE_TEXT_KEYS},
        "tool_calls": _nullable({"type": "array", "items": {
            "type": "object", "required": ["function"], "properties": {
                "id": _nullable(TEXT), "type": _nullable({"const": "function"}),
                "function": {"type": "object", "required": ["name"], "properties": {
                    "name": TEXT, "arguments": {"anyOf": [{"type": "object"}, TEXT, NULL],
                                                "description": "an object or its JSON text"}}}}}}),
    },
    "description": "other keys are ignored; message text is data, never template source",
}

CHAT_REQUEST = {
    "type": "object", "required": ["messages"],
    "properties": {
        **_common_properties(P.CHAT_FIELDS),
        "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
        "chat_template_kwargs": _nullable({
            "type": "object", "description": "extra variables for the model's chat template",
            "propertyNames": {"pattern": TEMPLATE_KWARG_NAME,
                              "not": {"enum": sorted(M.RESERVED_TEMPLATE_KWARGS)}}}),
        "chat_template": {"type": "null", "description": "not accepted: the model's own template is always used"},
        "tools": _nullable({"type": "array", "items": TOOL}),
        "tool_choice": _nullable(TOOL_CHOICE),
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        **{name: {"description": "accepted, no effect on the output"} for name in sorted(P.IGNORED_FIELDS)},
    },
    "additionalProperties": False,
}

COMPLETION_REQUEST = {
    "type": "object", "required": ["prompt"],
    "properties": {
        **_common_properties(P.COMPLETION_FIELDS),
        "prompt": {"anyOf": [{"type": "string", "minLength": 1}, {**TOKEN_IDS, "minItems": 1},
                             {"type": "array", "minItems": 1, "maxItems": P.MAX_PROMPTS,
                              "items": {"anyOf": [{"type": "string", "minLength": 1}, {**TOKEN_IDS, "minItems": 1}]}}]},
        "suffix": {"anyOf": [NULL, {"type": "string", "maxLength": 0}], "description": "not supported"},
        **{name: {"description": "accepted, no effect on the output"} for name in sorted(P.IGNORED_FIELDS)},
    },
    "additionalProperties": False,
}

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": TEXT, "type": TEXT, "param": _nullable(TEXT), "code": _nullable(TEXT)}}}}

USAGE = {"type": "object", "properties": {k: {"type": "integer"} for k in
                                          ("prompt_tokens", "completion_tokens", "total_tokens")}}
MODEL = {"type": "object", "required": ["id", "object"],
         "properties": {"id": TEXT, "object": {"const": "model"}, "max_model_len": {"type": "integer"}}}

ERROR_STATUSES = {"400": "invalid request", "401": "missing or wrong API key", "404": "unknown model or route",
                  "413": "body above --max-request-bytes", "429": "waiting queue full (see Retry-After)",
                  "431": "request headers too large", "500": "generation failed",
                  "503": "draining for shutdown, or the engine is unavailable",
                  "504": "the request ran past --request-timeout"}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(*codes: str) -> dict:
    return {c: {"description": ERROR_STATUSES[c], "content": {"application/json": {"schema": _ref("Error")}}}
            for c in codes}


def _generate_op(summary: str, request: str) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "a response object, or server-sent events when stream is true",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          "text/event-stream": {"schema": TEXT}}},
                      **_errors("400", "401", "404", "413", "429", "431", "500", "503", "504")}}}


def _get_op(summary: str, media: str = "application/json", schema: dict | None = None, secured: bool = True,
            extra: tuple[str, ...] = ()) -> dict:
    op = {"summary": summary, "responses": {
        "200": {"description": "ok", "content": {media: {"schema": schema or {"type": "object"}}}},
        **_errors(*(("401",) if secured else ()), *extra)}}
    if not secured:
        op["security"] = []
    return {"get": op}


TOKENIZE_REQUEST = {"type": "object", "properties": {
    "model": _nullable(TEXT), "prompt": _nullable(TEXT), "messages": _nullable({"type": "array", "items": MESSAGE}),
    "add_special_tokens": {"type": ["boolean", "null"], "default": True},
    "add_generation_prompt": {"type": ["boolean", "null"], "default": True},
    "chat_template_kwargs": CHAT_REQUEST["properties"]["chat_template_kwargs"],
    "tools": CHAT_REQUEST["properties"]["tools"], "return_token_strs": {"type": ["boolean", "null"]}},
    "description": "exactly one of prompt and messages", "additionalProperties": False}
DETOKENIZE_REQUEST = {"type": "object", "required": ["tokens"], "additionalProperties": False,
                      "properties": {"model": _nullable(TEXT), "tokens": TOKEN_IDS}}


def _post_op(summary: str, request: dict) -> dict:
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                     "responses": {"200": {"description": "ok", "content": {"application/json": {
                         "schema": {"type": "object"}}}}, **_errors("400", "401", "404", "413")}}}


def openapi_document(model_name: str, max_request_bytes: int, secured: bool,
                     open_paths: tuple[str, ...] = ("/health",)) -> dict:
    """secured: an API key is configured (every operation but those on open_paths needs a bearer token)."""
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "xserv-aot OpenAI-compatible API", "version": __version__,
                 "description": f"Serves '{model_name}'. Request bodies: at most {max_request_bytes} bytes of "
                                f"UTF-8 JSON, nested at most {MAX_JSON_DEPTH} levels, no lone surrogates."},
        "paths": {
            "/v1/chat/completions": _generate_op("Chat completion", "ChatCompletionRequest"),
            "/v1/completions": _generate_op("Text completion", "CompletionRequest"),
            "/v1/models": _get_op("List models", schema={"type": "object", "properties": {
                "object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}}),
            "/v1/models/{model}": {**_get_op("Retrieve a model", schema=_ref("Model"), extra=("404",)),
                                   "parameters": [{"name": "model", "in": "path", "required": True,
                                                   "schema": TEXT}]},
            "/health": _get_op("Liveness and readiness (503 while draining or when the engine is unhealthy)",
                               secured=False, extra=("503",)),
            "/version": _get_op("Server version"),
            "/metrics": _get_op("Prometheus metrics (xserv_* and vLLM's vllm:* names)", media="text/plain",
                                schema=TEXT, secured="/metrics" not in open_paths),
            "/tokenize": _post_op("Token ids of a prompt or of chat messages (vLLM's shape)", TOKENIZE_REQUEST),
            "/detokenize": _post_op("Text of token ids (vLLM's shape)", DETOKENIZE_REQUEST),
            "/openapi.json": _get_op("This document"),
        },
        "components": {"schemas": {"ChatCompletionRequest": CHAT_REQUEST, "CompletionRequest": COMPLETION_REQUEST,
                                   "Error": ERROR, "Usage": USAGE, "Model": MODEL}},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    else:
        for path in doc["paths"].values():
            for op in path.values():
                if isinstance(op, dict):
                    op.pop("security", None)
                    op["responses"].pop("401", None)
    return doc

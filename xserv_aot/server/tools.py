"""Function calling: `tools` / `tool_choice` parsing, the grammar that enforces a call, and the tool-call parsers.

tool_choice:
  "none"      tools reach the chat template, the output is plain content
  "auto"      (default with tools) the model may call; the model's parser extracts calls from the text
  "required"  the output is forced (structured decoding) to a JSON array of {"name", "arguments"} objects, >= 1
  {"type": "function", "function": {"name": N}}   forced to the arguments object of N
Parsers for "auto", chosen from the chat template unless --tool-call-parser says otherwise:
  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5, Qwen3, Hermes)
  llama3_json  {"name": ..., "parameters": {...}} [; {...}] as the whole reply (Llama 3.x)
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from xserv_aot.engine.api import GuidedDecoding
from xserv_aot.server.request_error import RequestError

PARSERS = ("hermes", "llama3_json", "none")
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
HERMES_CALL = re.compile(re.escape(TOOL_CALL_START) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_END), re.DOTALL)


@dataclass
class ToolSpec:
    tools: list[dict]                               # OpenAI shape, as the chat template reads them
    choice: str                                     # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True                           # parallel_tool_calls: more than one call per reply

    @property
    def schemas(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}


@dataclass
class ToolCall:
    name: str
    arguments: str                                  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def default_parser(chat_template: str | None) -> str:
    t = chat_template if isinstance(chat_template, str) else ""
    return "llama3_json" if "<|python_tag|>" in t or "ipython" in t else "hermes"


def _tool(t, i: int) -> dict:
    where = f"tools[{i}]"
    fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not FUNCTION_NAME.match(fn["name"]):
        raise RequestError(f"{where} must be {{'type': 'function', 'function': {{'name': ...}}}} with a name of "
                           "1-64 letters, digits, '_', '.', ':' or '-'", param="tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise RequestError(f"{where}.function.parameters must be a JSON schema object", param="tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise RequestError(f"{where}.function.description must be a string", param="tools")
    out = {"name": fn["name"], **({"description": fn["description"]} if fn.get("description") else {}),
           "parameters": params or {"type": "object", "properties": {}}}
    if fn.get("strict") is not None:
        out["strict"] = bool(fn["strict"])
    return {"type": "function", "function": out}


def parse_tools(body: dict) -> ToolSpec | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise RequestError("'tool_choice' required or a named function needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    spec = ToolSpec([_tool(t, i) for i, t in enumerate(tools)], "auto", parallel=parallel is not False)
    names = [t["function"]["name"] for t in spec.tools]
    if len(set(names)) != len(names):
        raise RequestError("'tools' names must be unique", param="tools")
    if choice is None or choice in ("auto", "none", "required"):
        spec.choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise RequestError(f"'tool_choice' names {str(name)[:64]!r}, which is not in 'tools'",
                               param="tool_choice")
        spec.choice, spec.named = "named", name
    else:
        raise RequestError("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                           "'function': {'name': ...}}", param="tool_choice")
    return spec


def forced_grammar(spec: ToolSpec) -> GuidedDecoding | None:
    """The constraint that makes the output a valid call (required / named), else None."""
    schemas = spec.schemas
    if spec.choice == "named":
        return GuidedDecoding("json", json.dumps(schemas[spec.named]))
    if spec.choice != "required":
        return None
    one = [{"type": "object", "properties": {"name": {"const": n}, "arguments": s},
            "required": ["name", "arguments"], "additionalProperties": False} for n, s in schemas.items()]
    array = {"type": "array", "minItems": 1, "items": {"anyOf": one}, **({} if spec.parallel else {"maxItems": 1})}
    return GuidedDecoding("json", json.dumps(array))


def _call(obj, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_forced(spec: ToolSpec, text: str) -> list[ToolCall] | None:
    """Calls from a grammar-forced output (None when it does not parse: the generation was cut short)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if spec.choice == "named":
        return [ToolCall(spec.named, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else None
    calls = [_call(v, "arguments") for v in value] if isinstance(value, list) else [None]
    return None if any(c is None for c in calls) else calls


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """(text outside the calls, calls); a <tool_call> block that does not hold a call stays in the text."""
    calls, kept, pos = [], [], 0
    for m in HERMES_CALL.finditer(text):
        try:
            call = _call(json.loads(m.group(1)), "arguments")
        except ValueError:
            call = None
        if call is None:
            continue                                 # not a call: stays in the content
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    return "".join(kept), calls


def parse_llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    dec, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, i = dec.raw_decode(body, i)
        except ValueError:
            return text, []
        call = _call(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        while i < len(body) and body[i] in " \t\n;":
            i += 1
    return "", calls


def parse_all(spec: ToolSpec, parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """Whole-text form of StreamingToolParser (so streamed and non-streamed replies agree)."""
    p = StreamingToolParser(spec, parser)
    c1, k1 = p.feed(text)
    c2, k2 = p.flush()
    return c1 + c2, k1 + k2


class StreamingToolParser:
    """Incremental form of parse_auto / parse_forced for one choice: feed text deltas, get (content, calls) that
    are now certain. Hermes content streams; a <tool_call> block is held until it closes. llama3_json and forced
    outputs are held to the end when they start like a call."""

    def __init__(self, spec: ToolSpec, parser: str):
        self.spec, self.parser = spec, parser
        self._buf, self._whole = "", spec.choice in ("required", "named")
        self._num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return self._limit(*self._feed(text))

    def flush(self) -> tuple[str, list[ToolCall]]:
        return self._limit(*self._flush())

    def _limit(self, content: str, calls: list[ToolCall]) -> tuple[str, list[ToolCall]]:
        """parallel_tool_calls false: calls after the first are dropped."""
        if not self.spec.parallel:
            calls = calls[:max(0, 1 - self._num_calls)]
        self._num_calls += len(calls)
        return content, calls

    def _feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        if self._whole:
            return "", []
        if self.parser == "llama3_json":
            head = self._buf.lstrip()
            if head.startswith("{") or head.startswith("<|python_tag|>") or not head:
                self._whole = bool(head)
                return "", []
            self.parser = "none"
        if self.parser != "hermes":
            out, self._buf = self._buf, ""
            return out, []
        content, calls = [], []
        while self._buf:
            start = self._buf.find(TOOL_CALL_START)
            if start < 0:
                keep = next((n for n in range(min(len(self._buf), len(TOOL_CALL_START) - 1), 0, -1)
                             if self._buf.endswith(TOOL_CALL_START[:n])), 0)
                content.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            end = self._buf.find(TOOL_CALL_END, start)
            if end < 0:
                content.append(self._buf[:start])
                self._buf = self._buf[start:]
                break
            content.append(self._buf[:start])
            block, self._buf = self._buf[start:end + len(TOOL_CALL_END)], self._buf[end + len(TOOL_CALL_END):]
            found = parse_hermes(block)[1]
            calls += found
            if not found:
                content.append(block)                # not a call: it is content
        return "".join(content), calls

    def _flush(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        if self.spec.choice in ("required", "named"):
            calls = parse_forced(self.spec, rest)
            return ("", calls) if calls is not None else (rest, [])
        if self._whole:
            return parse_llama3_json(rest)
        return rest, []

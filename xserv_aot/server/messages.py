"""Chat messages and chat_template_kwargs -> what the model's chat template reads.

Messages are data: their text never becomes template source, and only the known message keys reach the template.
The developer role is rendered as system; an assistant turn's tool calls carry their arguments as an object.
"""
from __future__ import annotations

import json
import re

from xserv_aot.server.request_error import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
TEMPLATE_ROLE = {"developer": "system"}          # OpenAI's newer name for the system role
MESSAGE_TEXT_KEYS = ("name", "tool_call_id", "reasoning_content", "reasoning", "thinking")
TEMPLATE_KWARG_NAME = "^[A-Za-z][A-Za-z0-9_]*$"
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tools", "documents", "bos_token",
                                      "eos_token", "unk_token", "pad_token", "chat_template", "raise_exception",
                                      "strftime_now"})



def parse_message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError(f"{where} must be an object with a string 'role'", param="messages")
    if m["role"] not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}", param="messages")
    role = TEMPLATE_ROLE.get(m["role"], m["role"])
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise RequestError(f"{where}.content: only text parts are supported", param="messages")
            parts.append(p["text"])
        content = "\n".join(parts)
    elif content is not None and not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string, a list of text parts or null", param="messages")
    out = {"role": role, "content": content if content is not None else ""}
    for key in MESSAGE_TEXT_KEYS:
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise RequestError(f"{where}.{key} must be a string", param="messages")
            out[key] = m[key]
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls must be a list of objects", param="messages")
        if calls:
            out["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    return out


def _history_call(c, where: str) -> dict:
    """An assistant turn's tool call as chat templates read it: arguments as an object (Llama templates apply
    tojson to it; Qwen templates take either)."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                           param="messages")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise RequestError(f"{where}.function.arguments must be a JSON object text", param="messages") from None
    if args is not None and not isinstance(args, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object", param="messages")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args or {}}}
    if isinstance(c.get("id"), str):
        out["id"] = c["id"]
    return out


def template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    for k in kwargs:
        if not re.fullmatch(TEMPLATE_KWARG_NAME[1:-1], k) or k in RESERVED_TEMPLATE_KWARGS:
            raise RequestError(f"'chat_template_kwargs' may not set {k[:40]!r}", param="chat_template_kwargs")
    return kwargs

"""/tokenize and /detokenize in vLLM's shapes.

POST /tokenize    {"prompt": str, "add_special_tokens": true}
               or {"messages": [...], "add_generation_prompt": true, "chat_template_kwargs": {}, "tools": [...]}
                  both with "model"?, "return_token_strs": false
               -> {"count", "max_model_len", "tokens": [ids], "token_strs": [str] | null}
POST /detokenize  {"model"?, "tokens": [ids]} -> {"prompt": str}
"""
from __future__ import annotations

from xserv_aot.server import protocol as P

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "chat_template_kwargs", "tools", "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def _flag(body: dict, name: str, default: bool) -> bool:
    return P.scalar(body, name, P.Scalar("boolean", default))


def parse_tokenize(body) -> dict:
    """{"prompt": str} or {"messages": [...], "chat_template_kwargs", "tools"}, plus the flags; RequestError else."""
    if not isinstance(body, dict):
        raise P.RequestError("request body must be a JSON object")
    P.check_fields(body, TOKENIZE_FIELDS)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise P.RequestError("send exactly one of 'prompt' (a string) and 'messages'", param="prompt")
    out = {"model": body.get("model"), "return_token_strs": _flag(body, "return_token_strs", False)}
    if has_prompt:
        if not isinstance(body["prompt"], str):
            raise P.RequestError("'prompt' must be a string", param="prompt")
        return {**out, "prompt": body["prompt"], "add_special_tokens": _flag(body, "add_special_tokens", True)}
    chat = P.parse_chat_request({k: body.get(k) for k in ("model", "messages", "chat_template_kwargs", "tools")})
    return {**out, "chat": chat, "add_generation_prompt": _flag(body, "add_generation_prompt", True)}


def parse_detokenize(body, vocab_size: int | None) -> list[int]:
    if not isinstance(body, dict):
        raise P.RequestError("request body must be a JSON object")
    P.check_fields(body, DETOKENIZE_FIELDS)
    ids = P.token_ids(body.get("tokens"), "tokens")
    bad = [t for t in ids if vocab_size and t >= vocab_size]
    if bad:
        raise P.RequestError(f"token id {bad[0]} is out of range (vocabulary size {vocab_size})", param="tokens")
    return ids


def tokenize_body(ids: list[int], max_model_len: int, token_strs: list[str] | None) -> dict:
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}

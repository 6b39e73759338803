"""Tokenizer: HF `tokenizers` backend + the model's own special tokens, eos ids and jinja2 chat template.

Loaded from a HF tokenizer directory (tokenizer.json + tokenizer_config.json [+ generation_config.json,
config.json]) or from a GGUF file's embedded metadata; `save` writes a directory `from_dir` reloads.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend

from xserv_aot.errors import XservError
from xserv_aot.special_text import BYTE_DECODER, REASONING_KEYS, special_pattern, special_text_spans


class TokenizerError(XservError, ValueError):
    """Bad tokenizer files or chat input; the message is one line naming the file or field."""


_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: invalid JSON ({_one_line(e)})") from None


def _token_str(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string, or an AddedToken-like dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF assistant-mask marker): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template syntax error at line {e.lineno}: {e.message}") from None


def _template_message(i: int, message: Any) -> dict:
    """Drop None-valued keys and expose reasoning under every name templates read."""
    if not isinstance(message, dict):
        raise TokenizerError(f"chat message {i} is a {type(message).__name__}, expected a dict")
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in REASONING_KEYS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _bos_eos_processor(backend: Backend, config: dict[str, Any]) -> processors.TemplateProcessing:
    """Post-processor that adds BOS/EOS around a single sequence as `add_bos_token` / `add_eos_token` say."""
    pre, post, specials = [], [], []
    for flag, key, side in (("add_bos_token", "bos_token", pre), ("add_eos_token", "eos_token", post)):
        tok = config.get(key)
        if config.get(flag) and tok is not None:
            tid = backend.token_to_id(tok)
            if tid is None:
                raise TokenizerError(f"tokenizer config: {key} {tok!r} is not in the vocabulary")
            side.append(tok)
            specials.append((tok, tid))

    def seq(name: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in pre] + [f"${name}:{type_id}"] + [f"{t}:{type_id}" for t in post]

    single = " ".join(seq("A", 0))
    pair = " ".join(seq("A", 0) + seq("B", 1))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


class Tokenizer:
    def __init__(self, backend: Backend, config: dict[str, Any], eos_token_ids: list[int]):
        self._backend = backend
        self.config = {k: config.get(k) for k in (*_SPECIAL_KEYS, "add_bos_token", "add_eos_token", "chat_template")}
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            backend.post_processor = _bos_eos_processor(backend, self.config)
        self.eos_token_ids: list[int] = []
        for i in [self._special_id("eos_token"), *eos_token_ids]:
            if i is not None and i not in self.eos_token_ids:
                self.eos_token_ids.append(i)
        self.bos_token_id: int | None = self._special_id("bos_token")
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        named = {self._special_id(k) for k in _SPECIAL_KEYS} - {None}
        added = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.all_special_ids: set[int] = named | added | set(self.eos_token_ids)
        self._template: jinja2.Template | None = None
        self._plain_backend: Backend | None = None
        self._added_ids: set[int] | None = None      # lazy, for token_bytes
        self._byte_level = False
        self._special_re = None                      # alternation of the special tokens' texts (lazy)

    def _special_id(self, key: str) -> int | None:
        tok = self.config.get(key)
        if tok is None:
            return None
        tid = self._backend.token_to_id(tok)
        if tid is None:
            raise TokenizerError(f"tokenizer config: {key} {tok!r} is not in the vocabulary")
        return tid

    @classmethod
    def from_dir(cls, path: Path) -> "Tokenizer":
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"{tj}: missing (a tokenizer directory needs tokenizer.json)")
        try:
            backend = Backend.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - the Rust loader raises plain Exception
            raise TokenizerError(f"{tj}: cannot load ({_one_line(e)})") from None
        cfg_path = path / "tokenizer_config.json"
        raw = _read_json(cfg_path) if cfg_path.is_file() else {}
        if not isinstance(raw, dict):
            raise TokenizerError(f"{cfg_path}: expected a JSON object")
        config: dict[str, Any] = {k: _token_str(raw.get(k)) for k in _SPECIAL_KEYS}
        config.update({k: bool(raw[k]) for k in ("add_bos_token", "add_eos_token") if k in raw})
        config["chat_template"] = cls._find_template(path, raw.get("chat_template"))
        for tid, entry in sorted((raw.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
            content = entry.get("content") if isinstance(entry, dict) else None
            if content is None or backend.token_to_id(content) is not None:
                continue
            tok = AddedToken(content, special=bool(entry.get("special")), normalized=bool(entry.get("normalized")),
                             lstrip=bool(entry.get("lstrip")), rstrip=bool(entry.get("rstrip")))
            backend.add_special_tokens([tok]) if entry.get("special") else backend.add_tokens([tok])
            if backend.token_to_id(content) != int(tid):
                raise TokenizerError(f"{cfg_path}: added token {content!r} declared as id {tid} "
                                     f"but got id {backend.token_to_id(content)}")
        eos = _as_id_list(raw.get("eos_token_ids"))
        for name in ("generation_config.json", "config.json"):
            if (path / name).is_file():
                data = _read_json(path / name)
                try:
                    eos += _as_id_list(data.get("eos_token_id") if isinstance(data, dict) else None)
                except (TypeError, ValueError):
                    raise TokenizerError(f"{path / name}: eos_token_id must be an int or a list of ints") from None
        return cls(backend, config, eos)

    @staticmethod
    def _find_template(path: Path, value: Any) -> str | None:
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            return named.get("default")
        return value if isinstance(value, str) else None

    @classmethod
    def from_gguf(cls, path: Path) -> "Tokenizer":
        from xserv_aot.gguf_tokenizer import build_gguf_tokenizer

        backend, config = build_gguf_tokenizer(Path(path))
        return cls(backend, config, config.pop("eos_token_ids"))

    def save(self, out_dir: Path) -> None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(out_dir / "tokenizer.json"))
        config = {k: v for k, v in self.config.items() if v is not None}
        config["eos_token_ids"] = list(self.eos_token_ids)
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                       encoding="utf-8")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for (possibly part of a UTF-8 character); added tokens: their text."""
        if self._added_ids is None:
            self._added_ids = set(self._backend.get_added_tokens_decoder())
            self._byte_level = "ByteLevel" in json.dumps(json.loads(self._backend.to_str()).get("decoder"))
        piece = self._backend.id_to_token(int(i))
        if piece is None:
            return b""                               # a model row past the vocabulary: decodes to "" too
        if int(i) in self._added_ids or not self._byte_level or any(c not in BYTE_DECODER for c in piece):
            return self.decode([int(i)], skip_special_tokens=False).encode("utf-8")
        return bytes(BYTE_DECODER[c] for c in piece)

    def id_to_token(self, i: int) -> str | None:
        return self._backend.id_to_token(int(i))

    def token_to_id(self, s: str) -> int | None:
        return self._backend.token_to_id(s)

    @property
    def chat_template(self) -> str | None:
        return self.config.get("chat_template")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> str:
        if not self.chat_template:
            raise TokenizerError("model has no chat template")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        context = {k: self.config[k] for k in _SPECIAL_KEYS if self.config.get(k) is not None}
        context.update(template_kwargs)
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        msgs = [_template_message(i, m) for i, m in enumerate(messages)]
        try:
            return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt, **context)
        except _RENDER_ERRORS as e:
            raise TokenizerError(f"chat template: {_one_line(e)}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    special_tokens_in_content: bool = False, **template_kwargs) -> list[int]:
        """The rendered chat template's ids. Special-token text inside message content (a user writing
        `<|im_end|>`) stays text unless special_tokens_in_content: only the template makes control tokens."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        spans = [] if special_tokens_in_content else self._special_text_spans(text, messages)
        ids, pos = [], 0
        for begin, end in spans:
            ids += self.encode(text[pos:begin], add_special_tokens=False)
            ids += self._plain().encode(text[begin:end], add_special_tokens=False).ids
            pos = end
        return ids + self.encode(text[pos:], add_special_tokens=False)

    def _plain(self) -> Backend:
        """A second backend that encodes special-token text as ordinary text (a copy: the flag is not per call)."""
        if self._plain_backend is None:
            plain = Backend.from_str(self._backend.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return self._plain_backend

    def _special_text_spans(self, text: str, messages: list[dict]) -> list[tuple[int, int]]:
        if self._special_re is None:
            self._special_re = special_pattern([t.content for t in self._backend.get_added_tokens_decoder().values()
                                                if t.special])
        return special_text_spans(text, messages, self._special_re)

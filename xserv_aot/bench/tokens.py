"""Where the benchmark counts tokens: a local tokenizer (--tokenizer DIR), else the server's /tokenize, else words.

Each counter has count(texts, add_special_tokens) -> [int] and `exact` (False only for the word count).
"""
from __future__ import annotations

from pathlib import Path

import httpx


class LocalCounter:
    exact = True

    def __init__(self, path: Path):
        from xserv_aot.tokenizer import Tokenizer

        path = Path(path)
        if path.is_file() and path.name == "tokenizer.json":
            path = path.parent
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer {path}: no tokenizer.json there (give a tokenizer or plan directory)")
        self.tokenizer = Tokenizer.from_dir(path)
        self.source = f"tokenizer {path}"

    def count(self, texts: list[str], add_special_tokens: bool = True) -> list[int]:
        return [len(self.tokenizer.encode(t, add_special_tokens=add_special_tokens)) for t in texts]


class ServerCounter:
    """vLLM's POST /tokenize: {"model", "prompt", "add_special_tokens"} -> {"count" | "tokens"}."""
    exact = True

    def __init__(self, base_url: str, model: str, headers: dict, client: httpx.Client | None = None):
        self.url, self.model, self.headers = base_url.rstrip("/") + "/tokenize", model, headers
        self.client = client or httpx.Client(timeout=30.0)
        self.source = f"server {self.url}"

    def count(self, texts: list[str], add_special_tokens: bool = True) -> list[int]:
        out = []
        for t in texts:
            r = self.client.post(self.url, headers=self.headers,
                                 json={"model": self.model, "prompt": t, "add_special_tokens": add_special_tokens})
            if r.status_code != 200:
                raise ValueError(f"{self.url}: HTTP {r.status_code} while counting tokens")
            body = r.json()
            out.append(int(body["count"]) if "count" in body else len(body["tokens"]))
        return out

    def available(self) -> bool:
        try:
            return len(self.count([" probe"], add_special_tokens=False)) == 1
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False


class WordCounter:
    """No tokenizer at all: one word = one token (input lengths are then approximate)."""
    exact = False
    source = "word count (approximate)"

    def count(self, texts: list[str], add_special_tokens: bool = True) -> list[int]:
        return [len(t.split()) for t in texts]


def make_counter(tokenizer: Path | None, base_url: str, model: str, headers: dict):
    if tokenizer is not None:
        return LocalCounter(tokenizer)
    server = ServerCounter(base_url, model, headers)
    return server if server.available() else WordCounter()

"""The error every request parser raises (server/protocol.py re-exports it)."""
from __future__ import annotations


class RequestError(ValueError):
    """A request the server refuses; becomes an OpenAI error body with this status."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

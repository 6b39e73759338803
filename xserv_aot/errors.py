"""The one base class of user-facing errors: bad input, bad files, a missing driver. The CLI prints these as one
`error: ...` line; anything else is a bug and keeps its traceback."""
from __future__ import annotations


class XservError(Exception):
    """An error the user can fix; the message is one line naming the file, tensor, field or option."""


def one_line(text: object) -> str:
    return " ".join(str(text).split())


class UsageError(XservError, ValueError):
    """A command-line option or argument out of range."""

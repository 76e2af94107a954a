"""Errors raised by the grammar package."""
from __future__ import annotations

from typing import Optional


class GrammarError(ValueError):
    """A grammar (JSON schema, regex, EBNF, choice) was refused or failed to compile.

    ``keyword`` names the JSON Schema keyword responsible (None when not applicable) and
    ``path`` is the JSON pointer of the (sub)schema holding it ("" is the schema root; None when
    not applicable). The HTTP server turns this into a 400 naming both.
    """

    def __init__(self, message: str, keyword: Optional[str] = None, path: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.keyword = keyword
        self.path = path

    def to_dict(self) -> dict:
        return {"message": self.message, "keyword": self.keyword, "path": self.path}


class GrammarTooComplex(GrammarError):
    """A grammar whose compile ran past the compile timeout: valid, but too large or complex to
    compile in time (the server answers 400 `grammar_too_complex`, not "invalid")."""


def at(path: str) -> str:
    return f"at {path}" if path else "at the schema root"


def unsupported(keyword: str, path: str, why: str = "") -> GrammarError:
    msg = f"unsupported JSON Schema keyword '{keyword}' {at(path)}"
    if why:
        msg += f" ({why})"
    return GrammarError(msg, keyword=keyword, path=path)


class GrammarBusy(RuntimeError):
    """More distinct grammars wait to compile than the queue holds: a load problem, not the
    grammar's (the server answers 503 with Retry-After)."""

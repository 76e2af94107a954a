"""One meaning for a regex constraint under both backends: ECMA-262's (JavaScript's, no flags), the
meaning JSON Schema gives `pattern`.

The backends read a regex constraint differently where it shows in answers (xgrammar 0.2,
llguidance 1.9, measured by accepting strings):
  `\\d`, `\\w` (and `\\D`, `\\W`): ASCII under xgrammar, any Unicode digit or letter under llguidance,
      so `\\d{4}` once answered four U+1FBF0 digits there, which JavaScript's `\\d` does not match;
  `.`: any character under xgrammar, so `a.*` could answer a newline, which neither JavaScript's
      nor Python's `.` matches; any but `\\n` under llguidance.
As a request can move between backends (`auto`), both get the pattern rewritten to ECMA's meaning:
`\\d` is [0-9], `\\w` [0-9A-Za-z_] (llguidance's own rewrite, the one it applies to JSON Schema
patterns, done by `llguidance_backend`), and `.` any character but a line terminator (\\n, \\r,
U+2028, U+2029). An answer under that meaning is matched by JavaScript's RegExp and by Python's
`re.fullmatch` alike. Syntax the dialects read apart (`\\A`, `\\z`, `\\p{L}`, `(?i)`) is refused under
both (`_ecma_syntax_only`), and what xgrammar's parser refuses (`a**`) is refused under llguidance
too (`llguidance_backend`).
"""
from __future__ import annotations

from .errors import GrammarError
from .regex_scan import control_letter, edge_anchors, hex_code, regex_pieces, scan_regex

__all__ = ["as_ecma"]

# ECMA-262's `.` outside the s flag: anything but a line terminator
_DOT = "[^\\n\\r\\u2028\\u2029]"


def as_ecma(pattern: str) -> str:
    """The pattern as both backends are to read it (ECMA's `.`), or GrammarError for syntax the
    dialects read apart."""
    return _ecma_dot(_edge_anchors_only(_ecma_syntax_only(pattern)))


# the escapes of ECMA-262's regexes (no flags) that stand for something other than their letter;
# after `c` a control letter, after `x` two hex digits, after `u` four; and `\\U` with eight, a
# code point past U+FFFF, which JavaScript has no escape for without its u flag and both backends read
_ECMA_ESCAPE_LETTERS = set("dDwWsSbBtnvfr0cxuU")
_HEX_WIDTH = {"x": 2, "u": 4, "U": 8}


def _ecma_syntax_only(pattern: str) -> str:
    """The pattern, or GrammarError for syntax JavaScript reads otherwise than another dialect:
    a letter escape JavaScript does not define (`\\A`, `\\z`: JavaScript reads the letter, Python
    and llguidance an anchor; `\\p{L}`: `p{L}` to JavaScript without its u flag, a Unicode class to
    llguidance), backreferences, a lone `\\` at the end, and `(?` groups other than JavaScript's
    (inline flags `(?i)`, Python's `(?P<n>`). The backends disagreed on each (QA 1130 D1, D2)."""
    for i, piece, in_class in regex_pieces(pattern):
        if piece == "\\":
            raise GrammarError("the regex ends with a lone backslash (escape it as \\\\ for a backslash)")
        if piece.startswith("\\"):
            _check_escape(pattern, i)
        elif piece == "(" and not in_class and not _javascript_group(pattern, i):
            raise GrammarError(f"the group {pattern[i:i + 4]!r}... is not JavaScript's regex syntax (inline flags and "
                               "Python's (?P<name>...) are not supported)")
    return pattern


def _check_escape(pattern: str, at: int) -> None:
    """GrammarError if the escape at `at` is a backreference or a letter escape JavaScript reads as
    its letter where other dialects read something else."""
    e = pattern[at + 1]
    if e.isdigit() and e != "0" or e == "k":
        raise GrammarError(f"backreferences (\\{e}) are not supported in a regex constraint")
    if e.isascii() and e.isalpha() and (e not in _ECMA_ESCAPE_LETTERS or not _escape_complete(pattern, at + 1)):
        hint = (" (a regex constraint matches the whole answer: leave the anchor out)" if e in "AzZ"
                else f" (write {e!r} for the letter)")
        raise GrammarError(f"\\{pattern[at + 1:at + 3] if e in 'xuU' else e} is not an escape of JavaScript's "
                           f"regexes, which read it as the letter {e!r} where other dialects read something "
                           f"else{hint}")


_JAVASCRIPT_GROUPS = ("(?:", "(?=", "(?!", "(?<=", "(?<!")


def _javascript_group(pattern: str, at: int) -> bool:
    """The group opening at `at` is plain or one of JavaScript's `(?` groups (a named group `(?<n>`)."""
    return (not pattern.startswith("(?", at) or pattern.startswith(_JAVASCRIPT_GROUPS, at)
            or pattern.startswith("(?<", at) and pattern[at + 3:at + 4].isalpha())


def _escape_complete(pattern: str, at: int) -> bool:
    """The escape whose letter is at `at` has what its letter needs after it (`\\cX`, `\\xHH`, `\\uHHHH`)."""
    kind = pattern[at]
    if kind == "c":
        return control_letter(pattern, at + 1)
    return kind not in _HEX_WIDTH or hex_code(pattern, at + 1, _HEX_WIDTH[kind]) is not None


def _edge_anchors_only(pattern: str) -> str:
    """The pattern, or GrammarError for a `^` or `$` inside it: xgrammar dropped one silently (`a^b`,
    which matches nothing, answered "ab") and llguidance refused it as a lookaround. A regex
    constraint is a full match, so anchors at its edges change nothing."""
    if scan_regex(edge_anchors(pattern)[1])[1]:
        raise GrammarError("regex anchors (^, $) are supported only at the start and end of the regex")
    return pattern


def _ecma_dot(pattern: str) -> str:
    """The pattern with every `.` that means "any character" (not escaped, not in a class) replaced
    by ECMA's class."""
    return "".join(_DOT if piece == "." and not in_class else piece for _, piece, in_class in regex_pieces(pattern))

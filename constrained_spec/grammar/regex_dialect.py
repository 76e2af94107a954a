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
patterns), and `.` any character but a line terminator (\\n, \\r, U+2028, U+2029). An answer under
that meaning is matched by JavaScript's RegExp and by Python's `re.fullmatch` alike. Syntax the
dialects read apart (`\\A`, `\\z`, `\\p{L}`, `(?i)`) is refused under both (`_ecma_syntax_only`), and
what xgrammar's parser refuses (`a**`) is refused under llguidance too.
"""
from __future__ import annotations

import llguidance as llg

from .errors import GrammarError, check_syntax_as_xgrammar
from .json_regex import edge_anchors, scan_regex

__all__ = ["for_llguidance", "for_xgrammar"]

# ECMA-262's `.` outside the s flag: anything but a line terminator
_DOT = "[^\\n\\r\\u2028\\u2029]"


def for_xgrammar(pattern: str) -> str:
    return _ecma_dot(_edge_anchors_only(_ecma_syntax_only(pattern)))


def for_llguidance(pattern: str) -> str:
    ecma = _ecma_dot(_edge_anchors_only(_ecma_syntax_only(pattern)))
    # llguidance (Rust's regex syntax) takes what JavaScript refuses (`a**`; a trailing `\\`, which
    # it dropped): parsed as xgrammar parses it, a regex one backend refuses is refused by both
    check_syntax_as_xgrammar("regex", ecma)
    return llg.regex_to_lark(ecma, "dw")


# the escapes of ECMA-262's regexes (no flags) that stand for something other than their letter;
# after `c` a control letter, after `x` two hex digits, after `u` four; and `\\U` with eight, a
# code point past U+FFFF, which JavaScript has no escape for without its u flag and both backends read
_ECMA_ESCAPE_LETTERS = set("dDwWsSbBtnvfr0cxuU")
_HEX = set("0123456789abcdefABCDEF")


def _ecma_syntax_only(pattern: str) -> str:
    """The pattern, or GrammarError for syntax JavaScript reads otherwise than another dialect:
    a letter escape JavaScript does not define (`\\A`, `\\z`: JavaScript reads the letter, Python
    and llguidance an anchor; `\\p{L}`: `p{L}` to JavaScript without its u flag, a Unicode class to
    llguidance), backreferences, a lone `\\` at the end, and `(?` groups other than JavaScript's
    (inline flags `(?i)`, Python's `(?P<n>`). The backends disagreed on each (QA 1130 D1, D2)."""
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 == n:
                raise GrammarError("the regex ends with a lone backslash (escape it as \\\\ for a backslash)")
            e = pattern[i + 1]
            if e.isdigit() and e != "0" or e == "k":
                raise GrammarError(f"backreferences (\\{e}) are not supported in a regex constraint")
            if e.isascii() and e.isalpha() and (e not in _ECMA_ESCAPE_LETTERS or not _escape_complete(pattern, i + 1)):
                hint = (" (a regex constraint matches the whole answer: leave the anchor out)" if e in "AzZ"
                        else f" (write {e!r} for the letter)")
                raise GrammarError(f"\\{pattern[i + 1:i + 3] if e in 'xuU' else e} is not an escape of JavaScript's "
                                   f"regexes, which read it as the letter {e!r} where other dialects read something "
                                   f"else{hint}")
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":  # (a `]` first in the class is a member, as `_ecma_dot` reads it)
            j = i + 1 + pattern.startswith("^", i + 1)
            i, in_class = j + pattern.startswith("]", j), True
            continue
        elif pattern.startswith("(?", i) and not pattern.startswith((("(?:", "(?=", "(?!", "(?<=", "(?<!")), i) \
                and not (pattern.startswith("(?<", i) and pattern[i + 3:i + 4].isalpha()):
            raise GrammarError(f"the group {pattern[i:i + 4]!r}... is not JavaScript's regex syntax (inline flags and "
                               "Python's (?P<name>...) are not supported)")
        i += 1
    return pattern


def _escape_complete(pattern: str, at: int) -> bool:
    """The escape whose letter is at `at` has what its letter needs after it (`\\cX`, `\\xHH`, `\\uHHHH`)."""
    kind = pattern[at]
    if kind == "c":
        return pattern[at + 1:at + 2].isascii() and pattern[at + 1:at + 2].isalpha()
    if kind in "xuU":
        width = {"x": 2, "u": 4, "U": 8}[kind]
        digits = pattern[at + 1:at + 1 + width]
        return len(digits) == width and set(digits) <= _HEX
    return True


def _edge_anchors_only(pattern: str) -> str:
    """The pattern, or GrammarError for a `^` or `$` inside it: xgrammar dropped one silently (`a^b`,
    which matches nothing, answered "ab") and llguidance refused it as a lookaround. A regex
    constraint is a full match, so anchors at its edges change nothing."""
    if scan_regex(edge_anchors(pattern)[1])[1]:
        raise GrammarError("regex anchors (^, $) are supported only at the start and end of the regex")
    return pattern


def _ecma_dot(pattern: str) -> str:
    """The pattern with every `.` that means "any character" (not escaped, not in a class) replaced
    by ECMA's class. A class ends at the first unescaped `]` past its first member, as llguidance
    reads it (`[]a]` holds `]` and `a`; xgrammar refuses the empty class `[]`)."""
    out: list[str] = []
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            # the class's first member may be a `]` (after an optional `^`): copy it with the `[`
            j = i + 1 + (pattern.startswith("^", i + 1))
            j += pattern.startswith("]", j)
            out.append(pattern[i:j])
            i, in_class = j, True
            continue
        elif c == ".":
            c = _DOT
        out.append(c)
        i += 1
    return "".join(out)

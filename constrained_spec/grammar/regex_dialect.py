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
that meaning is matched by JavaScript's RegExp and by Python's `re.fullmatch` alike.
"""
from __future__ import annotations

import llguidance as llg

from .errors import GrammarError
from .json_regex import edge_anchors, scan_regex

__all__ = ["for_llguidance", "for_xgrammar"]

# ECMA-262's `.` outside the s flag: anything but a line terminator
_DOT = "[^\\n\\r\\u2028\\u2029]"


def for_xgrammar(pattern: str) -> str:
    return _ecma_dot(_edge_anchors_only(pattern))


def for_llguidance(pattern: str) -> str:
    return llg.regex_to_lark(_ecma_dot(_edge_anchors_only(pattern)), "dw")


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

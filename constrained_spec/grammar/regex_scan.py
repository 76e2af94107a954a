"""One reading of a regex's structure: where its escapes and character classes begin and end, for
the checks and rewrites that need no more (a regex constraint's in `regex_dialect`, a JSON Schema
`pattern`'s in `json_regex`; its rewrite for JSON strings decodes escapes and classes itself). Both
are ECMA-262 regexes without flags."""
from __future__ import annotations

from typing import Iterator, Optional

_HEX = frozenset("0123456789abcdefABCDEF")


def regex_pieces(pattern: str) -> Iterator[tuple[int, str, bool]]:
    """(where it starts, its text, whether it lies in a character class) for each piece of the
    regex, in order. A piece is an escape (the backslash and the character after it; a backslash
    ending the regex alone), a class's opening (`[` or `[^`) or closing `]`, or one character. A `]`
    first in a class is a member (`[]a]` holds `]` and `a`) as llguidance reads it; xgrammar
    refuses the empty class `[]`, so the reading never widens what xgrammar takes."""
    i, n, in_class, first_member = 0, len(pattern), False, False
    while i < n:
        c = pattern[i]
        if c == "\\":
            yield i, pattern[i:i + 2], in_class
            i, first_member = i + 2, False
            continue
        if in_class:
            yield i, c, True
            in_class = c != "]" or first_member
            i, first_member = i + 1, False
            continue
        if c == "[":
            opening = "[^" if pattern.startswith("^", i + 1) else "["
            yield i, opening, True
            i, in_class, first_member = i + len(opening), True, True
            continue
        yield i, c, False
        i += 1


def hex_code(p: str, i: int, width: int) -> Optional[int]:
    """The number the `width` hex digits at p[i] spell (an escape's `\\xHH`, `\\uHHHH`), or None
    where there are not that many."""
    digits = p[i:i + width]
    return int(digits, 16) if len(digits) == width and set(digits) <= _HEX else None


def control_letter(p: str, i: int) -> bool:
    """Whether p[i] is the ASCII letter a `\\c` escape takes."""
    return p[i:i + 1].isascii() and p[i:i + 1].isalpha()


def edge_anchors(p: str) -> tuple[bool, str, bool]:
    """(whether `p` starts with `^`, the pattern between its edge anchors, whether it ends with `$`).
    A `$` after an odd number of backslashes is a literal dollar (`a\\$` is one; `a\\\\$` ends
    with a backslash and an anchor)."""
    start = p.startswith("^")
    head = p[:-1]
    end = len(p) > start and p.endswith("$") and (len(head) - len(head.rstrip("\\"))) % 2 == 0
    return start, p[int(start):len(p) - int(end)], end


def scan_regex(p: str) -> tuple[bool, bool]:
    """(whether the pattern has an alternation outside any group, whether it has an anchor)."""
    depth, alternation, anchor = 0, False, False
    for _, piece, in_class in regex_pieces(p):
        if in_class or piece.startswith("\\"):
            continue
        if piece == "(":
            depth += 1
        elif piece == ")":
            depth -= 1
        elif piece == "|" and depth == 0:
            alternation = True
        elif piece in ("^", "$"):
            anchor = True
    return alternation, anchor

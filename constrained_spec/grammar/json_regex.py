"""Regexes for JSON Schema strings under xgrammar 0.2.8: `pattern`s rewritten to full-match regexes
over a JSON string's text (`convert_pattern`, `json_string_regex`), and our own regexes for the
formats whose xgrammar grammar is unsound or too loose (`FORMAT_PATTERNS`). `schema.prepare_schema`
uses both; the llguidance backend uses the format regexes too."""
from __future__ import annotations

import re
from typing import Any

from .errors import GrammarError, at, unsupported
from .regex_scan import control_letter, edge_anchors, hex_code, regex_pieces, scan_regex

# xgrammar 0.2.8 writes a string with minLength/maxLength as `[^"\\\r\n]{min,max}`: raw control
# characters (a tab, U+0001) are not JSON. The bounds become the pattern `^.{min,max}$` instead
# (`.` takes no control character, and no escape: a narrowing). Over 128 repetitions xgrammar
# compiles `.{m,n}` (and `[^\n]{m,n}`) with that same unsound class, so a bound over
# MAX_LENGTH_BOUND is lowered to it (maxLength: a narrowing) or refused (minLength).
MAX_LENGTH_BOUND = 128

# years 0001-9999: RFC 3339 allows 0000, Python's date (hence jsonschema's format checker) does not
_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][48]|[13579][26]|[2468]0)00)"
_DATE = (r"(?:" + _YEAR + r"-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
         r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
         r"|" + _LEAP_YEAR + r"-02-29)")
# No leap second (RFC 3339's 23:59:60 UTC): Python's datetime, pydantic, JavaScript's Date and most
# other readers refuse it, so an answer holding one would be valid JSON Schema and unreadable (a
# narrowing).
_TIME = (r"(?:(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?"
         r"(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9]))")
# RFC 3339's duration (appendix A) with each number at most as long as a reader takes: pydantic (and
# Python's timedelta) end at 999,999,999 days and refuse a longer number in any part, so digits
# without end ("P4215817301332723314043485982555456866D", written at T=1) made a valid, unreadable
# answer; its time part sums to seconds in 32 bits. The longest of each part together stay under
# both (a narrowing).
_DUR_SECOND = r"[0-9]{1,8}S"
_DUR_MINUTE = r"[0-9]{1,6}M(?:" + _DUR_SECOND + ")?"
_DUR_TIME = r"T(?:[0-9]{1,5}H(?:" + _DUR_MINUTE + ")?|" + _DUR_MINUTE + "|" + _DUR_SECOND + ")"
_DUR_DAY = r"[0-9]{1,8}D"
_DUR_MONTH = r"[0-9]{1,6}M(?:" + _DUR_DAY + ")?"
_DURATION = (r"P(?:(?:" + _DUR_DAY + "|" + _DUR_MONTH + r"|[0-9]{1,5}Y(?:" + _DUR_MONTH + ")?)(?:"
             + _DUR_TIME + ")?|" + _DUR_TIME + r"|[0-9]{1,7}W)")
_POINTER = r"(?:/(?:[^/~]|~[01])*)*"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"  # no leading zero (RFC 3986)
_IPV4 = r"(?:" + _OCTET + r"\.){3}" + _OCTET
_H16 = r"[0-9A-Fa-f]{1,4}"


def _ipv6() -> str:
    """RFC 4291 text forms: 8 groups, or `::` for at least one zero group between L groups
    and at most 7 - L more; the last two groups may be an IPv4 address."""
    def groups(n: int) -> str:
        return "" if n == 0 else _H16 + (f"(?::{_H16}){{{n - 1}}}" if n > 1 else "")

    forms = [f"(?:{_H16}:){{7}}{_H16}", f"(?:{_H16}:){{6}}{_IPV4}"]
    for left in range(8):
        right = "" if left == 7 else f"(?:{_H16}(?::{_H16}){{0,{6 - left}}})?"
        forms.append(groups(left) + "::" + right)
    for left in range(6):
        forms.append(groups(left) + f"::(?:{_H16}:){{0,{5 - left}}}" + _IPV4)
    return "(?:" + "|".join(forms) + ")"


_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"  # at most 63 characters (RFC 1123)
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
# Our own regexes for formats whose xgrammar grammar is unsound or accepts invalid values:
# date (Feb 30), date-time and time (any second 60), duration (numbers of any length), json-pointer and relative-json-pointer (a
# bare `"` or `\` in a reference token), email (a quoted local part lets `\q` or `\u"` through:
# not JSON; left out, a narrowing), ipv4 and the IPv4 tail of ipv6 (leading zeros), hostname
# (labels over 63 characters; the 253-character total is not enforced). Each goes through
# json_string_regex like any pattern.
FORMAT_PATTERNS = {
    "date": "^" + _DATE + "$",
    "date-time": "^" + _DATE + "[Tt]" + _TIME + "$",
    "time": "^" + _TIME + "$",
    "duration": "^" + _DURATION + "$",
    "json-pointer": "^" + _POINTER + "$",
    "relative-json-pointer": "^(?:0|[1-9][0-9]*)(?:#|" + _POINTER + ")$",
    "email": "^" + _ATOM + r"(?:\." + _ATOM + ")*@" + _LABEL + r"(?:\." + _LABEL + ")*$",
    "hostname": "^" + _LABEL + r"(?:\." + _LABEL + ")*$",
    "ipv4": "^" + _IPV4 + "$",
    "ipv6": "^" + _ipv6() + "$",
}


def convert_pattern(p: Any, path: str, keyword: str = "pattern") -> str:
    """ECMA-262 search semantics -> a full-match regex for xgrammar."""
    if not isinstance(p, str):
        raise GrammarError(f"'{keyword}' must be a string {at(path)}", keyword, path)
    try:
        re.compile(p)
    except re.error as e:
        # (JavaScript reads `[]` as a class of nothing, Python as the start of one holding `]`)
        empty = " (`[]` is a class that matches nothing; write `\\]` for a bracket)" if "[]" in p else ""
        raise GrammarError(f"invalid regex in '{keyword}' {at(path)}: {e}{empty}", keyword, path) from None
    if _lookaround_or_backreference(p):
        raise unsupported(keyword, path, "lookarounds, backreferences and \\p{..} are not supported")
    if any(n > MAX_LENGTH_BOUND for n in _repetition_counts(p)):
        # xgrammar 0.2.8 compiles a long repetition of `.` with a class that takes raw control
        # characters (not JSON)
        raise unsupported(keyword, path, f"repetition counts over {MAX_LENGTH_BOUND}")
    start, body, end = edge_anchors(p)
    alt, anchor = scan_regex(body)
    if anchor:
        raise unsupported(keyword, path, "anchors inside the regex are not supported")
    if alt:
        body = "(" + body + ")"
    return json_string_regex(("" if start else ".*") + body + ("" if end else ".*"))


_LOOKAROUNDS = ("(?=", "(?!", "(?<=", "(?<!")
_REPETITION = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def _lookaround_or_backreference(p: str) -> bool:
    """Whether the pattern holds a lookaround, a backreference or a `\\p{..}` class (read piece by
    piece: `\\\\p` is a backslash and a `p`)."""
    for i, piece, in_class in regex_pieces(p):
        if len(piece) == 2 and piece[0] == "\\" and piece[1] in "pPk123456789":
            return True
        if piece == "(" and not in_class and p.startswith(_LOOKAROUNDS, i):
            return True
    return False


def _repetition_counts(p: str) -> list[int]:
    """The numbers of the pattern's `{m}`, `{m,}` and `{m,n}` repetitions."""
    counts = []
    for i, piece, in_class in regex_pieces(p):
        m = _REPETITION.match(p, i) if piece == "{" and not in_class else None
        if m is not None:
            counts += [int(n) for n in m.groups() if n]
    return counts


def json_string_regex(p: str) -> str:
    r"""The regex rewritten for xgrammar 0.2.8's regexes inside JSON strings (`Regex(..,
    json_string=true)`, used for `pattern`, `patternProperties` and `propertyNames`). They match
    the string's JSON text, not its value, and get three things wrong; each rewrite keeps the set
    of values and leaves only JSON text that decodes to them:

    * a character JSON must escape (`"`, `\`, U+0000-U+001F) written literally, as a regex
      escape (`\"`, `\u0022`, `\n`, `\0`, ...) or inside a positive class, was matched as that
      raw character: `a"b` let the string end early, `\\` wrote a bare backslash (the text
      `"a\b"` is the value a + backspace), `\n` a raw newline. Each becomes its JSON escape
      (`\\"` for `"`, `\\u0001` for U+0001: one spelling each, the values are the same).
      `.`, negated classes and `\S`/`\W`/`\D` never match those characters, and xgrammar
      drops an alternative holding an escape beside one without (`[a"]` matches `a` only, `(\n)?`
      only the empty string): narrowings, never wrong text;
    * a literal non-ASCII character makes `.` and `[^..]` match a bare `"` (the string never has
      to end): non-ASCII characters become `\u` escapes, which stay exact;
    * an optional group whose body ends in a repetition, `(ab*)?`, also matches the repetition
      alone (`b`): a group's `?` becomes `{0,1}`, which is exact."""
    out, i, group_end = [], 0, False
    while i < len(p):
        c = p[i]
        if c == "\\" and i + 1 < len(p):
            cp, n = _escaped_char(p, i, in_class=False)
            text, i = p[i:i + n], i + n
            if cp is not None and json_must_escape(cp):
                out.append(_json_escapes([cp]))
            elif cp is not None and cp > 127:
                out.append(_u_escape(chr(cp)))
            else:
                out.append(text)  # `\.`, `\)`, `\d`: one piece, `\)` is no group's end
            group_end = out[-1].startswith("(")
            continue
        if c == "[":
            piece, i = _class_regex(p, i)
            out.append(piece)
            group_end = piece.startswith("(")
            continue
        if c == "?" and group_end:
            out.append("{0,1}")
            i += 2 if p[i + 1:i + 2] == "?" else 1  # a lazy `??` matches the same strings
            group_end = False
            continue
        if json_must_escape(ord(c)):
            out.append(_json_escapes([ord(c)]))
            group_end = True
        else:
            out.append(_u_escape(c) if ord(c) > 127 else c)
            group_end = c == ")"
        i += 1
    return "".join(out)


# JSON's short escapes; the other characters below U+0020 are written \u00XX
_SHORT_ESCAPES = {0x22: '"', 0x5C: "\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}
_ESCAPE_CHARS = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B}
_CLASS_ESCAPES = set("dDwWsS")


def json_must_escape(cp: int) -> bool:
    """Whether JSON text must write the character as an escape."""
    return cp < 0x20 or cp in (0x22, 0x5C)


def _json_escapes(cps) -> str:
    """A regex group matching the JSON escape of each character in cps."""
    alts = []
    for cp in cps:
        e = _SHORT_ESCAPES.get(cp)
        alts.append("\\\\" + ("\\" + e if e in ('"', "\\") else e if e else f"u{cp:04x}"))
    return "(?:" + "|".join(alts) + ")"


def _escaped_char(p: str, i: int, in_class: bool):
    r"""(code point, length) of the regex escape at p[i] (a backslash); the code point is None
    for a class escape (`\d`) or an assertion (`\b` outside a class)."""
    e = p[i + 1]
    width = {"x": 2, "u": 4}.get(e)
    if width and (code := hex_code(p, i + 2, width)) is not None:
        return code, 2 + width
    if e == "u" and p[i + 2:i + 3] == "{":
        end = p.find("}", i + 3)
        if end > i + 3 and (code := hex_code(p, i + 3, end - i - 3)) is not None:
            return code, end + 1 - i
    if e in _ESCAPE_CHARS:
        return _ESCAPE_CHARS[e], 2
    if e == "0" and not p[i + 2:i + 3].isdigit():
        return 0, 2
    if e == "c" and control_letter(p, i + 2):
        return ord(p[i + 2]) % 32, 3
    if e == "b" and in_class:
        return 0x08, 2
    if e in _CLASS_ESCAPES or e in "bB":
        return None, 2
    return ord(e), 2


def _class_regex(p: str, i: int):
    r"""The class starting at p[i] (`[`) for json_string_regex, and the index after it.

    A negated class, or a positive one without characters JSON escapes, is kept as written (its
    non-ASCII characters as `\u` escapes). A positive class holding such characters becomes a
    group: the class without them, or'ed with their JSON escapes."""
    j = i + 1
    negated = p[j:j + 1] == "^"
    j += negated
    first = j
    cps, escapes = [], []  # code point ranges, class escapes
    while j < len(p) and (p[j] != "]" or j == first):  # a leading `]` is a literal
        if p[j] == "\\" and j + 1 < len(p):
            lo, n = _escaped_char(p, j, in_class=True)
        else:
            lo, n = ord(p[j]), 1
        if lo is None:
            escapes.append(p[j:j + n])
            j += n
            continue
        j += n
        hi = lo
        if p[j:j + 1] == "-" and j + 1 < len(p) and p[j + 1] != "]":
            if p[j + 1] == "\\":
                hi, n = _escaped_char(p, j + 1, in_class=True)
            else:
                hi, n = ord(p[j + 1]), 1
            if hi is None:  # `a-\d` is no range (Python refuses it anyway)
                hi = lo
            else:
                j += 1 + n
        cps.append((lo, hi))
    end = j + 1  # past the closing `]`
    bad = sorted({cp for lo, hi in cps for cp in range(lo, min(hi, 0x5C) + 1) if json_must_escape(cp)})
    if negated or not bad:
        text, k, out = p[i:end], 0, []
        while k < len(text):
            if text[k] == "\\" and k + 1 < len(text):
                out.append(_u_escape(text[k + 1]) if ord(text[k + 1]) > 127 else text[k:k + 2])
                k += 2
            else:
                out.append(_u_escape(text[k]) if ord(text[k]) > 127 else text[k])
                k += 1
        return "".join(out), end
    safe = []
    for lo, hi in cps:
        start = lo
        for cp in range(lo, min(hi, 0x5C) + 1):
            if json_must_escape(cp):
                if start < cp:
                    safe.append((start, cp - 1))
                start = cp + 1
        if start <= hi:
            safe.append((start, hi))
    body = "".join(_class_char(lo) + ("" if lo == hi else "-" + _class_char(hi)) for lo, hi in safe)
    body += "".join(escapes)
    alts = ([f"[{body}]"] if body else []) + [_json_escapes(bad)[3:-1]]
    return "(?:" + "|".join(alts) + ")", end


def _class_char(cp: int) -> str:
    """A character inside a regex class (never one JSON escapes)."""
    if cp > 127:
        return _u_escape(chr(cp))
    if cp == 0x7F:
        return "\\x7f"
    c = chr(cp)
    return "\\" + c if c in "]^-[" else c


def _u_escape(c: str) -> str:
    o = ord(c)
    return f"\\u{o:04x}" if o <= 0xFFFF else f"\\u{{{o:x}}}"

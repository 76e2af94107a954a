"""Soundness of compiled JSON-schema grammars: text a grammar accepts as complete is JSON that
validates against the request's schema (real SmolLM2 tokenizer, no model).

Every regex the grammar gets is probed: `pattern`, `patternProperties` and `propertyNames`
regexes, and each enforced `format` (xgrammar's own grammar or our FORMAT_PATTERNS), with bare
quotes, backslashes, escaped quotes, invalid escapes and raw control characters. A probe may be
refused (a narrowing is fine); one accepted as complete must parse and validate.
`validation_error` is shared with tests/test_grammar_walks.py.
"""
from __future__ import annotations

import datetime
import json
import re

import numpy as np
import pytest
import xgrammar as xgr

from constrained_spec.grammar import GrammarBackend, GrammarError, GrammarSpec
from constrained_spec.grammar.json_regex import FORMAT_PATTERNS
from constrained_spec.grammar.schema import ENFORCED_FORMATS

VOCAB = 49152
STOP = 2  # <|im_end|>, the grammar's stop token


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = GrammarBackend(tokenizer, VOCAB, default_backend="xgrammar")
    yield b
    b.close()


def special_ids(tokenizer) -> set:
    ids = set(tokenizer.all_special_ids)
    ids |= {int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids


def allowed_ids(matcher: xgr.GrammarMatcher) -> np.ndarray:
    bm = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bm, 0)
    bits = np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little")[:VOCAB]
    return np.flatnonzero(bits)


def complete(backend, compiled, text: str) -> bool:
    m = backend.matcher(compiled)._m
    return m.accept_string(text) and m.is_completed()


# ------------------------------------------------------------------ validation
# jsonschema checks only some formats without optional packages; the rest are checked here
# with the RFC grammars (RFC 3339, 3986, 6570, 1123, 5321, 6901).
_HEX2 = r"%[0-9A-Fa-f]{2}"
_URI_CHAR = r"(?:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|" + _HEX2 + ")"
_VARCHAR = r"(?:[A-Za-z0-9_]|" + _HEX2 + ")"
_VARSPEC = _VARCHAR + r"(?:\.?" + _VARCHAR + r")*(?::[1-9][0-9]{0,3}|\*)?"
_URI_TEMPLATE = (r"(?:[!#$&(-;=?-\[\]_a-z~]|" + _HEX2 + r"|\{[+#./;?&=,!@|]?" + _VARSPEC
                 + "(?:," + _VARSPEC + r")*\})*")
_DUR_TIME = r"T(?:\d+H(?:\d+M(?:\d+S)?)?|\d+M(?:\d+S)?|\d+S)"
_DURATION = (r"P(?:(?:\d+D|\d+M(?:\d+D)?|\d+Y(?:\d+M(?:\d+D)?)?)(?:" + _DUR_TIME + ")?|"
             + _DUR_TIME + r"|\d+W)")
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_QUOTED_LOCAL = r'"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\[\x20-\x7e])*"'


def _is_time(s: str) -> bool:
    m = re.fullmatch(r"(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|([+-])(\d{2}):(\d{2}))", s)
    if not m:
        return False
    h, mi, sec = int(m[1]), int(m[2]), int(m[3])
    oh, om = (int(m[7]), int(m[8])) if m[6] else (0, 0)
    if h > 23 or mi > 59 or sec > 60 or oh > 23 or om > 59:
        return False
    if sec == 60:  # a leap second is 23:59:60 UTC
        sign = -1 if m[6] == "+" else 1
        utc = (h * 60 + mi + sign * (oh * 60 + om)) % 1440
        return utc == 23 * 60 + 59
    return True


def _is_date(s: str) -> bool:
    try:
        return bool(re.fullmatch(r"\d{4}-\d{2}-\d{2}", s)) and bool(datetime.date.fromisoformat(s))
    except ValueError:
        return False


def _is_hostname(s: str) -> bool:
    label = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    return len(s) <= 253 and bool(re.fullmatch(label + r"(?:\." + label + ")*", s))


def _is_email(s: str) -> bool:
    local, at, domain = s.rpartition("@")
    return bool(at) and bool(re.fullmatch(f"{_ATOM}(?:\\.{_ATOM})*|{_QUOTED_LOCAL}", local)) \
        and _is_hostname(domain)


_EXTRA_FORMATS = {
    "date-time": lambda s: len(s) > 10 and s[10] in "Tt" and _is_date(s[:10]) and _is_time(s[11:]),
    "time": _is_time,
    "date": _is_date,
    "uri": lambda s: bool(re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*:" + _URI_CHAR + "*", s)),
    "uri-reference": lambda s: bool(re.fullmatch(_URI_CHAR + "*", s)),
    "uri-template": lambda s: bool(re.fullmatch(_URI_TEMPLATE, s)),
    "hostname": _is_hostname,
    "email": _is_email,
    "duration": lambda s: bool(re.fullmatch(_DURATION, s)),
    "json-pointer": lambda s: bool(re.fullmatch(r"(/([^~/]|~[01])*)*", s, re.S)),
    "relative-json-pointer": lambda s: bool(re.fullmatch(r"(0|[1-9][0-9]*)(#|(/([^~/]|~[01])*)*)",
                                                         s, re.S)),
}


def format_checker(V):
    """The draft's format checker, with the formats above checked too."""
    import jsonschema

    fc = jsonschema.FormatChecker(formats=())
    fc.checkers = dict(V.FORMAT_CHECKER.checkers)
    for name, check in _EXTRA_FORMATS.items():
        fc.checkers[name] = (lambda c: (lambda x: not isinstance(x, str) or c(x)))(check), ()
    return fc


def validation_error(schema, text: str):
    """None when text is JSON valid for schema (its own draft, formats checked); else why not."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as e:
        return f"not JSON: {e}"
    V = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = V(schema, format_checker=format_checker(V))
    err = jsonschema.exceptions.best_match(validator.iter_errors(value))
    return None if err is None else f"invalid: {err.message}"


def test_format_checkers_know_valid_and_invalid():
    V = __import__("jsonschema").Draft202012Validator
    for fmt, good, bad in [
        ("time", ["23:59:60Z", "01:29:60+01:30", "12:00:00.5z"], ["12:00:60Z", "24:00:00Z"]),
        ("ipv4", ["1.2.3.4"], ["01.2.3.4"]),
        ("ipv6", ["::1", "::ffff:1.2.3.4"], ["::01.2.3.4", "1::2::3"]),
        ("email", ["a.b@c.org", '"a b"@c.org'], ["a..b@c.org", "a@", '"a@b.org']),
        ("hostname", ["a-b.example"], ["a" * 64, "-a.b"]),
        ("duration", ["P1Y2M3DT4H5M6S", "P2W", "PT1M"], ["P1Y2D", "PT", "P"]),
        ("uri-template", ["http://a/{b}", "{+x,y:3}"], ["{", "a b"]),
    ]:
        fc = format_checker(V)
        assert all(fc.conforms(g, fmt) for g in good), fmt
        assert not any(fc.conforms(b, fmt) for b in bad), fmt


# ------------------------------------------------------------------ special tokens
def test_special_tokens_never_legal(backend, tokenizer):
    """<|endoftext|> (0) and <|im_start|> (1) were text to xgrammar (the GGUF vocab holds them as
    strings): legal inside the open key of `{"$type`, where the engine ended on them as an EOS."""
    specials = special_ids(tokenizer)
    assert {0, 1, STOP} <= specials
    schema = {"patternProperties": {"f.*o": {"type": "integer"}}}
    cg = backend.compile(GrammarSpec.json_schema(schema))
    m = backend.matcher(cg)._m
    assert m.accept_string('{"$type')
    allowed = set(allowed_ids(m).tolist())
    assert len(allowed) > 1000  # inside a key: most of the vocabulary
    assert not allowed & specials, sorted(allowed & specials)
    assert m.accept_string('foo": 1}') and m.is_completed()
    allowed = set(allowed_ids(m).tolist())
    assert allowed & specials == {STOP}  # the stop token, and only where the grammar can end


# ------------------------------------------------------------------ regression cases
# Each was accepted as complete before its fix (non-ASCII and json-pointer: before cf83d98;
# the rest: before the commit adding this file).
REGRESSIONS = [
    # a literal non-ASCII character let `.` match a bare quote: the key or string never ended
    ({"type": "object", "patternProperties": {"^á": {}}, "additionalProperties": False},
     '{"áX "b": 1}'),
    ({"type": "string", "pattern": "é.+"}, '"é"b"'),
    ({"type": "object", "propertyNames": {"pattern": "^á"}}, '{"á"x": 1}'),
    # xgrammar's json-pointer grammars let a reference token hold a bare quote
    ({"type": "string", "format": "json-pointer"}, '"/a"b"'),
    ({"type": "string", "format": "relative-json-pointer"}, '"0/a"b"'),
    # a character JSON escapes, written in the regex, was matched raw
    ({"type": "string", "pattern": '^a"b$'}, '"a"b"'),
    ({"type": "string", "pattern": "^a\\\\b$"}, '"a\\b"'),  # the value a + backspace
    ({"type": "string", "pattern": "^a\\nb$"}, '"a\nb"'),
    ({"type": "string", "pattern": "^a[\\x00-\\x1f]b$"}, '"a\x01b"'),
    ({"type": "string", "pattern": "^a\\u0022b$"}, '"a"b"'),
    ({"type": "object", "patternProperties": {'^a"': {}}, "additionalProperties": False},
     '{"a"": 1}'),
    ({"type": "object", "propertyNames": {"pattern": "^a\\t"}}, '{"a\t": 1}'),
    # xgrammar's email grammar: a quoted local part takes any `\` + printable (not JSON)
    ({"type": "string", "format": "email"}, '"\\"a\\q\\"@b.com"'),
    ({"type": "string", "format": "email"}, '"\\"a\\u\\"@b.com"'),
    # FORMAT_PATTERNS' optional groups went to xgrammar without json_string_regex: `(\.[0-9]+)?`
    # matched the digits alone
    ({"type": "string", "format": "date-time"}, '"2024-01-01T12:00:0012Z"'),
    # leading zeros (invalid for RFC 3986 and jsonschema's ipaddress check)
    ({"type": "string", "format": "ipv4"}, '"01.2.3.4"'),
    ({"type": "string", "format": "ipv6"}, '"::ffff:01.2.3.4"'),
    # a leap second is 23:59:60 UTC; a hostname label has at most 63 characters
    ({"type": "string", "format": "time"}, '"12:00:60Z"'),
    ({"type": "string", "format": "hostname"}, '"' + "a" * 64 + '"'),
    # xgrammar's length-bounded strings take raw control characters
    ({"type": "string", "maxLength": 10}, '"a\x17b"'),
    ({"type": "string", "minLength": 2}, '"a\tb"'),
    ({"type": "object", "properties": {"p": {"type": "string", "minLength": 8, "maxLength": 2048}},
      "required": ["p"]}, '{"p": "abcdefg\x1c"}'),
]


@pytest.mark.parametrize("schema,text", REGRESSIONS, ids=[t for _, t in REGRESSIONS])
def test_regression_refused(backend, schema, text):
    assert validation_error(schema, text) is not None  # the case is wrong text
    cg = backend.compile(GrammarSpec.json_schema(schema))
    assert not complete(backend, cg, text)


def test_long_repetitions_refused(backend):
    """Over 128 repetitions xgrammar compiles `.{m,n}` with a class that takes raw control
    characters: `^.{0,200}$` accepted `"a\x01b"`. Such patterns are refused."""
    with pytest.raises(GrammarError, match="repetition"):
        backend.compile(GrammarSpec.json_schema({"type": "string", "pattern": "^.{0,200}$"}))


def test_json_escapes_in_regexes_stay_exact(backend):
    """The rewritten regexes still accept the values, as their JSON escapes."""
    for schema, texts in [
        ({"type": "string", "pattern": '^a"b$'}, ['"a\\"b"']),
        ({"type": "string", "pattern": "^a\\\\b$"}, ['"a\\\\b"']),
        ({"type": "string", "pattern": "^a\\nb$"}, ['"a\\nb"']),
        ({"type": "string", "pattern": "^a[\\x00-\\x1f]b$"}, ['"a\\u0001b"', '"a\\tb"']),
        ({"type": "object", "patternProperties": {'^a"': {}}, "additionalProperties": False},
         ['{"a\\"": 1}']),
        ({"type": "string", "pattern": "^á+$"}, ['"áá"']),
        ({"type": "string", "format": "time"}, ['"23:59:59Z"', '"12:00:00.5+01:00"']),
        ({"type": "string", "format": "ipv6"}, ['"1:2:3:4:5:6:1.2.3.4"', '"::"', '"1::"']),
        ({"type": "string", "format": "email"}, ['"a.b+c@d-e.example"']),
        ({"type": "string", "minLength": 2, "maxLength": 3}, ['"ab"', '"\u00e9\u00e9\u00e9"']),
    ]:
        cg = backend.compile(GrammarSpec.json_schema(schema))
        for t in texts:
            assert validation_error(schema, t) is None, (schema, t)
            assert complete(backend, cg, t), (schema, t)


# ------------------------------------------------------------------ every regex, probed
# Inserted into a string's text: bare quote, bare backslash, escaped quote and backslash,
# invalid and short escapes, raw control characters, a raw DEL, non-ASCII, a \u quote.
PROBES = ['"', "\\", '\\"', "\\\\", "\\q", "\\u", "\\u12", "\\x41", "\x00", "\x01", "\n", "\t",
          "\x1f", "\x7f", "é", "\\u0022", "\\n", '"}', '",', "\\'"]

# (regex, a value it matches): the probes go into that value at every position
REGEXES = [
    (".*", "ab"), ("^a", "ab"), ("f.*o", "foo"), ("^á", "á1"), ("é.+", "éb"), ("^[^a]+$", "bc"),
    ("^\\S+$", "ab"), ("^\\w+$", "ab"), ("^[ -~]+$", "a b"), ("^[!-\\]]+$", "ab"),
    ('^a"b$', 'a"b'), ("^a\\\\b$", "a\\b"), ("^a\\nb$", "a\nb"), ("^a[\\x00-\\x1f]b$", "a\x01b"),
    ("^a\\u0022b$", 'a"b'), ('^[a-z"]+$', "ab"), ("^x(ab*)?$", "xab"), ("^(a|b)+$", "ab"),
    ("^/(([a-z.]|%[0-9a-fA-F]{2})+(/([a-z.]|%[0-9a-fA-F]{2})*)*)?$", "/a/b"),
    ("^[\\u00e0-\\u00ff]+$", "àé"), ("^\\d{3}$", "123"), ("^a.?b$", "ab"), ("^\\s*a$", " a"),
]


def _probe_texts(value: str):
    yield json.dumps(value, ensure_ascii=False)
    yield '"' + value + '"'  # the value's characters unescaped
    for probe in PROBES:
        for k in range(len(value) + 1):
            yield '"' + value[:k] + probe + value[k:] + '"'


def _sites(regex: str):
    """The three places a regex reaches the grammar, each as (schema, wrap(string text))."""
    yield "pattern", {"type": "string", "pattern": regex}, (lambda s: s)
    yield "patternProperties", {"type": "object", "patternProperties": {regex: {"type": "integer"}},
                                "additionalProperties": False}, (lambda s: "{" + s + ": 1}")
    yield "propertyNames", {"type": "object", "propertyNames": {"pattern": regex}}, \
        (lambda s: "{" + s + ": [1]}")


@pytest.mark.parametrize("regex,value", REGEXES, ids=[r for r, _ in REGEXES])
def test_regex_sites_accept_only_valid_json(backend, regex, value):
    for site, schema, wrap in _sites(regex):
        cg = backend.compile(GrammarSpec.json_schema(schema))
        for text in _probe_texts(value):
            text = wrap(text)
            if complete(backend, cg, text):
                err = validation_error(schema, text)
                assert err is None, (site, regex, text, err)


# A valid value of each format (the probes go into it at every position) and invalid ones.
FORMAT_VALUES = {
    "date-time": ("2024-02-29T23:59:59Z", ["2023-02-29T00:00:00Z", "2024-01-01T12:00:0012Z",
                                           "2024-01-01 12:00:00Z", "2024-01-01T25:00:00Z"]),
    "time": ("12:34:56.7+01:00", ["12:00:60Z", "12:00", "12:00:00+24:00", "1:00:00Z"]),
    "date": ("2024-02-29", ["2023-02-29", "2024-13-01", "2024-1-01"]),
    "uri": ("http://u@a.b:80/c%20d?e=f#g", ["a b", "/relative", "http://a/%zz", "1http://a"]),
    "uri-reference": ("../a/b?c#d", ["a b", "%zz", "a\\b"]),
    "hostname": ("a-b.example.org", ["-a.org", "a_b.org", "a..b", "a" * 64 + ".org"]),
    "duration": ("P1Y2M3DT4H5M6S", ["P", "PT", "P1Y2D", "1D", "P1.5D"]),
    "json-pointer": ("/a~0b/c~1d", ["a", "/a~2", "/~"]),
    "relative-json-pointer": ("1/a~1b", ["01/a", "/a", "1#/a", "-1"]),
    "ipv4": ("192.168.0.1", ["256.1.1.1", "01.2.3.4", "1.2.3", "1.2.3.4.5"]),
    "ipv6": ("fe80::1:2:3.4.5.6", ["::01.2.3.4", "1::2::3", "12345::", "1:2:3:4:5:6:7:8:9"]),
    "email": ("first.last+tag@sub.example.com", ['"a"@b.com', "a..b@c.com", "a@-b.com", "@b.com"]),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", ["123e4567e89b12d3a456426614174000",
                                                      "123e4567-e89b-12d3-a456-42661417400g"]),
    "uri-template": ("http://a/{+b,c:3}{?d*}", ["{", "}", "{a b}", "{a:0}", "a b"]),
}


@pytest.mark.parametrize("fmt, leap", [("time", "23:59:60Z"), ("date-time", "2016-12-31T23:59:60Z"),
                                       ("date-time", "2016-12-31T23:59:60.5+00:00")])
@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_no_leap_second_is_written(backend, fmt, leap, name):
    """A leap second is valid RFC 3339 (jsonschema's checker takes it) that pydantic, Python's
    datetime and JavaScript's Date refuse: `client.chat.completions.parse` with a datetime field
    raised pydantic's ValidationError on a 200 (QA 1129m, pydantic D2). Neither backend writes it;
    the second before it is still there."""
    schema = {"type": "string", "format": fmt}
    assert validation_error(schema, json.dumps(leap)) is None  # valid, refused on purpose
    written = _writes(backend, schema, name)
    assert not written(leap) and written(leap.replace(":60", ":59"))


def _writes(backend, schema, name):
    """Whether the backend `name`'s grammar for `schema` lets the model write a string value (its
    ordinary tokenization, then the stop token)."""
    cg = backend.compile(GrammarSpec.json_schema(schema).with_backend(name))
    assert cg.backend == name

    def written(text: str) -> bool:
        ids = backend.tokenizer.encode(json.dumps(text), add_special_tokens=False)
        m = backend.matcher(cg)
        return m.accept_tokens(ids) == len(ids) and m.accept_token(min(backend.stop_token_ids))
    return written


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_durations_are_as_long_as_a_reader_takes(backend, name):
    """`format: duration` took numbers of any length: the model wrote "P4215817301332723314043485982555456866D"
    for a pydantic timedelta field at T=1, valid JSON Schema that pydantic refuses (QA 1129m pydantic D5).
    Each part is bounded so that the longest of them all together still reads."""
    from pydantic import TypeAdapter
    schema = {"type": "string", "format": "duration"}
    written = _writes(backend, schema, name)
    longest = ["P99999Y999999M99999999DT99999H999999M99999999S", "P9999999W", "PT99999H999999M99999999S"]
    for text in longest + ["P1Y2M3DT4H5M6S", "P2W", "PT36H", "P1D", "PT0S"]:
        assert written(text), text
        assert validation_error(schema, json.dumps(text)) is None
        TypeAdapter(datetime.timedelta).validate_json(json.dumps(text))  # pydantic reads it
    for text in ["P4215817301332723314043485982555456866D", "P999999Y", "PT9999999H", "P", "PT", "P1Y2D", "P1.5D"]:
        assert not written(text), text


def test_every_enforced_format_is_probed():
    assert set(FORMAT_VALUES) == set(ENFORCED_FORMATS) | set(FORMAT_PATTERNS)


@pytest.mark.parametrize("fmt", sorted(FORMAT_VALUES))
def test_formats_accept_only_valid_json(backend, fmt):
    good, bad = FORMAT_VALUES[fmt]
    for site, schema, wrap in [
            ("value", {"type": "string", "format": fmt}, lambda s: s),
            ("property", {"type": "object", "properties": {"k": {"type": "string", "format": fmt}},
                          "required": ["k"], "additionalProperties": False},
             lambda s: '{"k": ' + s + "}"),
            ("propertyNames", {"type": "object", "propertyNames": {"format": fmt}},
             lambda s: "{" + s + ": 1}")]:
        try:
            cg = backend.compile(GrammarSpec.json_schema(schema))
        except GrammarError:
            assert site == "propertyNames"  # a refusal is sound
            continue
        if site != "propertyNames":
            assert complete(backend, cg, wrap(json.dumps(good))), (fmt, good)
        for b in bad:
            assert not complete(backend, cg, wrap(json.dumps(b))), (site, fmt, b)
        for text in _probe_texts(good):
            text = wrap(text)
            if complete(backend, cg, text):
                err = validation_error(schema, text)
                assert err is None, (site, fmt, text, err)


def test_strings_with_escapes_in_keys_enums_and_consts(backend):
    """Declared names, enum and const values that JSON escapes: only their escaped text."""
    for name in ['a"b', "a\\b", "a\nb", "a\x01b", "é/\u2028"]:
        for schema, value in [
                ({"type": "object", "properties": {name: {"type": "integer"}}, "required": [name],
                  "additionalProperties": False}, {name: 1}),
                ({"enum": [name, 1]}, name), ({"const": name}, name)]:
            cg = backend.compile(GrammarSpec.json_schema(schema))
            good = json.dumps(value, ensure_ascii=False)
            assert complete(backend, cg, good), (schema, good)
            for raw in (good.replace('\\"', '"'), good.replace("\\\\", "\\"),
                        good.replace("\\n", "\n"), good.replace("\\u0001", "\x01")):
                if raw != good:
                    assert not complete(backend, cg, raw), (schema, raw)


# ------------------------------------------------------------------ JSON-Schema-Test-Suite regressions
# The draft 2020-12 instances the normalizer let through (schemas/conformance/draft2020-12.jsonl), and
# the narrowing it no longer makes. JSON Schema semantics (strict=False), instances as json.dumps writes them.
SUITE_CASES = [
    # items applies after the parent's own prefixItems (none), also where an allOf branch has some
    ({"allOf": [{"prefixItems": [{"minimum": 3}]}], "items": {"minimum": 5}}, [[5, 5]], [[3, 5]]),
    # a keyword we refuse beside an allOf is refused, not dropped
    ({"allOf": [True], "unevaluatedItems": False}, None, None),
    # property names JSON escapes, in an open object: refused (their values went unchecked)
    ({"properties": {"foo\nbar": {"type": "number"}, 'foo"bar': {"type": "number"}}}, None, None),
    # ...but served where the object is closed
    ({"properties": {'foo"bar': {"type": "number"}}, "additionalProperties": False},
     [{'foo"bar': 1}], [{'foo"bar': "1"}]),
    # no type, typed keywords: they apply to their own type only (exact; was narrowed to strings)
    ({"minLength": 2}, ["ab", 5, None, [1], {"a": 1}, True], ["a"]),
    ({"minimum": 3, "maxItems": 1}, [3, "x", [1], {}], [2, [1, 2]]),
    # ...but property names are strings: an untyped propertyNames schema is the string one (a key
    # `-2` came through when its type listed every type; tests/test_stress_cpu.py found it)
    ({"type": "object", "propertyNames": {"pattern": "^[a-z]{1,8}$"}, "additionalProperties": {"type": "integer"}},
     [{"ab": 1}], [{"AB": 1}]),
]


@pytest.mark.parametrize("schema, valid, invalid", SUITE_CASES)
def test_suite_regressions(backend, tokenizer, schema, valid, invalid):
    spec = GrammarSpec.json_schema(schema, strict=False)
    if valid is None:
        with pytest.raises(GrammarError):
            backend.compile(spec)
        return
    compiled = backend.compile(spec)
    texts = [(json.dumps(x), True) for x in valid] + [(json.dumps(x), False) for x in invalid]
    if "propertyNames" in schema:
        texts.append(('{"ab": 1, -2: 3}', False))
    for text, expected in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        m = backend.matcher(compiled)
        assert (m.accept_tokens(ids) == len(ids) and m.accept_token(STOP)) is expected, text

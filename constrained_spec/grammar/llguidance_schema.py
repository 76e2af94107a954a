"""JSON schemas rewritten for llguidance: the same language (for two formats a narrower one, so every
answer stays valid), in the form llguidance takes.

`for_llguidance` runs them in order: refuse what the grammar could not write (`check_writable`) and
numbers it would not read exactly (`check_exact_numbers`),
close objects as OpenAI's `strict` does (`close_objects`), write the date formats as the exact
patterns the normalizer uses and `iri` / `idn-email` as the narrower `uri` / `email`
(`formats_as_patterns`), turn a `oneOf` whose branches cannot share a JSON type into `anyOf`
(`one_of_by_type_as_any_of`; llguidance refuses a `oneOf` it cannot prove disjoint, and proves
this kind only sometimes), and drop what constrains nothing yet llguidance refuses: `format` values
that no JSON Schema draft defines (annotations) and empty `dependencies` (`without_inert_keywords`).
Without the last two, such schemas went to xgrammar and compiled in seconds instead of a
millisecond. Property dependencies ("if a is present, b and c are too", or "... the instance also
matches S"), which llguidance does not take and xgrammar ignores, become an `allOf` of two-way
`anyOf`s that say the same (`dependencies_as_all_of`), and so do a `oneOf` of required property
sets ("length and width, or radius", `one_of_required_sets_as_any_of`) and a `not` of required
names ("not both crs and srs", `required_negations_as_absences`); a `not` of types becomes the
types left (`type_negations_as_types`); a fractional bound of more digits than llguidance reads
exactly is rounded inward (`bounds_as_read`), and a number whose bound llguidance cuts short is
joined by the same number under the bound's shorter decimals (`bound_prefixes_kept`). Every rewrite
leaves `enum`, `const`, `default` and `examples` values alone (data, not schemas), and none changes
the input.
"""
from __future__ import annotations

import math
import re
from decimal import ROUND_CEILING, ROUND_DOWN, ROUND_FLOOR, Decimal
from typing import Any, Optional

from .errors import GrammarError
from .json_regex import FORMAT_PATTERNS
from .json_types import types_overlap, value_type
from .schema_refs import has_nested_id, local_target
from .schema_walk import ANNOTATIONS, INERT_BESIDE_REF, children, rewrite_children


def for_llguidance(schema: Any, strict: bool) -> Any:
    check_writable(schema, "")
    check_exact_numbers(schema, "")
    check_object_width(schema, "")
    if strict:
        schema = close_objects(schema)
    schema = formats_as_patterns(schema)
    schema = one_of_by_type_as_any_of(schema)
    # after close_objects: the `allOf` it adds would leave a strict object open, and it would close
    # the `{"properties": {name: false}}` branches these two add
    schema = dependencies_as_all_of(without_inert_keywords(schema))
    schema = bound_prefixes_kept(bounds_as_read(schema))
    return type_negations_as_types(required_negations_as_absences(one_of_required_sets_as_any_of(schema)))


def close_objects(schema: Any) -> Any:
    """OpenAI `strict`: objects that declare `properties` without `additionalProperties` are closed,
    and `prefixItems` without `items` closes the array (what xgrammar's strict mode does).

    A subschema llguidance intersects with others (an `allOf` branch, a schema beside a `$ref`, a
    `$ref` target referenced from such a place or beside other keywords, or a dependency's schema)
    is left open: closing one side of an intersection would reject the properties of the other.
    That keeps such objects to JSON Schema's semantics (extra properties allowed). A target that is
    only ever the whole of a subschema (`{"$ref": ...}` alone) is closed, as xgrammar does."""
    if not isinstance(schema, (dict, list)):
        return schema
    intersected = _intersected_targets(schema)

    def walk(s, pointer: str, open_here: bool):
        if not isinstance(s, dict):
            return s
        open_here = open_here or "$ref" in s or "allOf" in s or pointer in intersected
        out = _subschemas_mapped(s, pointer, walk)
        if not open_here:
            if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
                out["additionalProperties"] = False
                # a name it requires (outright or by a dependency) but does not declare is declared, as
                # any value: closed around it (llguidance refused the object as unsatisfiable, or the
                # dependency's trigger; the normalizer declares `required` names for xgrammar too)
                props = out["properties"]
                missing = [n for n in _required_names(out) if n not in props] if isinstance(props, dict) else []
                if missing:
                    out["properties"] = {**props, **{n: {} for n in missing}}
            if "prefixItems" in out and "items" not in out and "unevaluatedItems" not in out:
                out["items"] = False
        return out
    return walk(schema, "#", False)


def _required_names(s: dict) -> list[str]:
    """The names an object schema requires: `required`, and a property dependency's names."""
    names = list(s["required"]) if isinstance(s.get("required"), list) else []
    for k in ("dependentRequired", "dependencies"):
        if isinstance(s.get(k), dict):
            names += [n for dep in s[k].values() if isinstance(dep, list) for n in dep]
    return [n for n in dict.fromkeys(names) if isinstance(n, str)]


def _intersected_targets(schema: Any) -> set[str]:
    """The `$ref` values whose targets `close_objects` must leave open: those referenced beside other
    keywords or from a subschema that is itself intersected (an `allOf` branch, a dependency's
    schema, a target of this kind), found by walking again until no target is added."""
    found: set[str] = set()

    def visit(s, pointer: str, intersected: bool):
        if not isinstance(s, dict):
            return s
        ref = s.get("$ref")
        if isinstance(ref, str) and ref not in found and (intersected or pointer in found
                                                            or any(k not in INERT_BESIDE_REF for k in s)):
            found.add(ref)
        _subschemas_mapped(s, pointer, visit)
        return s

    size = -1
    while size != len(found):
        size = len(found)
        visit(schema, "#", False)
    return found


def _subschemas_mapped(s: dict, pointer: str, fn) -> dict:
    """The schema with each subschema below it replaced by fn(subschema, its JSON pointer, whether
    it is intersected with the schema around it: an `allOf` branch, a dependency's schema). Values
    that are not subschemas reach fn too, which returns them as they are."""
    def each(v: Any, below: str, keyword: str) -> Any:
        if isinstance(v, list):
            return [fn(sub, f"{below}/{i}", keyword == "allOf") for i, sub in enumerate(v)]
        return fn(v, below, keyword in DEPENDENCY_KEYWORDS)
    return rewrite_children(s, each, pointer)


# characters JSON can only write as \u escapes, which the grammars leave out (`json_options`)
_UNWRITABLE = re.compile(r"[\x00-\x07\x0b\x0e-\x1f]")


def check_writable(schema: Any, path: str) -> None:
    """Refuses a schema whose const/enum values or property names hold a character the grammar cannot
    write (llguidance would drop it from the literal: "hello\u0000there" matched "hellothere")."""
    def bad(v) -> bool:
        if isinstance(v, str):
            return bool(_UNWRITABLE.search(v))
        if isinstance(v, list):
            return any(bad(x) for x in v)
        if isinstance(v, dict):
            return any(bad(k) or bad(x) for k, x in v.items())
        return False

    def visit(k: str, v: Any, at: str, _schema: dict) -> None:
        names = k in ("properties", "required") and isinstance(v, (dict, list))
        if (k in ("const", "enum") and bad(v)) or (names and bad(list(v))):
            raise GrammarError(f"'{k}' {'at ' + at if at else 'at the schema root'} holds a control character "
                               "JSON writes only as a \\u escape", keyword=k, path=at)
    _each_keyword(schema, path, visit)


def _each_keyword(schema: Any, path: str, visit) -> None:
    """Calls visit(keyword, value, path of its schema, the schema) for every keyword of the schema
    and its subschemas (`schema_walk.children`)."""
    if isinstance(schema, list):
        for i, v in enumerate(schema):
            _each_keyword(v, f"{path}/{i}", visit)
        return
    if not isinstance(schema, dict):
        return
    for k, v in schema.items():
        visit(k, v, path, schema)
    for _, below, v in children(schema, path):
        _each_keyword(v, below, visit)


# llguidance (1.9) reads a schema's numbers as f64: past 2**53 an integer loses digits, so a bound of
# 2**53 + 1 let 2**53 through and an enum value of 2**53 + 1 took 2**53 instead; a bound past
# i64's range was clamped to it (minimum 10**19 answered 9223372036854775807); and a bound at
# i64's minimum crashed the process (SIGSEGV).
_EXACT = 2 ** 53
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def check_exact_numbers(schema: Any, path: str) -> None:
    """Refuses a schema with a bound, `multipleOf`, or an integer in `const`/`enum`, whose magnitude
    passes 2**53, which llguidance would not read exactly (the normalizer and xgrammar take it)."""
    def visit(k: str, v: Any, at: str, _schema: dict) -> None:
        if (k in _BOUNDS or k in ("const", "enum")) and _inexact(v, bound=k in _BOUNDS):
            raise GrammarError(f"'{k}' {'at ' + at if at else 'at the schema root'} holds a number past "
                               "2**53, which llguidance does not read exactly", keyword=k, path=at)
    _each_keyword(schema, path, visit)


def _inexact(v: Any, bound: bool) -> bool:
    """An integer past 2**53 in `v` (a number, or data holding numbers); in a bound, any number past it
    (a float bound past i64's range is clamped too)."""
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, float)):
        return abs(v) > _EXACT and (bound or isinstance(v, int))
    if isinstance(v, list):
        return any(_inexact(x, bound) for x in v)
    if isinstance(v, dict):
        return any(_inexact(x, bound) for x in v.values())
    return False


# An object of n properties none of which is required puts ~4n items in one row of llguidance's
# Earley parser at its "{" (measured, 1.9.1: 4n + 7 open, 4n - 1 closed by strict), over its limit of
# 2,000 (`LLParserLimits.max_items_in_row`): the mask allows "{", and accepting it fails. Raising the
# limit only moves the failure to the per-mask item limit (50,000 items: 1,000 such properties).
# With a required property the rows stay short (1,200 properties measured).
MAX_OPTIONAL_ONLY_PROPERTIES = 400


def check_object_width(schema: Any, path: str) -> None:
    """Refuses an object of more than MAX_OPTIONAL_ONLY_PROPERTIES properties none of which is
    required, which llguidance's parser cannot start (the normalizer and xgrammar take it)."""
    def visit(k: str, v: Any, at: str, s: dict) -> None:
        if k != "properties" or not isinstance(v, dict) or len(v) <= MAX_OPTIONAL_ONLY_PROPERTIES:
            return
        required = s.get("required")
        if isinstance(required, list) and any(name in v for name in required):
            return
        raise GrammarError(f"'properties' {'at ' + at if at else 'at the schema root'} has {len(v)} properties "
                           f"and none is required: more than llguidance's parser takes "
                           f"({MAX_OPTIONAL_ONLY_PROPERTIES})", keyword="properties", path=at)
    _each_keyword(schema, path, visit)


# formats llguidance enforces more loosely than a checker or a reader does (measured: "date" takes
# 0000-01-01 and 2023-02-29, which Python's date, hence jsonschema's format checker, refuses; time a
# leap second, duration numbers of any length, which pydantic refuses), and the normalizer's pattern
# for each
_PATTERN_FORMATS = {name: FORMAT_PATTERNS[name] for name in ("date", "date-time", "time", "duration")}


# formats llguidance lacks whose language holds that of one it has: every URI is an IRI (RFC 3987),
# every email address an internationalized one (RFC 6531). Narrower, so every answer stays valid.
# (Not idn-hostname: a hostname's "xn--" label need not be valid punycode, which an IDN must be.)
_NARROWER_FORMATS = {"iri": "uri", "idn-email": "email"}


def formats_as_patterns(schema: Any) -> Any:
    """The schema with each string `format` of _PATTERN_FORMATS written as its `pattern` (where the
    subschema has no pattern of its own, which llguidance could not intersect with it), and each of
    _NARROWER_FORMATS as the narrower format llguidance has."""
    if not isinstance(schema, dict):
        return _each(schema, formats_as_patterns)
    out = _subschemas_rewritten(schema, formats_as_patterns)
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt in _PATTERN_FORMATS and "pattern" not in out:
        del out["format"]
        out["pattern"] = _PATTERN_FORMATS[fmt]
    elif isinstance(fmt, str) and fmt in _NARROWER_FORMATS:
        out["format"] = _NARROWER_FORMATS[fmt]
    return out


# Every format a JSON Schema draft defines (draft 3's included); any other is an annotation that a
# validator ignores, so dropping it changes no instance's validity.
STANDARD_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4",
    "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
    "relative-json-pointer", "regex", "utc-millisec", "color", "style", "phone", "ip-address", "host-name"})


# what a schema may hold beside the keyword a rewrite looks for and still say nothing more
_NOTES = {"description", "title", "$comment"}
DEPENDENCY_KEYWORDS = ("dependencies", "dependentRequired", "dependentSchemas")


def without_inert_keywords(schema: Any) -> Any:
    """The schema without what constrains no instance and llguidance refuses: a `format` no draft
    defines (`STANDARD_FORMATS`) and an empty `dependencies` (`dependentRequired`, `dependentSchemas`)."""
    if not isinstance(schema, dict):
        return _each(schema, without_inert_keywords)
    kept = {k: v for k, v in schema.items()
            if not (k == "format" and isinstance(v, str) and v not in STANDARD_FORMATS)
            and not (k in DEPENDENCY_KEYWORDS and v == {})}
    return _subschemas_rewritten(kept, without_inert_keywords)


def dependencies_as_all_of(schema: Any) -> Any:
    """The schema with each property dependency (`dependentRequired`, `dependentSchemas`, or a
    `dependencies` holding either kind) written as `allOf` entries llguidance takes: "a absent, or a
    and its dependents present", `{"anyOf": [{"properties": {a: false}}, {"required": [..., a]}]}`,
    and "a absent, or a's schema holds", `{"anyOf": [{"properties": {a: false}}, S]}`. Exact for
    every instance: a non-object passes the first branch, as it passes a dependency. A malformed
    dependency stays as it is (llguidance refuses it)."""
    if not isinstance(schema, dict):
        return _each(schema, dependencies_as_all_of)
    out, entries = _subschemas_rewritten(schema, dependencies_as_all_of), []
    if not isinstance(schema.get("allOf", []), list):
        return out
    declared = list(schema["properties"]) if isinstance(schema.get("properties"), dict) else []
    for k in DEPENDENCY_KEYWORDS:
        v = schema.get(k)
        if not (isinstance(v, dict) and v and all(_dependency(k, d) for d in v.values())):
            continue
        rewritten = out.pop(k)  # its schemas rewritten already (a schema map)
        for name, dep in v.items():
            absent = {"properties": {name: False}}
            if isinstance(dep, list):
                # the order llguidance writes required names in: the declared one, then the
                # dependents before the name (as instances tend to list them)
                required = sorted([*(n for n in dep if n != name), name],
                                  key=lambda n: declared.index(n) if n in declared else len(declared))
                entries.append({"anyOf": [absent, {"required": required}]})
            elif dep is False:
                entries.append(absent)
            elif dep is not True and dep != {}:
                entries.append({"anyOf": [absent, rewritten[name]]})
    if entries:
        out["allOf"] = [*out.get("allOf", []), *entries]
    return out


def _dependency(keyword: str, dep: Any) -> bool:
    """Whether `dep` is a well-formed value of a `keyword` entry: names, a schema, or either."""
    names = isinstance(dep, list) and all(isinstance(n, str) for n in dep)
    schema = isinstance(dep, (dict, bool))
    return {"dependentRequired": names, "dependentSchemas": schema}.get(keyword, names or schema)


def one_of_required_sets_as_any_of(schema: Any) -> Any:
    """The schema with each `oneOf` whose branches only require property sets ("length and width, or
    radius") written as the `anyOf` that says the same, which llguidance takes: branch i is an
    object with its names present and, for every other branch j, one of j's other names absent (a
    branch whose names include another's can never match alone, and goes). A `oneOf` beside an
    `anyOf` stays."""
    if not isinstance(schema, dict):
        return _each(schema, one_of_required_sets_as_any_of)
    out = _subschemas_rewritten(schema, one_of_required_sets_as_any_of)
    sets = _required_sets(schema.get("oneOf"))
    if sets is not None and "anyOf" not in schema:
        del out["oneOf"]
        out["anyOf"] = [_alone(i, sets) for i in range(len(sets)) if not any(
            j != i and set(sets[j]) <= set(sets[i]) for j in range(len(sets)))]
    return out


def required_negations_as_absences(schema: Any) -> Any:
    """The schema with each `not` of a bare `required` ("not both crs and srs") written as what it
    says, which llguidance takes: an object with one of the names absent, as an `allOf` entry
    `{"type": "object", "anyOf": [{"properties": {crs: false}}, {"properties": {srs: false}}]}`.
    Exact: `required` holds for every non-object, so its `not` refuses them all."""
    if not isinstance(schema, dict):
        return _each(schema, required_negations_as_absences)
    out = _subschemas_rewritten(schema, required_negations_as_absences)
    names = _bare_required(schema.get("not"))
    if names and isinstance(schema.get("allOf", []), list):
        del out["not"]
        absent = [{"properties": {n: False}} for n in dict.fromkeys(names)]
        one = absent[0] if len(absent) == 1 else {"anyOf": absent}
        out["allOf"] = [*out.get("allOf", []), {"type": "object", **one}]
    return out


# llguidance (1.9.1, measured) reads a fractional bound of 16 or more significant digits rounded near a
# round number: `maximum: 999.9999999999999` let 1000 through. Up to 15 it reads them exactly.
_BOUND_DIGITS = 15


def bounds_as_read(schema: Any) -> Any:
    """The schema with each fractional bound of more than `_BOUND_DIGITS` significant digits rounded
    inward to that many (a narrowing by less than one unit in the 15th digit), so that llguidance
    bounds what it writes by what the schema says."""
    if not isinstance(schema, dict):
        return _each(schema, bounds_as_read)
    out = _subschemas_rewritten(schema, bounds_as_read)
    for keyword, up in (("maximum", False), ("exclusiveMaximum", False), ("minimum", True), ("exclusiveMinimum", True)):
        v = schema.get(keyword)
        if isinstance(v, float) and math.isfinite(v) and v != int(v):
            x = Decimal(repr(v))
            unit = Decimal(1).scaleb(x.adjusted() - _BOUND_DIGITS + 1)
            if x != x.quantize(unit):  # more digits than it reads
                out[keyword] = float(x.quantize(unit, rounding=ROUND_CEILING if up else ROUND_FLOOR))
    return out


# llguidance (1.9.1, measured) refuses a decimal whose digits are a prefix of a fractional bound's on
# the bound's far side from zero: `1.4` under `maximum: 1.49` (and `exclusiveMaximum`), `0.7` under
# `maximum: 0.75`, `-1.4` under `minimum: -1.49`; `1.40` and `1.48` it takes.
_NUMBER_ASSERTIONS = frozenset(("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"))
# what a number subschema may hold beside them: annotations, kept beside the rewrite's anyOf
_ANNOTATIONS = ANNOTATIONS | {"$anchor"}


def bound_prefixes_kept(schema: Any) -> Any:
    """The schema with each number whose bound llguidance reads that way written as an `anyOf` of
    it and of the `enum` of the bound's shorter decimals that it allows (`1.4` beside `maximum:
    1.49`), which takes the decimals the first refuses: the same numbers, at the cost of a literal
    (a second bounded number cost llguidance's compile twice the first's). Only number subschemas
    (a type, bounds, `multipleOf`, annotations) are rewritten."""
    if not isinstance(schema, dict):
        return _each(schema, bound_prefixes_kept)
    out = _subschemas_rewritten(schema, bound_prefixes_kept)
    if set(out) - _NUMBER_ASSERTIONS - _ANNOTATIONS:
        return out
    body = {k: v for k, v in out.items() if k in _NUMBER_ASSERTIONS}
    bounds = (("maximum", 1), ("exclusiveMaximum", 1), ("minimum", -1), ("exclusiveMinimum", -1))
    shorter = {d for keyword, sign in bounds for d in _shorter_decimals(body.get(keyword), sign)}
    allowed = sorted(d for d in shorter if _number_allows(body, d))
    if not allowed:
        return out
    return {"anyOf": [body, {"enum": [float(d) for d in allowed]}],
            **{k: v for k, v in out.items() if k in _ANNOTATIONS}}


def _number_allows(body: dict, d: Decimal) -> bool:
    """Whether the number subschema (its assertions) allows the decimal."""
    types = body.get("type", "number")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not ("number" in types or "integer" in types and d == int(d)):
        return False
    lo, hi = body.get("minimum"), body.get("maximum")
    ex_lo, ex_hi = body.get("exclusiveMinimum"), body.get("exclusiveMaximum")
    checks = [(lo, ex_lo is True, 1), (hi, ex_hi is True, -1)]  # (draft 4: a boolean makes its bound exclusive)
    checks += [(b, True, sign) for b, sign in ((ex_lo, 1), (ex_hi, -1)) if not isinstance(b, bool)]
    for bound, exclusive, sign in checks:
        if isinstance(bound, (int, float)) and not isinstance(bound, bool):
            gap = (d - Decimal(repr(bound))) * sign
            if gap < 0 or exclusive and gap == 0:
                return False
    m = body.get("multipleOf")
    return not (isinstance(m, (int, float)) and not isinstance(m, bool) and m > 0 and d % Decimal(repr(m)) != 0)


def _shorter_decimals(bound: Any, sign: int) -> list[Decimal]:
    """The bound cut to each shorter count of fraction digits (toward zero), for a fractional bound
    on the side `sign` of zero (1: a positive maximum, -1: a negative minimum); else none."""
    if not isinstance(bound, float) or not math.isfinite(bound) or bound == int(bound) or bound * sign <= 0:
        return []
    x = Decimal(repr(bound))
    places = -x.as_tuple().exponent
    return [x.quantize(Decimal(1).scaleb(-j), rounding=ROUND_DOWN) for j in range(1, places)]


def type_negations_as_types(schema: Any) -> Any:
    """The schema with each `not` of a bare `type` ("anything but an array, object or null") written
    as the types left, which llguidance takes. Left as it is where the rest cannot be said with
    `type` (not integer, but number: the non-integral numbers) or nothing is left."""
    if not isinstance(schema, dict):
        return _each(schema, type_negations_as_types)
    out = _subschemas_rewritten(schema, type_negations_as_types)
    left = _types_left(schema)
    if left is not None:
        del out["not"]
        out["type"] = left[0] if len(left) == 1 else left
    return out


_ALL_TYPES = ("object", "array", "string", "number", "boolean", "null")


def _types_left(schema: dict) -> list[str] | None:
    """The types a schema with `not: {"type": T}` (and notes) allows, its own `type` included."""
    neg = schema.get("not")
    if not isinstance(neg, dict) or set(neg) - {"type"} - _NOTES:
        return None
    banned, own = neg.get("type"), schema.get("type", list(_ALL_TYPES))
    banned = [banned] if isinstance(banned, str) else banned
    own = [own] if isinstance(own, str) else own
    if not (isinstance(banned, list) and isinstance(own, list) and all(isinstance(t, str) for t in banned + own)):
        return None
    if "integer" in banned and "number" not in banned and "number" in own:
        return None  # the numbers that are not integers: no type says that
    left = [t for t in own if t not in banned and not (t == "integer" and "number" in banned)]
    return left or None


def _bare_required(s: Any) -> list[str] | None:
    """The names of a schema that holds only `required` (and notes)."""
    if not isinstance(s, dict) or set(s) - {"required"} - _NOTES:
        return None
    names = s.get("required")
    return names if isinstance(names, list) and all(isinstance(n, str) for n in names) else None


def _required_sets(branches: Any) -> list[list[str]] | None:
    """The name lists of a `oneOf` of two or more branches that hold only `required` (and notes)."""
    if not isinstance(branches, list) or len(branches) < 2:
        return None
    sets = [_bare_required(b) for b in branches]
    return None if None in sets else sets


def _alone(i: int, sets: list[list[str]]) -> dict:
    """Branch i of a `oneOf` of required sets, matching no other: an object with its names, and for
    each other set one of its names (not in this set) absent. (Without `type`, a non-object would
    match every branch, which a `oneOf` of two or more refuses.)"""
    branch = {"type": "object", "required": sets[i]}
    others = []
    for j, names in enumerate(sets):
        if j != i:
            absent = [{"properties": {n: False}} for n in names if n not in sets[i]]
            one = absent[0] if len(absent) == 1 else {"anyOf": absent}
            if one not in others:
                others.append(one)
    if others:
        branch["allOf"] = others
    return branch


def _each(schema: Any, rewrite) -> Any:
    """A list's items rewritten; any other non-object as it is."""
    return [rewrite(v) for v in schema] if isinstance(schema, list) else schema


def _subschemas_rewritten(schema: dict, rewrite) -> dict:
    """The schema with `rewrite` applied to every value below it (`schema_walk.rewrite_children`)."""
    return rewrite_children(schema, lambda v, _below, _keyword: rewrite(v))


def one_of_by_type_as_any_of(schema: Any) -> Any:
    """The schema with each `oneOf` whose branches have pairwise disjoint JSON types (an integer is
    a number) written as `anyOf`: no instance can match two branches, so the two are the same. A
    branch's types come from its `type`, its `const` or `enum` values, or its local `$ref`'s target;
    a branch without them, or a document whose `$ref`s could resolve against a nested `$id`, leaves
    the `oneOf` as it is."""
    if not isinstance(schema, dict):
        return schema
    resolvable = not has_nested_id(schema, top=True)

    def types(s: Any, seen: frozenset) -> Optional[frozenset]:
        if s is False:
            return frozenset()
        if not isinstance(s, dict):
            return None
        ref = s.get("$ref")
        if ref is not None:  # a conjunct in 2019-09+, the whole schema in draft 7: its target bounds both
            target = local_target(schema, ref) if resolvable and ref not in seen else None
            return None if target is None else types(target, seen | {ref})
        t = s.get("type")
        if isinstance(t, str):
            t = [t]
        if isinstance(t, list) and t and all(isinstance(x, str) for x in t):
            return frozenset(t)
        if "const" in s:
            return frozenset({value_type(s["const"])})
        if isinstance(s.get("enum"), list):
            return frozenset(value_type(v) for v in s["enum"])
        return None

    def disjoint_by_type(branches: Any) -> bool:
        if not isinstance(branches, list) or not branches:
            return False
        sets = [types(b, frozenset()) for b in branches]
        if any(t is None for t in sets):
            return False
        return all(not types_overlap(sets[i], sets[j]) for i in range(len(sets)) for j in range(i + 1, len(sets)))

    def walk(s: Any) -> Any:
        if isinstance(s, list):
            return [walk(v) for v in s]
        if not isinstance(s, dict):
            return s
        out = _subschemas_rewritten(s, walk)
        if "oneOf" in out and "anyOf" not in out and disjoint_by_type(s["oneOf"]):
            out = {("anyOf" if k == "oneOf" else k): v for k, v in out.items()}
        return out
    return walk(schema)

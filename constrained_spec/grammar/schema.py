"""JSON Schema -> the subset xgrammar 0.2.8 enforces exactly.

xgrammar's JSON-schema converter silently ignores or approximates many keywords (see
docs/constraints.md for the measured list). `prepare_schema` rewrites a schema into an equivalent
one that only uses what xgrammar enforces exactly, or raises GrammarError naming the keyword and
the JSON pointer of the subschema holding it.  Rewrites are exact (the language is unchanged)
except where narrowing is noted (narrowing never lets an invalid instance through):

* local ``$ref`` (``#``, ``#/json/pointer``, ``#anchor``/``$id: "#x"``) -> ``#/$defs/sN``;
  remote refs are refused.  ``$ref`` siblings are merged (2019-09+) or ignored (draft <= 7).
* ``allOf`` is merged into one schema (objects, numbers, strings, arrays, enums).
* siblings of ``anyOf``/``oneOf`` are distributed into the branches; ``oneOf`` is kept only when
  its branches are provably disjoint (then it equals ``anyOf``).
* ``pattern``/``patternProperties`` get JSON Schema's search semantics (xgrammar full-matches);
  every regex is rewritten for xgrammar's JSON-string regexes (`json_string_regex`).
* ``enum``/``const`` with sibling assertions -> the values that satisfy them.
* formats whose xgrammar grammar is unsound or too loose (date, date-time, time, json-pointer,
  relative-json-pointer, email, hostname, ipv4, ipv6) -> our regexes (FORMAT_PATTERNS).
* required properties missing from ``properties`` are added (xgrammar ignores them).
* draft-04 boolean ``exclusiveMinimum``/``Maximum``, draft-07 array ``items``/``additionalItems``.
* a schema without ``type`` but with type-specific keywords gets every type, listed (xgrammar
  ignores the keywords without a ``type`` and applies each to its own type within a list).
"""
from __future__ import annotations

import copy
import json
import math
import re
from typing import Any, Optional
from urllib.parse import unquote

from .errors import GrammarError, at, unsupported
from .json_regex import FORMAT_PATTERNS, MAX_LENGTH_BOUND, convert_pattern, json_must_escape, json_string_regex
from .json_types import types_overlap, value_type
from . import schema_walk
from .schema_walk import children, pointer_token
from .unique_items import MAX_SET_VALUES

# what the normalizer drops as saying nothing about the instance
ANNOTATIONS = schema_walk.ANNOTATIONS | {
    "$schema", "$id", "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$vocabulary", "contentMediaType",
    "contentEncoding", "contentSchema", "$defs", "definitions"}
# Keywords xgrammar 0.2.8 ignores or approximates and that we cannot rewrite cheaply.
_NOT_KEPT = "the answer's grammar cannot keep to it"
UNSUPPORTED = {
    "not": _NOT_KEPT,
    "if": "conditional schemas are not enforced", "then": "conditional schemas are not enforced",
    "else": "conditional schemas are not enforced",
    "contains": _NOT_KEPT, "minContains": _NOT_KEPT, "maxContains": _NOT_KEPT,
    "dependentRequired": _NOT_KEPT, "dependentSchemas": _NOT_KEPT, "dependencies": _NOT_KEPT,
    "unevaluatedProperties": _NOT_KEPT, "unevaluatedItems": _NOT_KEPT,
    "$dynamicRef": "dynamic references are not supported",
    "$recursiveRef": "dynamic references are not supported",
}
STRING_KW = ("minLength", "maxLength", "pattern", "format")
NUMBER_KW = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
OBJECT_KW = ("properties", "required", "additionalProperties", "patternProperties",
             "propertyNames", "minProperties", "maxProperties")
ARRAY_KW = ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems")
ASSERTIONS = set(STRING_KW + NUMBER_KW + OBJECT_KW + ARRAY_KW) | {
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"}
JSON_TYPES = {"null", "boolean", "object", "array", "number", "integer", "string"}
UNTYPED_ORDER = ("object", "array", "string", "number", "boolean", "null")  # every JSON value

# formats xgrammar 0.2.8 enforces (checked against valid/invalid probes)
ENFORCED_FORMATS = {"date-time", "time", "date", "uri", "uri-reference", "hostname", "duration",
                    "json-pointer", "relative-json-pointer", "ipv4", "ipv6", "email", "uuid",
                    "uri-template"}
# standard formats xgrammar accepts anything for: refused (a checker would reject instances)
UNENFORCED_FORMATS = {"iri", "iri-reference", "idn-hostname", "idn-email", "regex"}


# a union's branches after expansion (merged allOf/anyOf products): bounds compile time. 129: the
# root anyOf of a tool call with OpenAI's 128 tools and tool_choice auto's text answer (server/tools.py;
# measured 0.26 s to compile with xgrammar, 0.11 s with llguidance, for 128 five-property functions)
MAX_BRANCHES = 129


def _draft_of(schema: Any) -> int:
    s = schema.get("$schema", "") if isinstance(schema, dict) else ""
    if not isinstance(s, str):
        return 2020
    for tag, d in (("draft-03", 3), ("draft-04", 4), ("draft-06", 6), ("draft-07", 7),
                   ("2019-09", 2019)):
        if tag in s:
            return d
    return 2020


def _types_of(s: dict) -> Optional[set]:
    t = s.get("type")
    if t is None:
        return None
    return {t} if isinstance(t, str) else set(t)


def _json_key(v: Any) -> str:
    """Equality key with JSON Schema semantics (1 == 1.0, true != 1)."""
    def norm(x):
        if isinstance(x, bool) or x is None or isinstance(x, str):
            return x
        if isinstance(x, (int, float)):
            return float(x) if float(x) != int(x) else int(x)
        if isinstance(x, list):
            return [norm(i) for i in x]
        if isinstance(x, dict):
            return {k: norm(v) for k, v in x.items()}
        return x
    return json.dumps(norm(v), sort_keys=True)


# --------------------------------------------------------------------------- normalizer

def _has_wide_integer(v: Any) -> bool:
    """Whether a JSON value holds an integer outside int64."""
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return not -2 ** 63 <= v < 2 ** 63
    if isinstance(v, list):
        return any(_has_wide_integer(x) for x in v)
    if isinstance(v, dict):
        return any(_has_wide_integer(x) for x in v.values())
    return False

class _Normalizer:
    def __init__(self, root: Any, strict: bool):
        self.root = root
        self.strict = strict
        self.draft = _draft_of(root)
        self.names: dict[str, str] = {}  # original pointer -> def name
        self.defs: dict[str, Any] = {}  # def name -> normalized schema (None while in progress)
        self.inlining: set = set()
        self.no_value: dict[str, GrammarError] = {}  # path -> why the schema there has no value (now `false`)
        self.anchors = self._scan_anchors()
        root_id = root.get("$id", root.get("id")) if isinstance(root, dict) else None
        self.root_id = root_id.split("#")[0] if isinstance(root_id, str) else None

    # ---- references ----
    def _scan_anchors(self) -> dict:
        out = {}

        def walk(n, ptr):
            if isinstance(n, dict):
                for k in ("$anchor", "$id", "id"):
                    v = n.get(k)
                    if isinstance(v, str):
                        if k == "$anchor":
                            out.setdefault(v, ptr)
                        elif v.startswith("#") and len(v) > 1:
                            out.setdefault(v[1:], ptr)
                for _, below, v in children(n, ptr):
                    walk(v, below)
            elif isinstance(n, list):
                for i, v in enumerate(n):
                    walk(v, f"{ptr}/{i}")
        walk(self.root, "")
        return out

    def _resolve(self, ref: Any, path: str) -> str:
        if not isinstance(ref, str):
            raise GrammarError(f"'$ref' must be a string {at(path)}", "$ref", path)
        base, _, frag = ref.partition("#")
        if base and base != self.root_id:
            raise GrammarError(f"remote $ref '{ref}' is not supported (only local '#...' refs) "
                               f"{at(path)}", "$ref", path)
        frag = unquote(frag)
        if frag and not frag.startswith("/"):
            if frag in self.anchors:
                return self.anchors[frag]
            raise GrammarError(f"unresolvable $ref '{ref}' {at(path)}", "$ref", path)
        self._lookup(frag, ref, path)
        return frag

    def _lookup(self, ptr: str, ref: str = "", path: str = "") -> Any:
        node = self.root
        if ptr:
            for tok in ptr.split("/")[1:]:
                tok = tok.replace("~1", "/").replace("~0", "~")
                if isinstance(node, dict) and tok in node:
                    node = node[tok]
                elif isinstance(node, list) and tok.isdigit() and int(tok) < len(node):
                    node = node[int(tok)]
                else:
                    raise GrammarError(f"unresolvable $ref '{ref or ptr}' {at(path)}", "$ref", path)
        return node

    def ref_to(self, ptr: str) -> dict:
        name = self.names.get(ptr)
        if name is None:
            name = self.names[ptr] = f"s{len(self.names)}"
            self.defs[name] = None
            self.defs[name] = self.norm(self._lookup(ptr), ptr)
        return {"$ref": "#/$defs/" + name}

    def deref(self, s: Any, path: str) -> Any:
        seen = 0
        while isinstance(s, dict) and "$ref" in s:
            d = self.defs.get(s["$ref"].rsplit("/", 1)[-1])
            if d is None:
                raise GrammarError(f"recursive $ref combined with other keywords {at(path)}",
                                   "$ref", path)
            s, seen = d, seen + 1
            if seen > 100:
                raise GrammarError(f"$ref cycle {at(path)}", "$ref", path)
        return s

    # ---- main entry ----
    def run(self) -> dict:
        body = self.norm(self.root, "")
        if body is False:
            raise GrammarError("schema 'false' accepts nothing", "false", "")
        if self.defs:
            body = dict(body)
            body["$defs"] = self.defs
        return _length_patterns(body, "")

    def norm(self, node: Any, path: str) -> Any:
        if node is True:
            return {}
        if node is False:
            return False
        if not isinstance(node, dict):
            raise GrammarError(f"schema must be an object or boolean {at(path)}", None, path)
        node = self._upgrade(node, path)
        own = {k: v for k, v in node.items() if k not in ("$ref", "allOf")}
        parts = []
        if "$ref" in node:
            ptr = self._resolve(node["$ref"], path)
            if self.draft <= 7:
                return self._ref_node(ptr, path)
            parts.append(("ref", ptr))
        if "allOf" in node:
            if not isinstance(node["allOf"], list) or not node["allOf"]:
                raise GrammarError(f"'allOf' must be a non-empty array {at(path)}", "allOf", path)
            for i, b in enumerate(node["allOf"]):
                parts.append(("schema", (b, f"{path}/allOf/{i}")))
        if not parts:
            return self._local(own, path)
        has_own = any(k in ASSERTIONS or k in UNSUPPORTED for k in own)  # (refused by `_local`)
        if len(parts) == 1 and not has_own:
            kind, x = parts[0]
            return self._ref_node(x, path) if kind == "ref" else self.norm(*x)
        acc = self._local(own, path) if has_own else {}
        for kind, x in parts:
            if kind == "ref":
                other = self._ref_node(x, path)
            else:
                other = self.norm(*x)
            acc = self.merge(acc, other, path, "allOf" if kind == "schema" else "$ref")
        return acc

    def _ref_node(self, ptr: str, path: str) -> Any:
        if ptr in self.inlining:
            raise GrammarError(f"$ref cycle {at(path)}", "$ref", path)
        return self.ref_to(ptr)

    def _upgrade(self, node: dict, path: str) -> dict:
        """Older-draft spellings -> 2020-12."""
        node = dict(node)
        items = node.get("items")
        if isinstance(items, list):
            node["prefixItems"] = items
            if "additionalItems" in node:
                node["items"] = node.pop("additionalItems")
            else:
                node.pop("items")
        else:
            node.pop("additionalItems", None)  # no effect unless items is an array
        for ex, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(node.get(ex), bool):
                if node.pop(ex) and bound in node:
                    node[ex] = node.pop(bound)
        return node

    # ---- one schema object without $ref/allOf ----
    def _local(self, node: dict, path: str) -> Any:
        out: dict = {}
        for k, v in node.items():
            if k in UNSUPPORTED:
                if k == "dependencies" and not v:
                    continue
                raise unsupported(k, path, UNSUPPORTED[k])
        # type
        types = None
        if "type" in node:
            t = node["type"]
            tl = [t] if isinstance(t, str) else t
            if not isinstance(tl, list) or not tl or not all(x in JSON_TYPES for x in tl):
                raise GrammarError(f"invalid 'type' {at(path)}", "type", path)
            types = list(dict.fromkeys(tl))
        elif not any(k in node for k in ("enum", "const", "anyOf", "oneOf")):
            inferred = []
            for kws, t in ((OBJECT_KW, "object"), (ARRAY_KW, "array"), (STRING_KW, "string"),
                           (NUMBER_KW, "number")):
                if any(k in node for k in kws):
                    if t == "string" and set(node) & set(STRING_KW) == {"format"} \
                            and node["format"] not in ENFORCED_FORMATS | UNENFORCED_FORMATS:
                        continue  # custom format on an untyped schema: annotation only
                    inferred.append(t)
            if inferred:
                # every type, the keywords' first: xgrammar ignores typed keywords without a `type`,
                # and applies each to its own type within a list (exact: in JSON Schema
                # {"minLength": 2} accepts any non-string)
                types = inferred + [t for t in UNTYPED_ORDER if t not in inferred]
        if types is not None:
            out["type"] = types[0] if len(types) == 1 else types
        tset = set(types) if types else set(JSON_TYPES)

        # strings
        if tset & {"string"}:
            fmt = node.get("format")
            if fmt is not None and not isinstance(fmt, str):
                fmt = None
            if fmt in UNENFORCED_FORMATS:
                raise unsupported("format", path, f"format '{fmt}' is not enforced by xgrammar")
            enforced_fmt = fmt if fmt in ENFORCED_FORMATS else None
            if "pattern" in node:
                if enforced_fmt:
                    raise unsupported("format", path, "format combined with pattern")
                out["pattern"] = convert_pattern(node["pattern"], path)
            elif enforced_fmt in FORMAT_PATTERNS:
                out["pattern"] = json_string_regex(FORMAT_PATTERNS[enforced_fmt])
            elif enforced_fmt:
                out["format"] = enforced_fmt
            for k in ("minLength", "maxLength"):
                if k in node:
                    if "pattern" in out or "format" in out:
                        raise unsupported(k, path, "length bounds combined with pattern/format "
                                                   "are ignored by xgrammar")
                    out[k] = node[k]
        # numbers
        if tset & {"number", "integer"}:
            for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if k in node:
                    if not isinstance(node[k], (int, float)) or isinstance(node[k], bool):
                        raise GrammarError(f"'{k}' must be a number {at(path)}", k, path)
                    if "number" in tset and isinstance(node[k], int) and float(node[k]) != node[k]:
                        # xgrammar bounds numbers as doubles: minimum 2**53 + 1 let 2**53 through
                        raise unsupported(k, path, "a number bound past 2**53 that a double cannot hold "
                                                   "is not enforced exactly")
                    if "integer" in tset and not -2 ** 63 <= node[k] < 2 ** 63:
                        # xgrammar bounds integers in 64 bits (a bound of 1e23 failed its own check)
                        raise unsupported(k, path, "an integer bound outside the 64-bit range is not enforced")
                    out[k] = node[k]
            if out.get("type") == "integer":
                _integer_bounds(out, path)
            if "multipleOf" in node:
                m = node["multipleOf"]
                if not (isinstance(m, (int, float)) and not isinstance(m, bool) and m > 0
                        and float(m).is_integer() and "number" not in tset):
                    raise unsupported("multipleOf", path,
                                      "only integer multipleOf on integer types is enforced")
                out["multipleOf"] = int(m)
        # arrays
        if tset & {"array"}:
            if "prefixItems" in node:
                pi = node["prefixItems"]
                out["prefixItems"] = [self.norm(s, f"{path}/prefixItems/{i}")
                                      for i, s in enumerate(pi)]
            if "items" in node:
                out["items"] = self.norm(node["items"], f"{path}/items")
            for k in ("minItems", "maxItems"):
                if k in node:
                    out[k] = node[k]
            if "items" not in out and "prefixItems" not in out and _positive(node.get("minItems")):
                # any items, as without minItems: xgrammar's strict mode closes such an array (no array
                # of 2 items is left for minItems 2)
                out["items"] = {}
            if node.get("uniqueItems") is True and not (node.get("maxItems", 2) <= 1):
                raise unsupported("uniqueItems", path, "a grammar keeps items distinct only over a few known "
                                                       f"values: an enum of up to {MAX_SET_VALUES}, more under a "
                                                       "maxItems; drop it, or use list[...] where a pydantic model "
                                                       "has set[...]")
        # objects
        if tset & {"object"}:
            self._object(node, out, path)
        empty = _drop_empty_types(out, path)
        if empty is not None:
            return self._no_value(empty, path)
        # enum / const
        if "enum" in node or "const" in node:
            return self._enum(node, out, path)
        # anyOf / oneOf
        for kw in ("anyOf", "oneOf"):
            if kw in node:
                out = self._union(kw, node[kw], out, path)
        return out

    def _object(self, node: dict, out: dict, path: str) -> None:
        props = node.get("properties", {})
        if not isinstance(props, dict):
            raise GrammarError(f"'properties' must be an object {at(path)}", "properties", path)
        addl = node.get("additionalProperties")
        new_props = {}
        for name, sub in props.items():
            new_props[name] = self.norm(sub, f"{path}/properties/{pointer_token(name)}")
        required = node.get("required", [])
        if not isinstance(required, list):
            raise GrammarError(f"'required' must be an array {at(path)}", "required", path)
        required = list(dict.fromkeys(required))
        pp = node.get("patternProperties")
        pat_schema = None
        if pp:
            if not isinstance(pp, dict):
                raise GrammarError(f"'patternProperties' must be an object {at(path)}",
                                   "patternProperties", path)
            normed = {p: self.norm(s, f"{path}/patternProperties/{pointer_token(p)}") for p, s in pp.items()}
            schemas = list(normed.values())
            if any(_json_key(s) != _json_key(schemas[0]) for s in schemas[1:]):
                raise unsupported("patternProperties", path,
                                  "several patterns with different schemas")
            pat_schema = schemas[0]
            conv = [convert_pattern(p, path, "patternProperties") for p in normed]
            out["patternProperties"] = {
                (conv[0] if len(conv) == 1 else "|".join(f"({c})" for c in conv)): pat_schema}
            for name in list(new_props) + [r for r in node.get("required", [])
                                           if isinstance(r, str)]:
                # xgrammar lets a declared name match the pattern branch instead (unsound)
                if any(re.search(p, name) for p in normed):
                    raise unsupported("patternProperties", path,
                                      f"pattern overlaps declared property '{name}'")
        addl_n = None
        if addl is not None:
            addl_n = self.norm(addl, f"{path}/additionalProperties")
        for name in required:  # xgrammar ignores required names that are not declared
            if name not in new_props:
                if addl_n is False:
                    raise GrammarError(f"required property '{name}' is forbidden by "
                                       f"additionalProperties: false {at(path)}", "required", path)
                else:
                    new_props[name] = addl_n if isinstance(addl_n, dict) else {}
        open_obj = addl_n is not False and not (self.strict and addl is None and "patternProperties" not in node)
        self._drop_absent(new_props, required, out, open_obj, path)
        escaped = [n for n in new_props if any(json_must_escape(ord(c)) for c in n)]
        if open_obj and escaped:
            # xgrammar lets such a name's own spelling through the other-properties branch too, where
            # its value goes unchecked (a declared name is matched only where JSON writes it as is)
            raise unsupported("properties", path, f"property name {escaped[0]!r} is written with JSON escapes, "
                                                  "in an object open to other properties")
        if "propertyNames" in node:
            pn = node["propertyNames"]
            self._check_names(pn, list(new_props), path)
            out["propertyNames"] = _keys_are_strings(self.norm(pn, f"{path}/propertyNames"))
        if new_props or "properties" in node:
            out["properties"] = new_props
        if required:
            out["required"] = required
        if addl_n is not None:
            out["additionalProperties"] = addl_n
        for k in ("minProperties", "maxProperties"):
            if k in node:
                out[k] = node[k]
        if not new_props and addl_n is None and "patternProperties" not in node and _positive(node.get("minProperties")):
            # any properties, as without minProperties: xgrammar's strict mode closes such an object
            out["additionalProperties"] = {}

    def _drop_absent(self, props: dict, required: list, out: dict, open_obj: bool, path: str) -> None:
        """Properties (and patternProperties) whose schema is `false` must be absent. xgrammar
        refuses the `false` ("cannot accept any value", no path); in a closed object leaving them
        out is the same, in an open one it would let them in with any value."""
        absent = [name for name, sub in props.items() if sub is False]
        pattern_absent = out.get("patternProperties") and next(iter(out["patternProperties"].values())) is False
        if not absent and not pattern_absent:
            return
        for name in absent:
            if name in required:
                why = self.no_value.get(f"{path}/properties/{pointer_token(name)}")
                raise why or GrammarError(f"required property '{name}' has the schema false: no object satisfies it "
                                          f"{at(path)}", "required", path)
        if open_obj:
            what = f"property '{absent[0]}'" if absent else "patternProperties"
            raise unsupported("properties" if absent else "patternProperties", path,
                              f"{what} has the schema false (must be absent) in an object open to other properties; "
                              "close it with additionalProperties false, or use the llguidance backend")
        for name in absent:
            del props[name]
        if pattern_absent:
            del out["patternProperties"]

    def _check_names(self, pn: Any, names: list, path: str) -> None:
        """xgrammar does not apply propertyNames to declared properties: check them here."""
        if not names:
            return
        if isinstance(pn, dict) and "$ref" in json.dumps(pn):
            raise unsupported("propertyNames", path, "$ref inside propertyNames")
        import jsonschema

        v = jsonschema.Draft202012Validator(pn)
        for n in names:
            if not v.is_valid(n):
                raise GrammarError(f"property '{n}' violates propertyNames {at(path)}",
                                   "propertyNames", path)

    def _enum(self, node: dict, out: dict, path: str) -> dict:
        if "const" in node:
            values = [node["const"]]
            if "enum" in node:
                values = [v for v in values if _json_key(v) in {_json_key(e) for e in node["enum"]}]
        else:
            values = node["enum"]
            if not isinstance(values, list) or not values:
                raise GrammarError(f"'enum' must be a non-empty array {at(path)}", "enum", path)
        rest = {k: v for k, v in node.items() if k in ASSERTIONS and k not in ("enum", "const")}
        if rest:
            values = self._filter_values(values, rest, path, "enum")
        seen, uniq = set(), []
        for v in values:
            if _json_key(v) not in seen:
                seen.add(_json_key(v))
                uniq.append(v)
        if not uniq:
            return self._no_value(GrammarError(f"no 'enum'/'const' value satisfies the other keywords {at(path)}",
                                               "enum", path), path)
        if _has_wide_integer(uniq):  # xgrammar's grammar for such a value matches no text
            raise unsupported("const" if "const" in node else "enum", path, "integers past 64 bits are not written")
        return {"enum": uniq}

    def _no_value(self, why: GrammarError, path: str) -> bool:
        """A schema with no value is `false` where that has a meaning (an optional property absent, an
        anyOf branch dropped), kept with its reason for the 400 of a place that needs a value; at the
        root that 400 at once."""
        if not path:
            raise why
        self.no_value[path] = why
        return False

    def _filter_values(self, values: list, schema: dict, path: str, kw: str) -> list:
        if "$ref" in json.dumps(schema):
            # resolve against the original document
            schema = dict(schema)
            schema["$defs"] = {}
            doc = copy.deepcopy(self.root) if isinstance(self.root, dict) else {}
            doc.update({k: v for k, v in schema.items() if k != "$defs"})
            schema = doc
        import jsonschema

        try:
            V = jsonschema.validators.validator_for(self.root if isinstance(self.root, dict) else {},
                                                    default=jsonschema.Draft202012Validator)
            v = V(schema, format_checker=V.FORMAT_CHECKER)
            return [x for x in values if v.is_valid(x)]
        except Exception as e:  # noqa: BLE001
            raise GrammarError(f"cannot check '{kw}' values {at(path)}: {e}", kw, path) from None

    def _union(self, kw: str, branches: Any, siblings: dict, path: str) -> dict:
        if not isinstance(branches, list) or not branches:
            raise GrammarError(f"'{kw}' must be a non-empty array {at(path)}", kw, path)
        normed = []
        for i, b in enumerate(branches):
            nb = self.norm(b, f"{path}/{kw}/{i}")
            if nb is False:
                continue
            if {k: v for k, v in siblings.items()}:
                try:
                    nb = self.merge(siblings, nb, f"{path}/{kw}/{i}", kw)
                except _Unsat:
                    continue
            normed.append(nb)
        if not normed:
            raise GrammarError(f"no '{kw}' branch can be satisfied {at(path)}", kw, path)
        if len(normed) > MAX_BRANCHES:
            raise unsupported(kw, path, f"more than {MAX_BRANCHES} branches after expansion")
        if kw == "oneOf" and len(normed) > 1:
            normed = self._objects_only(normed, path)
            for i in range(len(normed)):
                for j in range(i + 1, len(normed)):
                    if not self.disjoint(normed[i], normed[j], path):
                        raise unsupported("oneOf", path, f"branches {i} and {j} are not provably "
                                                         "disjoint; xgrammar enforces anyOf")
        if len(normed) == 1:
            return normed[0]
        # a oneOf proven disjoint is its anyOf: said so, xgrammar does not log that it approximates it
        return {"anyOf": normed}

    def _objects_only(self, branches: list, path: str) -> list:
        """oneOf branches that each constrain objects alone (no `type`, object keywords only: a
        non-object matches every one of them, which two or more of them refuse) as the same
        branches typed "object": exact, and then their discriminators can prove them disjoint."""
        try:
            bodies = [self.deref(b, path) for b in branches]
        except GrammarError:
            return branches
        every = set(UNTYPED_ORDER)
        for b in bodies:
            if not isinstance(b, dict) or _types_of(b) is None or not every <= _types_of(b):
                return branches
            if any(k not in OBJECT_KW and k not in ANNOTATIONS and k != "type" for k in b):
                return branches
        return [{**b, "type": "object"} for b in bodies]

    # ---- merging (allOf, $ref siblings, union distribution) ----
    def merge(self, a: Any, b: Any, path: str, kw: str) -> Any:
        if a is False or b is False:
            raise _Unsat(f"'{kw}' can never be satisfied {at(path)}", kw, path)
        if a == {}:
            return b
        if b == {}:
            return a
        a, b = self.deref(a, path), self.deref(b, path)
        if a is False or b is False:
            raise _Unsat(f"'{kw}' can never be satisfied {at(path)}", kw, path)
        for x, y in ((a, b), (b, a)):
            for u in ("anyOf", "oneOf"):
                if u in x:
                    out = []
                    for br in x[u]:
                        try:
                            out.append(self.merge(br, y, path, kw))
                        except _Unsat:
                            pass
                    if not out:
                        raise _Unsat(f"'{kw}' can never be satisfied {at(path)}", kw, path)
                    if len(out) > MAX_BRANCHES:
                        raise unsupported(kw, path, "too many branches after expansion")
                    return out[0] if len(out) == 1 else {u: out}
        if "enum" in a or "enum" in b:
            vals, other = (a["enum"], b) if "enum" in a else (b["enum"], a)
            if "enum" in other:
                keys = {_json_key(v) for v in other["enum"]}
                vals = [v for v in vals if _json_key(v) in keys]
                other = {k: v for k, v in other.items() if k != "enum"}
            if other:
                vals = self._filter_normalized(vals, other, path, kw)
            if not vals:
                raise _Unsat(f"'{kw}' can never be satisfied {at(path)}", kw, path)
            return {"enum": vals}
        out = dict(a)
        tuples = "prefixItems" in a or "prefixItems" in b
        if tuples:
            out.update(self._merge_tuples(a, b, path, kw))
        for k, vb in b.items():
            if tuples and k in ("prefixItems", "items"):
                continue
            if k not in out:
                out[k] = vb
                continue
            va = out[k]
            if _json_key(va) == _json_key(vb):
                continue
            if k == "type":
                ta = {va} if isinstance(va, str) else set(va)
                tb = {vb} if isinstance(vb, str) else set(vb)
                eff = lambda t: t | ({"integer"} if "number" in t else set())  # noqa: E731
                t = eff(ta) & eff(tb)
                if "number" in t:
                    t.discard("integer")
                if not t:
                    raise _Unsat(f"'{kw}' has incompatible types {at(path)}", kw, path)
                order = [x for x in ["null", "boolean", "object", "array", "number", "integer",
                                     "string"] if x in t]
                out[k] = order[0] if len(order) == 1 else order
            elif k in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"):
                out[k] = max(va, vb)
            elif k in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"):
                out[k] = min(va, vb)
            elif k == "required":
                out[k] = list(dict.fromkeys(va + vb))
            elif k in ("properties", "additionalProperties"):
                pass  # handled below
            elif k == "items":
                out[k] = self.merge(va, vb, path, kw)
            else:
                raise unsupported(kw, path, f"cannot merge differing '{k}'")
        if "properties" in a or "properties" in b or "additionalProperties" in a \
                or "additionalProperties" in b:
            self._merge_objects(a, b, out, path, kw)
        empty = _drop_empty_types(out, path)
        if empty is not None:
            raise _Unsat(str(empty), empty.keyword, path)  # (an anyOf branch made of it is dropped)
        return out

    def _merge_tuples(self, a: dict, b: dict, path: str, kw: str) -> dict:
        """prefixItems and items of two array schemas merged position by position: each one's
        `items` applies after its own prefixItems, so the other's prefix meets it there."""
        def at_index(s: dict, i: int):
            prefix = s.get("prefixItems", [])
            return prefix[i] if i < len(prefix) else s.get("items", {})
        n = max(len(a.get("prefixItems", [])), len(b.get("prefixItems", [])))
        prefix = []
        for i in range(n):
            sa, sb = at_index(a, i), at_index(b, i)
            if sa is False or sb is False:
                raise unsupported(kw, path, "cannot merge a closed tuple with a longer one")
            prefix.append(self.merge(sa, sb, f"{path}/prefixItems/{i}", kw))
        ia, ib = a.get("items"), b.get("items")
        out: dict = {"prefixItems": prefix}
        if ia is False or ib is False:
            out["items"] = False
        elif ia is not None or ib is not None:
            out["items"] = self.merge(ia if ia is not None else {}, ib if ib is not None else {}, path, kw)
        return out

    def _merge_objects(self, a: dict, b: dict, out: dict, path: str, kw: str) -> None:
        if ("patternProperties" in a or "patternProperties" in b) and \
                _json_key(a.get("patternProperties")) != _json_key(b.get("patternProperties")):
            raise unsupported(kw, path, "cannot merge objects with patternProperties")
        pa, pb = a.get("properties", {}), b.get("properties", {})
        aa, ab = a.get("additionalProperties"), b.get("additionalProperties")
        props = {}
        for name in list(pa) + [n for n in pb if n not in pa]:
            sa = pa.get(name, aa if aa is not None else {})
            sb = pb.get(name, ab if ab is not None else {})
            if sa is False or sb is False:
                if name in out.get("required", []):
                    raise _Unsat(f"required property '{name}' is forbidden {at(path)}", kw, path)
                continue
            props[name] = self.merge(sa, sb, f"{path}/properties/{pointer_token(name)}", kw)
        out["properties"] = props
        if aa is None and ab is None:
            out.pop("additionalProperties", None)
        elif aa is None or ab is None:
            out["additionalProperties"] = ab if aa is None else aa
        elif aa is False or ab is False:
            out["additionalProperties"] = False
        else:
            out["additionalProperties"] = self.merge(aa, ab, path, kw)

    def _filter_normalized(self, vals: list, schema: dict, path: str, kw: str) -> list:
        if "$ref" in json.dumps(schema):
            raise unsupported(kw, path, "enum combined with a $ref schema")
        import jsonschema

        v = jsonschema.Draft202012Validator(schema)
        return [x for x in vals if v.is_valid(x)]

    # ---- disjointness (for oneOf) ----
    def disjoint(self, a: Any, b: Any, path: str) -> bool:
        try:
            a, b = self.deref(a, path), self.deref(b, path)
        except GrammarError:
            return False
        if a is False or b is False:
            return True
        if "enum" in a and "enum" in b:
            return not ({_json_key(v) for v in a["enum"]} & {_json_key(v) for v in b["enum"]})
        for x, y in ((a, b), (b, a)):
            if "enum" in x:
                ty = _types_of(y)
                if ty is not None and all(not types_overlap({value_type(v)}, ty)
                                          for v in x["enum"]):
                    return True
                if "$ref" not in json.dumps(y) and "anyOf" not in y and "oneOf" not in y:
                    try:
                        return not self._filter_normalized(x["enum"], y, path, "oneOf")
                    except GrammarError:
                        return False
                return False
        for x, y in ((a, b), (b, a)):
            for u in ("anyOf", "oneOf"):
                if u in x:
                    return all(self.disjoint(br, y, path) for br in x[u])
        ta, tb = _types_of(a), _types_of(b)
        if ta is not None and tb is not None and not types_overlap(ta, tb):
            return True
        if ta is not None and tb is not None and ta == {"object"} and tb == {"object"}:
            pa, pb = a.get("properties", {}), b.get("properties", {})
            ra, rb = set(a.get("required", [])), set(b.get("required", []))
            for p in ra & rb:  # discriminator
                if p in pa and p in pb and self.disjoint(pa[p], pb[p], path):
                    return True
            for x, y, rx in ((a, b, ra), (b, a, rb)):  # x requires a key y forbids
                closed = y.get("additionalProperties", False if self.strict else None) is False
                if closed and "patternProperties" not in y:
                    if rx - set(y.get("properties", {})):
                        return True
        return False


def _integer_bounds(s: dict, path: str) -> None:
    """An integer's bounds as the inclusive whole numbers they mean (exact): xgrammar refused
    `minimum: 1.5` ("Integer constraint must be a whole number") and took exclusive bounds with no
    integer between them (1 and 2) for "Invalid range", naming neither keyword nor place."""
    lows = [k for k in ("minimum", "exclusiveMinimum") if k in s]
    highs = [k for k in ("maximum", "exclusiveMaximum") if k in s]
    low = max((math.ceil(s[k]) if k == "minimum" else math.floor(s[k]) + 1 for k in lows), default=None)
    high = min((math.floor(s[k]) if k == "maximum" else math.ceil(s[k]) - 1 for k in highs), default=None)
    if low is not None and high is not None and low > high:
        bounds = ", ".join(f"'{k}' {s[k]}" for k in lows + highs)
        raise GrammarError(f"no integer satisfies {bounds} {at(path)}", highs[-1], path)
    for k in lows + highs:
        del s[k]
    if low is not None:
        s["minimum"] = low
    if high is not None:
        s["maximum"] = high


# bounds that leave a type no value when the lower passes the upper
_SIZE_BOUNDS = (("string", "minLength", "maxLength"), ("array", "minItems", "maxItems"),
                ("object", "minProperties", "maxProperties"))
_NUMBER_BOUNDS = (("minimum", "maximum", False), ("exclusiveMinimum", "maximum", True),
                  ("minimum", "exclusiveMaximum", True), ("exclusiveMinimum", "exclusiveMaximum", True))


def _positive(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _empty_types(s: dict) -> dict:
    """The types whose bounds in `s` contradict each other -> (lower keyword, upper keyword)."""
    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    empty = {}
    for t, lo, hi in _SIZE_BOUNDS:
        if num(s.get(lo)) and num(s.get(hi)) and s[lo] > s[hi]:
            empty[t] = (lo, hi)
    for lo, hi, strict in _NUMBER_BOUNDS:
        if num(s.get(lo)) and num(s.get(hi)) and (s[lo] >= s[hi] if strict else s[lo] > s[hi]):
            empty["number"] = empty["integer"] = (lo, hi)
            break
    return empty


def _drop_empty_types(s: dict, path: str) -> GrammarError | None:
    """A type whose bounds contradict each other (minLength 5, maxLength 3) has no value: it leaves
    the schema's types (exact: the others are still valid); the only one, the schema has no value,
    and the error naming the bounds is returned (xgrammar's own errors, "Invalid range", an EBNF
    parser's "Lower bound is larger than upper bound", said neither where nor which)."""
    types = s.get("type")
    if types is None:
        return None
    empty = _empty_types(s)
    listed = [types] if isinstance(types, str) else types
    left = [t for t in listed if t not in empty]
    if len(left) == len(listed):
        return None
    if not left:
        lo, hi = empty[listed[0]]
        return GrammarError(f"'{lo}' {s[lo]} is past '{hi}' {s[hi]} {at(path)}: no value satisfies both", hi, path)
    s["type"] = left[0] if len(left) == 1 else left
    for t in set(listed) - set(left):
        for k in empty[t]:
            s.pop(k, None)
    return None


def _keys_are_strings(names: Any) -> Any:
    """A propertyNames schema typed "string" where its types include it: xgrammar builds the key
    grammar from it, and a typed keyword without `type` lists every type (`_local`), which would
    let an unquoted `-2` be a key. Keys are strings, so this is exact."""
    if isinstance(names, dict) and isinstance(names.get("type"), list) and "string" in names["type"]:
        return {**names, "type": "string"}
    return names


class _Unsat(GrammarError):
    pass


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "items", "propertyNames")


def _length_patterns(s: Any, path: str) -> Any:
    """The normalized schema with every string length bound as a pattern (in place)."""
    if not isinstance(s, dict):
        return s
    if "minLength" in s or "maxLength" in s:
        lo, hi = s.pop("minLength", 0), s.pop("maxLength", None)
        if "pattern" in s or "format" in s:  # from a merge: xgrammar ignores the bounds there
            raise unsupported("maxLength" if hi is not None else "minLength", path,
                              "length bounds combined with pattern/format")
        if lo > MAX_LENGTH_BOUND:
            raise unsupported("minLength", path, f"minLength over {MAX_LENGTH_BOUND}")
        if hi is not None:
            hi = min(hi, MAX_LENGTH_BOUND)
        if lo or hi is not None:
            s["pattern"] = "^.{" + str(lo) + "," + ("" if hi is None else str(hi)) + "}$"
    for k in _SCHEMA_MAPS:
        if isinstance(s.get(k), dict):
            for name, sub in s[k].items():
                _length_patterns(sub, f"{path}/{k}/{pointer_token(name)}")
    for k in _SCHEMA_LISTS:
        if isinstance(s.get(k), list):
            for i, sub in enumerate(s[k]):
                _length_patterns(sub, f"{path}/{k}/{i}")
    for k in _SCHEMA_VALUES:
        _length_patterns(s.get(k), f"{path}/{k}")
    return s


def prepare_schema(schema: Any, strict: bool = True) -> dict:
    """Validate and rewrite a JSON schema for xgrammar; raises GrammarError."""
    if schema is True:
        schema = {}
    if schema is False:
        raise GrammarError("schema 'false' accepts nothing", "false", "")
    if not isinstance(schema, dict):
        raise GrammarError("JSON schema must be an object or boolean")
    try:
        _check_counts(schema, "")
        return _Normalizer(schema, strict).run()
    except RecursionError:
        raise GrammarError("JSON schema nests too deeply") from None


_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def _check_counts(node: Any, path: str) -> None:
    """GrammarError naming the first length or count bound that is not a non-negative integer
    (`maxLength: "2"` had failed a comparison deep in the normalizer: a TypeError, not a 400); an
    integral float (`2.0`, an integer to JSON Schema) becomes an int, in place (the schema is the
    caller's parse of the request's)."""
    if isinstance(node, list):
        for i, v in enumerate(node):
            _check_counts(v, f"{path}/{i}")
        return
    if not isinstance(node, dict):
        return
    for k, v in node.items():
        if k in _COUNT_KEYWORDS:
            if isinstance(v, float) and v.is_integer() and v >= 0:
                node[k] = v = int(v)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise GrammarError(f"'{k}' must be a non-negative integer {at(path)} (it is {json.dumps(v)})", k, path)
    for _, below, v in children(node, path):
        _check_counts(v, below)

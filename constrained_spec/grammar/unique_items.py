"""`uniqueItems` over a few known values: the one kind of it a grammar can keep.

A grammar cannot remember which items an array has written, so `uniqueItems: true` is refused in
general. Where an array's items are a small finite set of values (pydantic's `set[Literal["a",
"b"]]`, `set[SomeEnum]`, `set[bool]`), the arrays without repeats are few enough to list: each is
written as its values in the set's order, and the array schema becomes the `anyOf` of those arrays
that fit its `minItems`/`maxItems`, each an array of `const` items (an `enum` of the arrays would
have xgrammar write them without whitespace). That is a narrowing (one order of each set), which a
set does not notice.
"""
from __future__ import annotations

import json
from itertools import combinations
from math import comb
from typing import Any, Optional

from .errors import GrammarError, at
from .json_types import value_type
from .schema_refs import local_target
from .schema_walk import ANNOTATIONS, INERT_BESIDE_REF, rewrite_children

# arrays listed at most: 7 values without bounds on the count (2**7); more values with a bound. The
# normalizer takes an anyOf of up to 129 branches for xgrammar; 128 compile in ~0.1 s (dev VM)
MAX_ARRAYS = 128
MAX_SET_VALUES = 7
# the listed arrays' JSON text at most (long values listed 64 times over would bloat the grammar)
MAX_LISTED_CHARS = 65536
# kept beside the rewritten array (a root array holds the document's definitions)
_KEPT = ANNOTATIONS | {"$defs", "definitions", "$schema", "$id"}
_ARRAY_KEYWORDS = frozenset(("type", "items", "uniqueItems", "minItems", "maxItems")) | _KEPT
_VALUE_KEYWORDS = frozenset(("type", "enum", "const")) | ANNOTATIONS


def known_value_sets_as_enums(schema: Any) -> Any:
    """The schema with each `uniqueItems` array over a few known values written as the `anyOf` of
    its arrays; everything else as it is (the input is not changed). GrammarError where no array of
    distinct values has the count asked for."""
    root = schema

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, list):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        out = rewrite_children(node, lambda v, below, _k: walk(v, below), path)
        arrays = _distinct_arrays(root, node, path) if node.get("uniqueItems") is True else None
        if arrays is None:
            return out
        return {"anyOf": [_exactly(a) for a in arrays], **{k: v for k, v in out.items() if k in _KEPT}}

    return walk(schema, "")


def _distinct_arrays(root: Any, node: dict, path: str) -> Optional[list]:
    """Every array of distinct values of the node's items, in their order, that its counts allow;
    None unless the node is such an array (of `type` array: without one, any other value is valid
    too) and they are at most MAX_ARRAYS and MAX_LISTED_CHARS."""
    if set(node) - _ARRAY_KEYWORDS or node.get("type") not in ("array", ["array"]):
        return None
    values = _known_values(root, node.get("items"))
    lo, hi = node.get("minItems", 0), node.get("maxItems")
    if values is None or not _count(lo) or (hi is not None and not _count(hi)):
        return None
    hi = len(values) if hi is None else min(hi, len(values))
    if lo > hi:
        raise GrammarError(f"no array of distinct items has minItems {lo} items {at(path)}: its items take "
                           f"{len(values)} values" + (f" and maxItems is {hi}" if hi < len(values) else ""),
                           "minItems", path)
    count = sum(comb(len(values), n) for n in range(lo, hi + 1))
    longest = sum(len(json.dumps(v)) + 2 for v in values)
    if count > MAX_ARRAYS or count * longest > MAX_LISTED_CHARS:
        return None
    return [list(c) for n in range(lo, hi + 1) for c in combinations(values, n)]


def _exactly(array: list) -> dict:
    """The schema of this one array."""
    if not array:
        return {"type": "array", "maxItems": 0}
    return {"type": "array", "prefixItems": [{"const": v} for v in array], "items": False, "minItems": len(array)}


def _known_values(root: Any, items: Any, depth: int = 0) -> Optional[list]:
    """The values an items schema allows, distinct and in its order, where it lists them (`enum`,
    `const`, a `boolean` or `null` type, or a local `$ref` to one); else None."""
    if not isinstance(items, dict) or depth > 8:
        return None
    if "$ref" in items:
        if set(items) - INERT_BESIDE_REF:
            return None
        return _known_values(root, local_target(root, items["$ref"]), depth + 1)
    if set(items) - _VALUE_KEYWORDS:
        return None
    types = items.get("type")
    types = [types] if isinstance(types, str) else types
    if "const" in items and "enum" in items:
        return None  # (their intersection: rare enough to leave refused)
    if "const" in items:
        listed = [items["const"]]
    elif "enum" in items and isinstance(items["enum"], list):
        listed = items["enum"]
    elif types in (["boolean"], ["null"]):
        listed = [False, True] if types == ["boolean"] else [None]
    else:
        return None
    if types is not None:
        if not isinstance(types, list):
            return None
        allowed = set(types) | ({"integer"} if "number" in types else set())
        listed = [v for v in listed if value_type(v) in allowed]
    distinct, seen = [], set()
    for v in listed:
        key = _json_identity(v)
        if key not in seen:
            seen.add(key)
            distinct.append(v)
    return distinct


def _json_identity(v: Any) -> str:
    """Values JSON Schema calls equal (1 and 1.0, [1] and [1.0]) share it; true and 1 do not."""
    return json.dumps(_integral_as_int(v), sort_keys=True)


def _integral_as_int(v: Any) -> Any:
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        return [_integral_as_int(x) for x in v]
    if isinstance(v, dict):
        return {k: _integral_as_int(x) for k, x in v.items()}
    return v


def _count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0

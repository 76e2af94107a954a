"""JSON Schema's instance types of values, and when two sets of types can share an instance (an
integer is a number: 1 and 1.0 are both)."""
from __future__ import annotations

from typing import Any


def value_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def types_overlap(a, b) -> bool:
    ea = set(a) | ({"integer"} if "number" in a else set())
    eb = set(b) | ({"integer"} if "number" in b else set())
    return bool(ea & eb)

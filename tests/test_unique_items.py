"""`uniqueItems` over a few known values (pydantic's `set[Literal[...]]`, `set[SomeEnum]`,
`set[bool]`): served under both backends as the arrays of distinct values in the set's order; any
other `uniqueItems` array stays refused (CPU, SmolLM2 tokenizer, no model)."""
from __future__ import annotations

import json
from enum import Enum
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from constrained_spec.grammar import GrammarBackend, GrammarError, GrammarSpec
from constrained_spec.grammar.unique_items import known_value_sets_as_enums


class Colour(str, Enum):
    red = "red"
    green = "green"


class Order(BaseModel):
    sizes: set[Literal["s", "m", "l"]] = Field(min_length=1, max_length=2)
    colours: frozenset[Colour]
    flags: set[bool] = set()
    counts: set[Literal[1, 2]]


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = GrammarBackend(tokenizer, 49152, max_whitespace_cnt=16)
    yield b
    b.close()


def _accepts(backend, tokenizer, compiled, text: str) -> bool:
    m = backend.matcher(compiled)
    t = tokenizer.encode(text, add_special_tokens=False)
    return m.accept_tokens(t) == len(t) and m.can_terminate()


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_a_pydantic_set_of_known_values_is_served(backend, tokenizer, name):
    compiled = backend.compile(GrammarSpec.json_schema(Order.model_json_schema()).with_backend(name))
    for text, ok in [
        ('{"sizes": ["s", "l"], "colours": ["red", "green"], "flags": [false, true], "counts": [1, 2]}', True),
        ('{"sizes": [\n    "m"\n  ], "colours": [ ], "counts": [ 2 ]}', True),  # whitespace as anywhere
        ('{"sizes": ["s", "m", "l"], "colours": [], "counts": []}', False),  # max_length 2
        ('{"sizes": [], "colours": [], "counts": []}', False),  # min_length 1
        ('{"sizes": ["m"], "colours": ["red", "red"], "counts": []}', False),  # a repeat
        ('{"sizes": ["m"], "colours": ["green", "red"], "counts": []}', False),  # not the set's order
        ('{"sizes": ["m"], "colours": [], "counts": [3]}', False),
    ]:
        assert _accepts(backend, tokenizer, compiled, text) == ok, (name, text)
    Order.model_validate_json('{"sizes": ["s", "l"], "colours": ["red", "green"], "counts": [1, 2]}')


def test_the_rewrite_lists_distinct_values_in_order():
    schema = {"type": "array", "uniqueItems": True, "title": "t",
              "items": {"enum": [2, 1, 2.0, "a", True], "type": ["integer", "boolean"]}}
    out = known_value_sets_as_enums(schema)
    arrays = [[item["const"] for item in b.get("prefixItems", [])] for b in out["anyOf"]]
    assert arrays == [[], [2], [1], [True], [2, 1], [2, True], [1, True], [2, 1, True]]  # 2.0 is 2; "a" no integer
    assert out["title"] == "t" and schema["uniqueItems"] is True  # (the input is not changed)
    via_ref = {"$defs": {"c": {"const": "x"}}, "type": "array", "uniqueItems": True, "items": {"$ref": "#/$defs/c"}}
    assert len(known_value_sets_as_enums(via_ref)["anyOf"]) == 2


@pytest.mark.parametrize("schema", [
    {"type": "array", "uniqueItems": True, "items": {"type": "string"}},  # set[str]: no values to list
    {"type": "array", "uniqueItems": True, "items": {"enum": list(range(8))}},  # 256 arrays
    {"type": "array", "uniqueItems": True, "items": {"enum": [1, 2]}, "contains": {"const": 1}},
    {"type": "array", "uniqueItems": True, "items": {"enum": [{"a": 1}, {"a": 2}], "description": "d"}, "maxItems": "2"},
    {"type": "array", "uniqueItems": True, "items": {"const": 1, "enum": [2]}},  # (no value: left to refuse)
    {"type": "array", "uniqueItems": True, "items": {"enum": ["x" * 3000, "y" * 3000, "z" * 3000]}},  # too long to list
])
def test_other_unique_arrays_stay_refused(backend, schema):
    assert known_value_sets_as_enums(schema) == schema
    with pytest.raises(GrammarError) as e:
        backend.compile(GrammarSpec.json_schema(schema).with_backend("auto"))
    assert "uniqueItems" in str(e.value) or e.value.keyword in ("uniqueItems", "contains", "maxItems"), str(e.value)


def test_many_values_under_a_count_bound_are_listed(backend, tokenizer):
    schema = {"type": "object", "required": ["pick"], "properties": {"pick": {
        "type": "array", "uniqueItems": True, "maxItems": 2, "items": {"enum": [f"v{i}" for i in range(10)]}}}}
    spec = GrammarSpec.json_schema(schema)
    assert len(json.loads(spec.value)["properties"]["pick"]["anyOf"]) == 1 + 10 + 45
    compiled = backend.compile(spec.with_backend("xgrammar"))
    assert _accepts(backend, tokenizer, compiled, '{"pick": ["v3", "v9"]}')
    assert not _accepts(backend, tokenizer, compiled, '{"pick": ["v9", "v9"]}')


def test_edges_of_the_rewrite():
    # equal in JSON Schema, nested too: [1] and [1.0] are one value, listed once
    nested = {"type": "array", "uniqueItems": True, "items": {"enum": [[1], [1.0], [2]]}}
    assert len(known_value_sets_as_enums(nested)["anyOf"]) == 4
    # without `type: array` a string or a number is valid too: not rewritten (and so refused)
    untyped = {"uniqueItems": True, "items": {"enum": [1, 2]}}
    assert known_value_sets_as_enums(untyped) == untyped
    # more items asked for than there are values: the 400 names minItems where it stands
    with pytest.raises(GrammarError) as e:
        GrammarSpec.json_schema({"type": "object", "properties": {"s": {
            "type": "array", "uniqueItems": True, "minItems": 3, "items": {"enum": ["a", "b"]}}}})
    assert (e.value.keyword, e.value.path) == ("minItems", "/properties/s"), str(e.value)

"""The JSON-schema rewrites for llguidance (`grammar/llguidance_schema.py`): a `oneOf` whose branches
cannot share a JSON type becomes `anyOf`, `format` values no draft defines and empty `dependencies`
are dropped, property dependencies become `allOf` entries and a `oneOf` of required property sets an
`anyOf`, so llguidance takes schemas it used to refuse (they went to xgrammar, compiling in seconds, or were refused). The rewrites must leave the language alone: unit cases, then random token walks through
the real dev schemas they concern (SmolLM2 tokenizer, no model), every completed walk valid for the
ORIGINAL schema."""
from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from constrained_spec.grammar import GrammarBackend, GrammarSpec
from constrained_spec.grammar.llguidance_schema import (STANDARD_FORMATS, one_of_by_type_as_any_of,
                                                        one_of_required_sets_as_any_of,
                                                        dependencies_as_all_of, required_negations_as_absences,
                                                        type_negations_as_types, without_inert_keywords)
from test_grammar_soundness import special_ids, validation_error

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 49152
STOP = 2  # <|im_end|>
NULLABLE_DATE = {"$ref": "#/$defs/date"}
DEFS = {"date": {"type": "string", "format": "date-time"}, "n": {"type": "integer"}, "loop": {"$ref": "#/$defs/loop"}}


def rewritten(one_of, **extra):
    return one_of_by_type_as_any_of({"$defs": DEFS, "properties": {"x": {"oneOf": one_of, **extra}}})["properties"]["x"]


def test_one_of_with_branches_of_disjoint_types_becomes_any_of():
    assert "anyOf" in rewritten([NULLABLE_DATE, {"type": "null"}])
    assert "anyOf" in rewritten([{"type": ["string", "boolean"]}, {"type": "array"}, {"const": 3}])
    assert "anyOf" in rewritten([{"enum": ["a", None]}, {"type": "object"}])
    assert "anyOf" in rewritten([False, {"type": "string"}])
    nested = one_of_by_type_as_any_of({"items": {"oneOf": [{"type": "string"}, {"type": "null"}]}})
    assert nested == {"items": {"anyOf": [{"type": "string"}, {"type": "null"}]}}


@pytest.mark.parametrize("one_of", [
    [{"type": "string"}, {"type": "string", "maxLength": 3}],  # may share an instance
    [{"type": "integer"}, {"type": "number"}],  # an integer is a number
    [{"$ref": "#/$defs/n"}, {"const": 2.0}],  # 2.0 is an integer
    [{"minLength": 2}, {"type": "null"}],  # no type: any type
    [{"$ref": "#/$defs/missing"}, {"type": "null"}],
    [{"$ref": "#/$defs/loop"}, {"type": "null"}],
    [{"$ref": "https://example.com/s"}, {"type": "null"}],
    [{"$ref": "#date"}, {"type": "null"}],  # an anchor: not resolved here (it once read as the root)
    [True, {"type": "null"}],
])
def test_one_of_that_may_share_an_instance_stays(one_of):
    assert rewritten(one_of) == {"oneOf": one_of}


def test_one_of_beside_any_of_or_under_a_nested_id_stays():
    both = {"oneOf": [{"type": "string"}, {"type": "null"}], "anyOf": [{"type": "string"}]}
    assert rewritten(both["oneOf"], anyOf=both["anyOf"]) == both
    # `#/...` inside a subschema with its own $id resolves against that resource, not the document
    doc = {"$defs": {"a": {"$id": "https://x.org/a", "$defs": {"d": {"type": "string"}},
                           "oneOf": [{"$ref": "#/$defs/d"}, {"type": "null"}]}}}
    assert one_of_by_type_as_any_of(doc) == doc


def test_rewrites_leave_data_and_input_alone():
    schema = {"type": "object", "enum": [{"oneOf": [{"type": "string"}, {"type": "null"}], "format": "mine"}],
              "default": {"format": "mine"}, "examples": [{"format": "x"}],
              "properties": {"format": {"type": "string", "format": "int64"},
                             "when": {"type": "string", "format": "uri-reference"},
                             "v": {"oneOf": [{"type": "string"}, {"type": "null"}]}}}
    before = copy.deepcopy(schema)
    out = without_inert_keywords(one_of_by_type_as_any_of(schema))
    assert schema == before
    assert all(out[k] == before[k] for k in ("enum", "default", "examples"))
    assert out["properties"]["format"] == {"type": "string"}  # a property named format keeps its schema
    assert out["properties"]["when"]["format"] == "uri-reference"  # a standard format stays (llguidance refuses it)
    assert "anyOf" in out["properties"]["v"]
    assert {"date", "date-time", "email", "uri", "ipv4", "regex"} <= STANDARD_FORMATS


def test_empty_dependencies_are_dropped_and_properties_named_so_kept():
    schema = {"type": "object", "dependencies": {}, "dependentRequired": {"a": ["b"]},
              "properties": {"dependencies": {}, "format": {}}, "additionalProperties": False,
              "$defs": {"dependencies": {"dependentSchemas": {}}}}
    out = without_inert_keywords(schema)
    assert "dependencies" not in out and out["dependentRequired"] == {"a": ["b"]}
    assert out["properties"] == {"dependencies": {}, "format": {}}
    assert out["$defs"] == {"dependencies": {}}


def test_property_dependencies_become_all_of_any_of():
    either = lambda a, *deps: {"anyOf": [{"properties": {a: False}}, {"required": [*deps, a]}]}
    schema = {"type": "object", "dependentRequired": {"a": ["b", "a"]}, "allOf": [{"type": "object"}],
              "properties": {"dependencies": {"type": "string"}, "o": {"dependencies": {"x": ["y"], "z": []}}},
              "default": {"dependencies": {"q": ["r"]}}}
    before = copy.deepcopy(schema)
    out = dependencies_as_all_of(schema)
    assert schema == before and "dependentRequired" not in out
    assert out["allOf"] == [{"type": "object"}, either("a", "b")]  # appended; a name does not depend on itself
    assert out["properties"]["dependencies"] == {"type": "string"}  # a property named so keeps its schema
    assert out["properties"]["o"] == {"allOf": [either("x", "y"), either("z")]}
    # required names in their declared order, where declared
    declared = dependencies_as_all_of({"properties": {"b": {}, "a": {}}, "dependentRequired": {"b": ["c", "a"]}})
    assert declared["allOf"] == [{"anyOf": [{"properties": {"b": False}}, {"required": ["b", "a", "c"]}]}]
    assert out["default"] == before["default"]  # data
    # schema dependencies: "a absent, or its schema holds" (false: a absent; true: nothing)
    mixed = dependencies_as_all_of({"dependencies": {"a": ["b"], "c": {"required": ["d"], "dependentSchemas": {"d": False}}},
                                    "dependentSchemas": {"e": False, "f": True}})
    assert mixed == {"allOf": [either("a", "b"),
                               {"anyOf": [{"properties": {"c": False}}, {"required": ["d"], "allOf": [{"properties": {"d": False}}]}]},
                               {"properties": {"e": False}}]}
    # malformed: an allOf that is no list, a name where names or a schema go, names under dependentSchemas
    kept = [{"dependentRequired": {"a": ["b"]}, "allOf": {}}, {"dependencies": {"a": "b"}}, {"dependentSchemas": {"a": ["b"]}},
            {"dependentRequired": {"a": {"required": ["b"]}}}]
    for s in kept:
        assert dependencies_as_all_of(s) == s


def check_served_by_llguidance(tokenizer, schema: dict, cases) -> None:
    """The schema compiles with llguidance (via auto), and each (text, ok) of `cases` is accepted to
    its end, and valid for a validator, exactly when ok."""
    b = GrammarBackend(tokenizer, VOCAB, default_backend="auto", compile_workers=1)
    try:
        compiled = b.compile(GrammarSpec.json_schema(schema))
        assert compiled.backend == "llguidance"
        for text, ok in cases:
            m = b.matcher(compiled)
            toks = tokenizer.encode(text, add_special_tokens=False)
            assert (m.accept_tokens(toks) == len(toks) and m.can_terminate()) == ok, text
            assert (validation_error(schema, text) is None) == ok, text
    finally:
        b.close()


def test_a_property_dependency_is_enforced(tokenizer):
    """`a` present needs `b`: an object with `a` alone cannot close, with both it can, and one
    without `a` can (where it used to be refused). The grammar writes properties in their declared
    order."""
    schema = {"$schema": "http://json-schema.org/draft-07/schema#",  # whose `dependencies` a validator checks
              "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                               "c": {"type": "integer"}},
              "dependencies": {"a": ["b"]}, "additionalProperties": False}
    check_served_by_llguidance(tokenizer, schema, (
        ('{"a": 1, "b": 2}', True), ('{"a": 1, "b": 2, "c": 3}', True), ('{"c": 3}', True), ("{}", True),
        ('{"a": 1}', False), ('{"a": 1, "c": 3}', False)))


def test_one_of_required_sets_becomes_any_of():
    absent = lambda n: {"properties": {n: False}}
    two = one_of_required_sets_as_any_of({"type": "object", "oneOf": [
        {"required": ["length", "width"], "description": "a rectangle"}, {"required": ["radius"]}]})
    assert "oneOf" not in two and two["anyOf"] == [
        {"type": "object", "required": ["length", "width"], "allOf": [absent("radius")]},
        {"type": "object", "required": ["radius"], "allOf": [{"anyOf": [absent("length"), absent("width")]}]}]
    # a set that holds another can never match alone: it goes; shared names are not asked absent
    three = one_of_required_sets_as_any_of({"oneOf": [{"required": ["a"]}, {"required": ["a", "b"]},
                                                      {"required": ["b", "c"]}]})
    assert three["anyOf"] == [
        {"type": "object", "required": ["a"], "allOf": [absent("b"), {"anyOf": [absent("b"), absent("c")]}]},
        {"type": "object", "required": ["b", "c"], "allOf": [absent("a")]}]
    nested = one_of_required_sets_as_any_of({"items": {"oneOf": [{"required": ["x"]}, {"required": ["y"]}]}})
    assert "anyOf" in nested["items"]
    for kept in ({"oneOf": [{"required": ["x"]}]}, {"oneOf": [{"required": ["x"]}, {"required": ["y"], "type": "object"}]},
                 {"oneOf": [{"required": ["x"]}, {"required": ["y"]}], "anyOf": [{}]},
                 {"enum": [{"oneOf": [{"required": ["x"]}, {"required": ["y"]}]}]}):
        assert one_of_required_sets_as_any_of(kept) == kept


def test_one_of_required_sets_is_enforced(tokenizer):
    """Exactly one of the two property sets: either alone closes, both or neither do not (where it
    used to be refused)."""
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
              "properties": {"length": {"type": "integer"}, "width": {"type": "integer"}, "radius": {"type": "integer"}},
              "oneOf": [{"required": ["length", "width"]}, {"required": ["radius"]}]}
    check_served_by_llguidance(tokenizer, schema, (
        ('{"length": 1, "width": 2}', True), ('{"radius": 3}', True), ('{"length": 1, "radius": 3}', True),
        ('{"length": 1, "width": 2, "radius": 3}', False), ('{"length": 1}', False), ("{}", False)))


def test_not_of_required_names_becomes_their_absence():
    absent = lambda *names: [{"properties": {n: False}} for n in names]
    schema = {"type": "object", "not": {"required": ["crs", "srs"], "description": "not both"},
              "properties": {"p": {"not": {"required": ["x"]}, "allOf": [{"minProperties": 1}]}}}
    out = required_negations_as_absences(schema)
    assert "not" not in out and out["allOf"] == [{"type": "object", "anyOf": absent("crs", "srs")}]
    assert out["properties"]["p"] == {"allOf": [{"minProperties": 1}, {"type": "object", **absent("x")[0]}]}
    for kept in ({"not": {"required": ["a"], "minProperties": 1}}, {"not": {"required": []}},
                 {"not": {"type": "string"}}, {"not": {"required": ["a"]}, "allOf": {}}):
        assert required_negations_as_absences(kept) == kept


def test_not_of_required_names_is_enforced(tokenizer):
    """"Either crs or srs, not both; both may be omitted": objects with one, or none, close;
    with both, or a non-object, not (where the schema used to go to xgrammar, which refused `not`)."""
    schema = {"anyOf": [{"description": "not both", "not": {"required": ["crs", "srs"]}}],
              "properties": {"crs": {"type": "string"}, "srs": {"type": "string"}}}
    check_served_by_llguidance(tokenizer, schema, [
        ('{"crs": "a"}', True), ('{"srs": "b"}', True), ('{}', True),
        ('{"crs": "a", "srs": "b"}', False), ('5', False), ('"crs"', False)])


def test_not_of_types_becomes_the_types_left():
    assert type_negations_as_types({"not": {"type": ["array", "object", "null"]}}) == {"type": ["string", "number", "boolean"]}
    assert type_negations_as_types({"type": ["integer", "string"], "not": {"type": "number"}}) == {"type": "string"}
    assert type_negations_as_types({"items": {"not": {"type": "string"}, "type": ["string", "null"]}}) == {"items": {"type": "null"}}
    for kept in ({"not": {"type": "integer"}}, {"type": "number", "not": {"type": "integer"}},
                 {"type": "string", "not": {"type": "string"}}, {"not": {"type": "string", "minLength": 2}}):
        assert type_negations_as_types(kept) == kept


def test_schema_dependencies_and_not_of_types_are_enforced(tokenizer):
    """"A format names the type's formats" (a schema dependency) and "a default is no array, object
    or null" (a not of types): served by llguidance, exactly."""
    schema = {"$schema": "http://json-schema.org/draft-07/schema#",  # whose `dependencies` a validator checks
              "type": "object", "properties": {"type": {"enum": ["integer", "string"]}, "format": {"type": "string"},
                                               "default": {"not": {"type": ["array", "object", "null"]}}},
              "required": ["type"], "additionalProperties": False,
              "dependencies": {"format": {"properties": {"type": {"enum": ["string"]}}}}}
    check_served_by_llguidance(tokenizer, schema, [
        ('{"type": "integer"}', True), ('{"type": "string", "format": "date"}', True),
        ('{"type": "integer", "format": "int32"}', False), ('{"type": "string", "default": 3}', True),
        ('{"type": "string", "default": "x"}', True), ('{"type": "string", "default": null}', False),
        ('{"type": "string", "default": [1]}', False)])


def test_auto_serves_rewritten_schemas_with_llguidance(tokenizer):
    b = GrammarBackend(tokenizer, VOCAB, default_backend="auto", compile_workers=1)
    try:
        nullable = {"$defs": DEFS, "type": "object", "properties": {"d": {"oneOf": [NULLABLE_DATE, {"type": "null"}]}},
                    "required": ["d"]}
        assert b.compile(GrammarSpec.json_schema(nullable)).backend == "llguidance"
        assert b.compile(GrammarSpec.json_schema({"type": "string", "format": "my-own"})).backend == "llguidance"
        # a oneOf neither can prove disjoint goes to the normalizer, which refuses it
        overlapping = {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}
        with pytest.raises(Exception) as e:
            b.compile(GrammarSpec.json_schema(overlapping))
        assert getattr(e.value, "keyword", None) == "oneOf"
    finally:
        b.close()


def concerned(row) -> bool:
    """A dev schema the rewrites change."""
    s = row["schema"]
    return (one_of_by_type_as_any_of(s) != s or without_inert_keywords(s) != s
            or dependencies_as_all_of(s) != s or one_of_required_sets_as_any_of(s) != s
            or required_negations_as_absences(s) != s or type_negations_as_types(s) != s)


def walk(matcher, never: np.ndarray, short: np.ndarray, vocab_bytes: list, rng: random.Random, max_steps: int = 300):
    """Random tokens the matcher allows, short ones (1-2 bytes) mostly, so that walks finish; (text or
    None, problems)."""
    bitmask = torch.zeros((1, (VOCAB + 31) // 32), dtype=torch.int32)
    out = []
    for _ in range(max_steps):
        matcher.fill_bitmask(bitmask, 0)
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:VOCAB]
        allowed = np.flatnonzero(bits)
        if np.any(never[allowed]):
            return None, ["a special token is allowed"]
        if len(allowed) == 0:
            return None, ["no token allowed before the grammar ended"]
        if STOP in allowed and rng.random() < 0.7:
            assert matcher.accept_token(STOP)
            return b"".join(vocab_bytes[i] for i in out), []
        few = allowed[short[allowed]]
        pool = few if len(few) and rng.random() < 0.8 else allowed
        t = int(pool[rng.randrange(len(pool))])
        if t == STOP:
            assert matcher.accept_token(STOP)
            return b"".join(vocab_bytes[i] for i in out), []
        assert matcher.accept_token(t)
        out.append(t)
    return None, []


def test_walks_through_rewritten_dev_schemas_validate(tokenizer):
    rows = [json.loads(line) for line in (ROOT / "schemas" / "jsonschemabench-dev.jsonl").read_text().splitlines()]
    rows = [r for r in rows if concerned(r)]
    assert len(rows) >= 10, len(rows)
    b = GrammarBackend(tokenizer, VOCAB, default_backend="llguidance", compile_workers=1)
    never = np.zeros(VOCAB, dtype=bool)
    never[sorted(special_ids(tokenizer) - {STOP})] = True
    vocab_bytes = [bytes(t) for t in b.tokenizer_info.decoded_vocab]
    short = np.array([0 < len(t) <= 2 for t in vocab_bytes] + [False] * (VOCAB - len(vocab_bytes)))
    short[STOP] = False
    served = completed = 0
    failures = []
    try:
        for row in rows:
            try:
                compiled = b.compile(GrammarSpec.json_schema(row["schema"]))
            except Exception:  # noqa: BLE001 (refused for another keyword: not this test's concern)
                continue
            served += 1
            rng = random.Random(row["id"])
            for _ in range(3):
                text, problems = walk(b.matcher(compiled), never, short, vocab_bytes, rng)
                if text is not None:
                    completed += 1
                    err = validation_error(row["schema"], text.decode("utf-8"))
                    problems = problems + ([err] if err else [])
                if problems:
                    failures.append((row["id"], text, problems))
    finally:
        b.close()
    assert not failures, failures[:5]
    print(f"\n{len(rows)} dev schemas rewritten, {served} served by llguidance, {completed} walks completed")
    assert served >= 8 and completed >= served, (served, completed, len(rows))

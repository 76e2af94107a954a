"""The one way down a JSON schema: which values below a schema object are subschemas, or hold some.

Every keyword's value is, but a data keyword's (`enum`, `const`, `default`, `examples`, OpenAPI's
`example`: instances, whatever keywords they spell), and a schema map's keys are names, not
keywords (`properties: {"enum": {...}}` is a property named "enum"). Keywords this does not know
(`x-foo`, a later draft's) are entered too: a subschema found there constrains nothing, and a walk
that looks for something (a `$ref`, a count) must not miss it where it does.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

DATA_KEYWORDS = frozenset(("enum", "const", "default", "examples", "example"))
# keyword -> {name: subschema}; `dependencies` and `dependentRequired` may map a name to names
SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                         "dependencies", "dependentRequired"))
# keywords that say nothing about the instance (JSON Schema's annotations, OpenAPI's `example`)
ANNOTATIONS = frozenset(("title", "description", "$comment", "default", "examples", "example", "deprecated",
                         "readOnly", "writeOnly"))
# what may stand beside a `$ref` and still say nothing about the instance
INERT_BESIDE_REF = ANNOTATIONS | {"$ref", "$defs", "definitions", "$schema", "$id", "$anchor"}


def pointer_token(name: Any) -> str:
    """A key as a JSON pointer writes it."""
    return str(name).replace("~", "~0").replace("/", "~1")


def children(node: dict, path: str = "") -> Iterator[tuple[str, str, Any]]:
    """(keyword, JSON pointer, value) of each value below the schema object `node` (at `path`) that
    is a subschema or may hold one; a list (`anyOf`, `prefixItems`) comes whole, its items at
    pointer/0, pointer/1, ..."""
    for k, v in node.items():
        if k in DATA_KEYWORDS:
            continue
        if k in SCHEMA_MAPS and isinstance(v, dict):
            for name, sub in v.items():
                yield k, f"{path}/{k}/{pointer_token(name)}", sub
        else:
            yield k, f"{path}/{pointer_token(k)}", v


def rewrite_children(node: dict, rewrite: Callable[[Any, str, str], Any], path: str = "") -> dict:
    """A copy of the schema object with each value `children` yields replaced by rewrite(value, its
    JSON pointer, its keyword); data keywords' values and schema maps' names as they are."""
    out = {}
    for k, v in node.items():
        if k in DATA_KEYWORDS:
            out[k] = v
        elif k in SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: rewrite(sub, f"{path}/{k}/{pointer_token(name)}", k) for name, sub in v.items()}
        else:
            out[k] = rewrite(v, f"{path}/{pointer_token(k)}", k)
    return out

"""GrammarSpec: what a request asks the output to conform to."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from typing import Optional, Union

from .errors import GrammarError
from .schema_refs import check_ref_cycles
from .unique_items import known_value_sets_as_enums

KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice")
# JSON nesting of a schema document (objects and arrays). The compilers walk schemas recursively;
# far deeper documents hit Python's recursion limit, in a place that answered 500 (measured: 1,000
# levels). The deepest schema under schemas/ nests 18.
MAX_SCHEMA_DEPTH = 256
_TOO_DEEP = (f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels of objects and arrays in its own "
             "text (each level of an answer's nesting takes two or more there)")
# schemas up to this size are checked once (`_check_document`; at most ~1,024 x 32K characters held)
MAX_REMEMBERED_SCHEMA_CHARS = 32768
# grammar backends a request may name (grammar/backend.py): "auto" picks one per grammar
BACKENDS = ("xgrammar", "llguidance", "auto")


@dataclass(frozen=True)
class GrammarSpec:
    """kind is one of KINDS; value is a normalized string (compact JSON for json_schema/choice).

    ``strict`` only matters for json_schema (OpenAI ``strict``: objects without
    ``additionalProperties`` are closed, arrays with ``prefixItems`` and no ``items`` are closed).
    ``backend`` is one of BACKENDS, or None for the server's default.
    """

    kind: str
    value: str
    strict: bool = True
    backend: Optional[str] = None

    @property
    def key(self) -> tuple:
        return (self.kind, self.value, self.strict if self.kind == "json_schema" else True)

    # ---- constructors ----
    @classmethod
    def json_schema(cls, schema: Union[dict, str, bool], strict: bool = True) -> "GrammarSpec":
        if isinstance(schema, (str, bytes)):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("JSON schema must be a JSON object or boolean")
        try:
            # Key order is kept on purpose: xgrammar emits properties in declaration order.
            value = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        except RecursionError:
            raise GrammarError(_TOO_DEEP) from None
        if len(value) > MAX_REMEMBERED_SCHEMA_CHARS:
            _check_schema(schema)
        else:
            _check_document(value)
        if '"uniqueItems":true' in value:
            # a set of a few known values is listed for both backends (neither keeps items distinct)
            value = json.dumps(known_value_sets_as_enums(schema), separators=(",", ":"), ensure_ascii=False)
        return cls("json_schema", value, bool(strict))

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("regex must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, grammar: str) -> "GrammarSpec":
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError("EBNF grammar must be a non-empty string")
        return cls("ebnf", grammar)

    @classmethod
    def choice(cls, options: list) -> "GrammarSpec":
        if not isinstance(options, (list, tuple)) or not options or not all(
            isinstance(o, str) and o for o in options
        ):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(options), separators=(",", ":"), ensure_ascii=False))

    def with_backend(self, backend: Optional[str]) -> "GrammarSpec":
        """The same grammar, compiled by `backend` (one of BACKENDS; None: the server's default)."""
        if backend is not None and backend not in BACKENDS:
            raise GrammarError(f"grammar backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
        return replace(self, backend=backend)

    def schema(self):
        """The parsed schema (json_schema kind only)."""
        return json.loads(self.value)


def _check_schema(schema) -> None:
    _check_depth(schema)
    check_ref_cycles(schema)


@functools.lru_cache(maxsize=1024)
def _check_document(value: str) -> None:
    """`_check_schema` of a compact schema document, remembered: a server sees the same schemas again
    and again, and the walks cost 7-8x the serialization (~40 us of a front-end's time for a
    750-character schema, ~300 us for 4,700). A failing document raises and is not remembered."""
    _check_schema(json.loads(value))


def _check_depth(schema) -> None:
    """GrammarError if the schema nests deeper than MAX_SCHEMA_DEPTH (walked without recursion)."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(_TOO_DEEP)
        stack.extend((child, depth + 1) for child in children)

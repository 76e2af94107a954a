"""From a request's constraint fields to one GrammarSpec (or none), and grammar errors to 400s.

A request may carry at most one constraint:

* ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
* extensions: ``regex`` (a regular expression the whole output matches), ``ebnf`` or ``grammar``
  (an EBNF grammar in xgrammar/GBNF syntax, start rule ``root``), ``choice`` (the output is exactly one
  of the strings); vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``) and its older ``guided_regex``, ``guided_grammar``, ``guided_choice`` and
  ``guided_json`` are aliases, and so are SGLang's ``json_schema`` and llama.cpp's ``schema`` in a
  ``json_object`` response_format;
* ``tools`` with a ``tool_choice`` that forces a call (`tools.py`).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import orjson

from .errors import APIError, bad_request
from .protocol import ResponseFormatJsonObject, ResponseFormatJsonSchema, _GenerationRequest, boolean_schema
from .tools import ToolCallPlan, tool_call_plan

MAX_CHOICES = 4096


class CheckedGrammars:
    """The grammars a front-end has seen compile, least recently used out first, bounded by their
    total length. A request whose grammar is here skips the up-front compile check: in the split
    server that check is a round trip through the engine process (a call, a thread there, a reply)
    for what is nearly always a cache hit, on the path of every constrained request. A grammar that
    compiled once compiles again; a compile that fails is not remembered, so its error is reported
    each time. Used from the event loop only."""

    def __init__(self, max_chars: int = 16 << 20):
        self.max_chars = max_chars
        self._specs: "OrderedDict[Any, int]" = OrderedDict()
        self._chars = 0

    def __contains__(self, spec) -> bool:
        if spec not in self._specs:
            return False
        self._specs.move_to_end(spec)
        return True

    def add(self, spec) -> None:
        if spec in self._specs:
            return
        size = len(spec.value)
        self._specs[spec] = size
        self._chars += size
        while self._chars > self.max_chars and self._specs:
            self._chars -= self._specs.popitem(last=False)[1]


def constraint_fields(req: _GenerationRequest) -> list[tuple[str, str, Any]]:
    """The constraints a request sets, as (kind, request field, value)."""
    found: list[tuple[str, str, Any]] = []
    tools = bool(getattr(req, "tools", None)) and req.tool_choice != "none"
    rf = req.response_format
    if tools:
        pass  # a JSON response_format shapes the answer beside the calls (`tools.response_format_schema`)
    elif isinstance(rf, ResponseFormatJsonSchema):
        found.append(("json_schema", "response_format", rf.json_schema))
    elif isinstance(rf, ResponseFormatJsonObject) and rf.schema_ is not None:  # (llama.cpp's spelling)
        found.append(("schema_value", "response_format.schema", rf.schema_))
    elif isinstance(rf, ResponseFormatJsonObject):
        found.append(("json_object", "response_format", None))
    for field, kind in _CONSTRAINT_FIELDS:
        value = getattr(req, field)
        if value is not None:
            found.append((kind, field, value))
    if req.structured_outputs is not None:
        for field, value in req.structured_outputs.constraints():
            found.append((_STRUCTURED_OUTPUTS_KINDS[field], f"structured_outputs.{field}", value))
    if tools:
        found.append(("tool_call", "tools", None))
    return found


_CONSTRAINT_FIELDS = (("regex", "regex"), ("guided_regex", "regex"), ("ebnf", "ebnf"), ("grammar", "ebnf"),
                      ("guided_grammar", "ebnf"), ("choice", "choice"), ("guided_choice", "choice"),
                      ("guided_json", "schema_value"), ("json_schema", "schema_value"))
_STRUCTURED_OUTPUTS_KINDS = {"json": "schema_value", "regex": "regex", "choice": "choice", "grammar": "ebnf",
                             "json_object": "json_object"}
# the request fields whose grammar errors are a schema's, a regex's, a choice list's
_SCHEMA_PARAMS = ("guided_json", "structured_outputs.json", "json_schema")
_REGEX_PARAMS = ("regex", "guided_regex", "structured_outputs.regex")
_CHOICE_PARAMS = ("choice", "guided_choice", "structured_outputs.choice")


def grammar_spec_for(req: _GenerationRequest, plan: ToolCallPlan | None = None):
    """The GrammarSpec this request asks for, or None, with the grammar backend it names
    (`grammar_backend`); `plan`, the request's ToolCallPlan where the caller has made it already.
    Raises APIError(400) on conflicting or empty constraints and on an unknown backend;
    schema/grammar *content* errors surface later from compilation (see `grammar_error`)."""
    from ..grammar.spec import BACKENDS  # deferred: keeps the protocol importable without xgrammar

    backend = req.grammar_backend
    if backend is not None and backend not in BACKENDS:
        raise bad_request(f"'grammar_backend' must be one of {', '.join(BACKENDS)}; got {backend!r}",
                          param="grammar_backend", code="invalid_value")
    spec = _spec_for(req, plan)
    return spec if spec is None or backend is None else spec.with_backend(backend)


def _spec_for(req: _GenerationRequest, plan: ToolCallPlan | None = None):
    found = constraint_fields(req)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f"'{f}'" for _, f, _ in found)
        raise bad_request(f"at most one constraint per request; this one sets {names}", param=found[1][1],
                          code="conflicting_constraints")
    from ..grammar import GrammarSpec  # deferred: keeps the protocol importable without xgrammar

    kind, field, value = found[0]
    if kind == "tool_call":
        return (plan or tool_call_plan(req)).grammar()
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        schema = value.schema_
        if schema is None:
            return GrammarSpec.json_object()
        strict = True if value.strict is None else bool(value.strict)
        return GrammarSpec.json_schema(schema, strict=strict)
    if kind == "schema_value":  # a schema as JSON or as its text
        if isinstance(value, str):
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError as e:
                raise bad_request(f"{field} is not valid JSON: {e}", param=field, code="invalid_schema")
        try:
            value = boolean_schema(value)  # its text may be `true` or `false`
        except ValueError as e:
            raise bad_request(f"invalid value for '{field}': {e}", param=field, code="invalid_schema")
        if not isinstance(value, dict):
            raise bad_request(f"{field} must be a JSON schema object", param=field, code="invalid_schema")
        return GrammarSpec.json_schema(value, strict=True)
    if kind == "regex":
        if not value:
            raise bad_request(f"'{field}' must not be empty", param=field)
        return GrammarSpec.regex(value)
    if kind == "ebnf":
        if not value.strip():
            raise bad_request(f"'{field}' must not be empty", param=field)
        return GrammarSpec.ebnf(value)
    if kind == "choice":
        if not value:
            raise bad_request(f"'{field}' must list at least one string", param=field)
        if len(value) > MAX_CHOICES:
            raise bad_request(f"'{field}' may list at most {MAX_CHOICES} strings", param=field)
        if any(not s for s in value):
            raise bad_request(f"'{field}' must not contain empty strings", param=field)
        return GrammarSpec.choice(list(value))
    raise AssertionError(kind)


def constraint_param(req: _GenerationRequest) -> str | None:
    """The request field that carries the constraint (for error messages)."""
    found = constraint_fields(req)
    if not found:
        return None
    kind, field, _ = found[0]
    if kind == "json_schema":
        return "response_format.json_schema.schema"
    return field


def grammar_error(err: Exception, param: str | None) -> APIError:
    """A GrammarError (bad or unsupported schema, regex, grammar) as a 400 naming keyword and path."""
    keyword = getattr(err, "keyword", None)
    path = getattr(err, "path", None)
    message = str(err) or err.__class__.__name__
    extra = []
    if keyword and f"'{keyword}'" not in message and f'"{keyword}"' not in message and keyword not in message:
        extra.append(f"keyword '{keyword}'")
    if path is not None and str(path) not in message:
        extra.append(f"at path '{path or '/'}'")
    if extra:
        message = f"{message} ({', '.join(extra)})"
    from ..grammar.errors import GrammarTooComplex  # deferred, as above
    if isinstance(err, GrammarTooComplex):  # valid, but not compiled in time: not "invalid"
        prefix, code = "", "grammar_too_complex"
    elif param and param.startswith(("response_format", "tools")) or param in _SCHEMA_PARAMS:
        prefix, code = "invalid JSON schema: ", "invalid_schema"
        if keyword and ("unsupported" in message.lower() or "not supported" in message.lower()):
            code = "unsupported_schema"
    elif param in _REGEX_PARAMS:
        prefix, code = "invalid regex: ", "invalid_regex"
    elif param in _CHOICE_PARAMS:
        prefix, code = "invalid choice list: ", "invalid_choice"
    else:
        prefix, code = "invalid grammar: ", "invalid_grammar"
    if message.lower().startswith(prefix.split(":")[0].lower()):
        prefix = ""
    # `param` names the request field; the JSON pointer inside the schema is in the message
    return APIError(400, prefix + message, param=param, code=code)

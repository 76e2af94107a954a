"""OpenAI tool calls (`tools`, `tool_choice`) as a constraint: the call a request forces is generated
under the JSON schema of its function's parameters, so its arguments always parse and validate.

* `tool_choice: {"type": "function", "function": {"name": f}}`: the output is f's arguments, a JSON
  object under f's `parameters`.
* `"required"`: the output is `{"name": f, "arguments": {...}}` for one of the tools (`anyOf` over
  them, the name first), split into name and arguments for the response.
* `"none"`: no call, and the tools are not shown to the model.
* `"auto"`, OpenAI's default when tools are given, leaves the choice between text and a call to the
  model, in its own call format, which no grammar decides: refused (400) naming the two choices above.

One call per choice. The model sees the tools through its chat template where the template takes
them (`tools=`); otherwise as a block appended to the system prompt.
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from .errors import bad_request

# an arguments object with no parameters declared: `{}` (OpenAI: "omitting parameters defines a
# function with an empty parameter list")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# where a "required" call's arguments start: after its name
_REQUIRED_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_WRAPPER_TAIL = re.compile(r"\s*\}?\s*$")  # what may be the end of a "required" call's wrapper


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallPlan:
    """What a request's `tools` and `tool_choice` ask for: `forced` names the one function called,
    or is None for `required` (the model picks)."""
    functions: tuple  # the request's ToolFunction models, in order
    forced: str | None
    strict: bool

    @property
    def schema(self) -> dict:
        if self.forced is not None:
            return self._parameters(self._function(self.forced))
        return {"anyOf": [{"type": "object",
                           "properties": {"name": {"const": f.name}, "arguments": self._parameters(f)},
                           "required": ["name", "arguments"], "additionalProperties": False}
                          for f in self.functions]}

    def grammar(self):
        from ..grammar import GrammarSpec  # deferred: keeps the protocol side importable without xgrammar
        return GrammarSpec.json_schema(self.schema, strict=self.strict)

    # -- the prompt ------------------------------------------------------------------------------
    def tools_for_template(self) -> list[dict]:
        return [{"type": "function", "function": {"name": f.name, "description": f.description or "",
                                                  "parameters": self._parameters(f)}} for f in self.functions]

    def with_instructions(self, messages: list[dict]) -> list[dict]:
        """The messages with the tools described in the system prompt (for a template that takes
        no `tools`)."""
        listed = "\n".join(orjson.dumps({"name": f.name, "description": f.description or "",
                                         "parameters": self._parameters(f)}).decode() for f in self.functions)
        if self.forced is not None:
            ask = f"Call the function {self.forced}: answer with its arguments as one JSON object."
        else:
            ask = 'Call one of them: answer with one JSON object {"name": ..., "arguments": {...}}.'
        block = f"You can call these functions:\n{listed}\n{ask}"
        if messages and messages[0]["role"] == "system":
            first = messages[0]
            return [{**first, "content": f"{first['content']}\n\n{block}" if first["content"] else block}, *messages[1:]]
        return [{"role": "system", "content": block}, *messages]

    # -- the response ----------------------------------------------------------------------------
    def message(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """A choice's message and finish reason from its output text: the call (`tool_calls`,
        finish `tool_calls`; `length` if cut short, with the arguments as far as they got). A
        `required` output cut before its name is complete holds no call: its text is the content."""
        name, arguments = self._split(text, finished=finish_reason == "stop")
        reason = finish_reason_of_call(finish_reason)
        if name is None:
            return {"role": "assistant", "content": text, "refusal": None}, reason
        call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
        return {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]}, reason

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)

    def _split(self, text: str, finished: bool) -> tuple[str | None, str]:
        if self.forced is not None:
            return self.forced, text
        head = _REQUIRED_HEAD.match(text)  # the grammar puts the name first
        if head is None:
            return None, ""
        rest = text[head.end():].lstrip()
        return _unescape(head.group(1)), _strip_wrapper(rest) if finished else rest

    def _function(self, name: str):
        return next(f for f in self.functions if f.name == name)

    @staticmethod
    def _parameters(f) -> dict:
        return f.parameters if f.parameters is not None else NO_PARAMETERS


class ToolCallStream:
    """A streamed choice's call as OpenAI streams it: `delta.tool_calls` items, the first with the
    call's id, type and name, the next ones with pieces of its arguments. A `required` call waits
    until its name is complete, and holds back a closing brace that may be its wrapper's."""

    def __init__(self, plan: ToolCallPlan):
        self.plan = plan
        self.call_id = new_call_id()
        self.name = plan.forced
        self._pending = ""  # text not yet sent
        self._started = False

    def update(self, text: str, finish_reason: str | None = None) -> list[dict]:
        """The delta's items (at most one) for the choice's new text; `finish_reason` (the engine's)
        with its last text. A `required` output cut before its name holds no call: no items."""
        self._pending += text
        if self.name is None:
            head = _REQUIRED_HEAD.match(self._pending)
            if head is None:
                return []
            self.name = _unescape(head.group(1))
            self._pending = self._pending[head.end():]
        wrapped = self.plan.forced is None
        if wrapped and not self._started:
            self._pending = self._pending.lstrip()
        if finish_reason is not None:
            out = _strip_wrapper(self._pending) if wrapped and finish_reason == "stop" else self._pending
            self._pending = ""
        elif wrapped:  # the tail may close the wrapper
            cut = _WRAPPER_TAIL.search(self._pending).start()
            out, self._pending = self._pending[:cut], self._pending[cut:]
        else:
            out, self._pending = self._pending, ""
        if not self._started:
            if not out and finish_reason is None:  # the header goes with the first piece of arguments
                return []
            self._started = True
            return [{"index": 0, "id": self.call_id, "type": "function",
                     "function": {"name": self.name, "arguments": out}}]
        return [{"index": 0, "function": {"arguments": out}}] if out else []


def finish_reason_of_call(finish_reason: str) -> str:
    """A forced call's choice ends `tool_calls` where its output ended `stop`."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _strip_wrapper(arguments_and_close: str) -> str:
    """A complete "required" call's text after `"arguments":`: the arguments without the wrapper's
    closing brace."""
    s = arguments_and_close.rstrip()
    return s[:-1].rstrip() if s.endswith("}") else s


def _unescape(json_string_body: str) -> str:
    return orjson.loads(f'"{json_string_body}"')


def tool_call_plan(req) -> ToolCallPlan | None:
    """The request's forced call, or None (no tools, or tool_choice "none"). Raises APIError(400)
    for a choice this server cannot serve or a function that is not among the tools."""
    tools, choice = req.tools, req.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    functions = tuple(t.function for t in tools)
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise bad_request("tools must have distinct function names", param="tools")
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        raise bad_request("tool_choice 'auto' (the default with tools) is not supported: the server calls a tool "
                          "when asked to. Pass tool_choice 'required' (the model picks one of the tools) or "
                          "{'type': 'function', 'function': {'name': ...}}", param="tool_choice",
                          code="unsupported_value")
    if choice == "required":
        forced, strict_of = None, functions
    else:
        forced = choice.function.name
        if forced not in names:
            raise bad_request(f"tool_choice names the function {forced!r}, which is not among the tools "
                              f"({', '.join(names)})", param="tool_choice")
        strict_of = [f for f in functions if f.name == forced]
    # strict as response_format's json_schema: closed objects unless a function says strict false
    return ToolCallPlan(functions, forced, strict=all(f.strict is not False for f in strict_of))


def history_text(content: str, tool_calls: list[Any] | None) -> str:
    """An assistant turn that called tools, as text for the chat template: its content, then each
    call as {"name", "arguments"} JSON (the shape `required` generates)."""
    parts = [content] if content else []
    for call in tool_calls or []:
        try:
            arguments: Any = orjson.loads(call.function.arguments)
        except orjson.JSONDecodeError:
            arguments = call.function.arguments
        parts.append(orjson.dumps({"name": call.function.name, "arguments": arguments}).decode())
    return "\n".join(parts)

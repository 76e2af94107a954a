"""OpenAI tool calls (`tools`, `tool_choice`) as a constraint: calls are generated under the JSON
schema of the called function's parameters, so their arguments always parse and validate.

* `tool_choice: {"type": "function", "function": {"name": f}}`: the output is f's arguments, a JSON
  object under f's `parameters`.
* `"required"`: the output is `{"name": f, "arguments": {...}}` for one of the tools (`anyOf` over
  them, the name first), split into name and arguments for the response.
* `"auto"` (OpenAI's default when tools are given): the same, or `{"content": "..."}`, the model's
  text answer; which one is the model's choice, told by the first key. With a JSON
  `response_format` the answer is `{"content": <JSON under its schema>}`, and the message's content
  is that JSON (an agent that has tools and a structured output type sends both).
* `"none"`: no call, and the tools are not shown to the model.

The envelopes are this server's own format, the same for every model: a grammar decides the output,
and a model's native call format (special tokens, tags) is nothing a JSON schema describes. One call
per choice.

The request's `stop` strings apply to what the client sees, never to an envelope: a call's arguments
text, a text answer's decoded string (under response_format: its JSON text). So the engine does not
get them (`engine_params`); the plan's message and stream cut the visible text at the first one
(finish `stop`), and `tool_stops.VisibleStops` ends a choice whose visible text reached one (its engine request
aborted). A named call has no envelope: its output, the arguments, meets the stop strings in the
engine as any output does. The model sees the tools through its chat template where the template takes them
(`tools=`), otherwise as a block appended to the system prompt, and the format in the system prompt.
"""
from __future__ import annotations

import copy
import re
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from ..engine.detokenizer import StopScan, first_stop
from ..grammar.schema_walk import children, rewrite_children
from .errors import bad_request
from .protocol import AllowedToolsChoice

# an arguments object with no parameters declared: `{}` (OpenAI: "omitting parameters defines a
# function with an empty parameter list")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# what a parameters schema may hold and still say nothing of the arguments' properties
_SAYS_NOTHING_OF_PROPERTIES = {"type", "title", "description", "$schema", "$id", "$comment", "default", "examples"}
TEXT_ANSWER = {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"],
               "additionalProperties": False}
# where an envelope's arguments start: after the call's name; where a text answer's string starts
_NAME_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')  # (a call cut after its name)
_CALL_HEAD = re.compile(_NAME_HEAD.pattern + r'\s*,\s*"arguments"\s*:\s*')
_TEXT_HEAD = re.compile(r'\s*\{\s*"content"\s*:\s*"')
_ANSWER_HEAD = re.compile(r'\s*\{\s*"content"\s*:\s*')  # an answer under response_format: any JSON
ANSWER_DEFS = "answer.format"  # the response format's $defs prefix ('.' is in no function name)
_WRAPPER_TAIL = re.compile(r"\s*\}?\s*$")  # what may be the end of an envelope
_LOCAL_DEF = re.compile(r"#/(?:\$defs|definitions)/([^/]+)")
# where a function's parameters (or the answer's schema) lie in an envelope's schema, as error paths
_ENVELOPE_PATH = re.compile(r"/anyOf/(\d+)/properties/(?:arguments|content)((?:/.*)?)$")
_DEFS_PATH = re.compile(r"/\$defs/([^/]+)((?:/.*)?)$")
_ANSWER_PARAM = "response_format.json_schema.schema"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallPlan:
    """What a request's `tools` and `tool_choice` ask for: `forced` names the one function called
    (None: the model picks, in an envelope); `allow_text` lets it answer in text instead (`auto`),
    under `answer_schema` where the request has a JSON `response_format`."""
    functions: tuple  # the request's ToolFunction models, in order
    forced: str | None
    strict: bool
    allow_text: bool = False
    answer_schema: dict | None = None
    stop: tuple = ()  # the request's stop strings, matched against the visible text (envelopes only)
    allowed: frozenset | None = None  # the names it may call (`allowed_tools`); None: every function

    def callable_functions(self) -> list:
        return [f for f in self.functions if self.allowed is None or f.name in self.allowed]

    @property
    def only_call(self) -> str | None:
        """The function every answer calls, known before the model names it: the forced one, or
        the one callable function where no text answer is allowed."""
        if self.forced is not None:
            return self.forced
        callable_ = self.callable_functions()
        return callable_[0].name if len(callable_) == 1 and not self.allow_text else None

    @property
    def schema(self) -> dict:
        if self.forced is not None:
            return self.parameters(self._function(self.forced))
        calls, defs = [], {}
        for f in self.callable_functions():
            arguments, needed = _envelope_parameters(f.name, self.parameters(f))
            defs.update(needed)
            calls.append({"type": "object", "properties": {"name": {"const": f.name}, "arguments": arguments},
                          "required": ["name", "arguments"], "additionalProperties": False})
        if self.allow_text and self.answer_schema is not None:
            answer, needed = _envelope_parameters(ANSWER_DEFS, self.answer_schema)
            defs.update(needed)
            calls.append({"type": "object", "properties": {"content": answer}, "required": ["content"],
                          "additionalProperties": False})
        elif self.allow_text:
            calls.append(TEXT_ANSWER)
        schema = {"anyOf": calls}
        return {**schema, "$defs": defs} if defs else schema

    def grammar(self):
        from ..grammar import GrammarSpec  # deferred: keeps the protocol side importable without xgrammar
        return GrammarSpec.json_schema(self.schema, strict=self.strict)

    # -- the prompt ------------------------------------------------------------------------------
    def tools_for_template(self) -> list[dict]:
        return [{"type": "function", "function": {"name": f.name, "description": f.description or "",
                                                  "parameters": self.parameters(f)}} for f in self.functions]

    def with_instructions(self, messages: list[dict], list_tools: bool = True) -> list[dict]:
        """The messages with the answer's format in the system prompt, and the tools listed there
        (`list_tools`: for a template that takes no `tools`)."""
        lines = []
        if list_tools:
            lines.append("You can call these functions:")
            lines += [orjson.dumps({"name": f.name, "description": f.description or "",
                                    "parameters": self.parameters(f)}).decode() for f in self.functions]
        if self.forced is None and self.allowed is not None:
            lines.append("The functions you may call now: " + ", ".join(f.name for f in self.callable_functions()) + ".")
        if self.forced is not None:
            lines.append(f"Call the function {self.forced}: answer with its arguments as one JSON object.")
        elif self.allow_text and self.answer_schema is not None:
            lines.append('To call a function, answer with one JSON object {"name": ..., "arguments": {...}}; '
                         'to answer instead, answer with {"content": X}, X your answer as JSON under this schema: '
                         + orjson.dumps(self.answer_schema).decode())
        elif self.allow_text:
            lines.append('To call a function, answer with one JSON object {"name": ..., "arguments": {...}}; '
                         'to answer in text instead, answer with {"content": "your answer"}.')
        else:
            lines.append('Call one of them: answer with one JSON object {"name": ..., "arguments": {...}}.')
        block = "\n".join(lines)
        if messages and messages[0]["role"] == "system":
            first = messages[0]
            return [{**first, "content": f"{first['content']}\n\n{block}" if first["content"] else block}, *messages[1:]]
        return [{"role": "system", "content": block}, *messages]

    # -- the response ----------------------------------------------------------------------------
    def message(self, text: str, finish_reason: str, complete: bool) -> tuple[dict, str]:
        """A choice's message and finish reason from its output text: a call (`tool_calls`, finish
        `tool_calls` if `complete`, the grammar's end; cut by max_tokens or a stop string, the
        arguments as far as they got), or a text answer (`auto`), or, for an envelope cut before it
        said which, nothing."""
        if self.forced is not None:
            return _call_message(self.forced, text), call_finish_reason(finish_reason, complete)
        head = _CALL_HEAD.match(text)
        if head is not None:
            rest = text[head.end():].lstrip()
            arguments, stopped = self._cut(_strip_wrapper(rest) if complete else rest)
            return (_call_message(_unescape(head.group(1)), arguments),
                    "stop" if stopped else call_finish_reason(finish_reason, complete))
        name = self.cut_call_name(text)
        if name is not None:  # cut before its arguments: the call as far as it got, as OpenAI cuts one
            return _call_message(name, ""), finish_reason
        if not self.allow_text:  # cut before its call was named: no call, and no text is ever an answer here
            return {"role": "assistant", "content": None, "refusal": None}, finish_reason
        content = None  # cut before it said whether it calls or answers: neither (as streamed: no content)
        if self.answer_schema is not None:
            head = _ANSWER_HEAD.match(text)
            if head is not None:  # the JSON as far as it got (all of it, finished)
                rest = text[head.end():].lstrip()
                content = _strip_wrapper(rest) if complete else rest
        elif _TEXT_HEAD.match(text):
            content = TextAnswer().feed(text).decoded  # the string as far as it got (all of it, finished)
        if content is None:
            return {"role": "assistant", "content": None, "refusal": None}, finish_reason
        content, stopped = self._cut(content)
        return {"role": "assistant", "content": content, "refusal": None}, "stop" if stopped else finish_reason

    def cut_call_name(self, text: str) -> str | None:
        """The function a call cut before its arguments was calling, where that is known: its name
        written whole, or the only function it could call."""
        named = _NAME_HEAD.match(text)
        return _unescape(named.group(1)) if named is not None else self.only_call

    def _cut(self, visible: str) -> tuple[str, bool]:
        """The visible text up to the request's first stop string, and whether one was there."""
        hit = first_stop(visible, self.stop) if self.stop else None
        return (visible, False) if hit is None else (visible[:hit[0]], True)

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)

    def _function(self, name: str):
        return next(f for f in self.functions if f.name == name)

    # -- errors ----------------------------------------------------------------------------------
    def locate_error(self, err: Exception) -> tuple[str, Exception]:
        """The request field and the schema path an error of the calls' grammar belongs to: a path
        into the envelope (`/anyOf/1/properties/arguments/...`, `/$defs/get_weather__Address/...`)
        is the path in the function's own parameters (or in the response format's schema), which
        the error names instead. An error with no path, or one outside them all, stays "tools"."""
        path = getattr(err, "path", None)
        if self.forced is not None and not isinstance(path, str):  # the grammar is that function's parameters
            return f"tools.{self._index(self.forced)}.function.parameters", err
        found = self._locate(path) if isinstance(path, str) else None
        if found is None:
            return "tools", err
        param, own_path = found
        from ..grammar.errors import at  # deferred: keeps the protocol side importable without xgrammar
        message = str(err).replace(f"at {path}", at(own_path)) if path else str(err)
        moved = copy.copy(err)
        moved.args, moved.path = (message,), own_path
        if hasattr(moved, "message"):
            moved.message = message
        return param, moved

    def _locate(self, path: str) -> tuple[str, str] | None:
        if self.forced is not None:
            return f"tools.{self._index(self.forced)}.function.parameters", path
        m = _ENVELOPE_PATH.match(path)
        if m is not None:
            k, rest = int(m.group(1)), m.group(2)
            callable_ = self.callable_functions()  # the envelope's branches, in order
            if k < len(callable_):
                return f"tools.{self._index(callable_[k].name)}.function.parameters", rest
            return (_ANSWER_PARAM, rest) if self.answer_schema is not None else None
        m = _DEFS_PATH.match(path)
        if m is None:
            return None
        key, rest = m.group(1), m.group(2)
        owners = [(ANSWER_DEFS, _ANSWER_PARAM, self.answer_schema)] if self.answer_schema is not None else []
        owners += [(f.name, f"tools.{i}.function.parameters", self.parameters(f)) for i, f in enumerate(self.functions)]
        for name, param, schema in sorted(owners, key=lambda o: -len(o[0])):  # a name may extend another
            if not key.startswith(name + "__"):
                continue
            own = key[len(name) + 2:]
            if own == "root" and _refers_to(schema, "#"):  # the parameters' body, moved for its refs
                return param, rest
            unescaped = own.replace("~1", "/").replace("~0", "~")  # the path's JSON-pointer spelling
            kind = "$defs" if unescaped in schema.get("$defs", {}) else "definitions"
            return param, f"/{kind}/{own}{rest}"
        return None

    def _index(self, name: str) -> int:
        return next(i for i, f in enumerate(self.functions) if f.name == name)

    def parameters(self, f) -> dict:
        """A function's parameters schema, of an object: arguments are one (clients pass them as
        keywords), and a schema that does not say so (`{}`, `properties` alone, a type list with
        "object") would let the model write a string or an array. None given, or under strict an
        object that says nothing of its properties (`{"type": "object"}`, how MCP servers describe a
        tool without inputs; OpenAI's strict mode has no open objects): no arguments."""
        p = f.parameters
        if p is None or (self.strict and not set(p) - _SAYS_NOTHING_OF_PROPERTIES):
            return NO_PARAMETERS
        return p if p.get("type") == "object" else {**p, "type": "object"}


def _call_message(name: str, arguments: str) -> dict:
    call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]}


def call_finish_reason(finish_reason: str, complete: bool) -> str:
    """A call's choice ends `tool_calls` where its grammar completed."""
    return "tool_calls" if complete else finish_reason


def grammar_complete(finish_reason: str | None, matched_stop, stop_token_ids) -> bool:
    """Whether an output that ended `stop` ended with its grammar, not at one of the request's own
    stop strings or stop token ids (which may cut a call anywhere)."""
    return (finish_reason == "stop" and not isinstance(matched_stop, str)
            and matched_stop not in (stop_token_ids or ()))


class ToolCallStream:
    """A streamed choice as OpenAI streams calls: `delta.tool_calls` items, the first with the call's
    id, type and name, the next ones with pieces of its arguments; or, for a text answer (`auto`),
    `delta.content` pieces of the decoded string. An envelope waits until its first key says which,
    and a call's holds back a closing brace that may be the envelope's."""

    def __init__(self, plan: ToolCallPlan):
        self.plan = plan
        self.call_id = new_call_id()
        self.name = plan.forced
        self.text: TextAnswer | None = None  # set once the output is a text answer
        self.answer = False  # set once the output is an answer under response_format (JSON, streamed raw)
        self._pending = ""  # text not yet sent
        self._started = False  # the envelope's inner value has begun
        self._header_sent = False  # a call's first delta (id, type, name) went out
        self._stops = StopScan(plan.stop) if plan.stop else None
        self.stopped: str | None = None  # the stop string the visible text reached (nothing is sent after it)

    def update(self, text: str, finish_reason: str | None = None, complete: bool = False) -> dict | None:
        """The delta for the choice's new output text (None: nothing to send yet); `finish_reason`
        (the engine's) and `complete` (`grammar_complete`) with its last text."""
        if self.stopped is not None:
            return None
        self._pending += text
        if self.name is None and self.text is None and not self.answer:
            head = _CALL_HEAD.match(self._pending)
            answer = self.plan.allow_text and self.plan.answer_schema is not None and _ANSWER_HEAD.match(self._pending)
            if head is not None:
                self.name = _unescape(head.group(1))
                self._pending = self._pending[head.end():]
            elif answer:
                self.answer = True
                self._pending = self._pending[answer.end():]
            elif self.plan.allow_text and self.plan.answer_schema is None and _TEXT_HEAD.match(self._pending):
                self.text = TextAnswer()
            elif finish_reason is not None and (cut := self.plan.cut_call_name(self._pending)) is not None:
                self.name, self._pending = cut, ""  # cut before its arguments
            else:
                return None
        if self.text is not None:
            pending, self._pending = self._pending, ""
            piece = self._visible(self.text.feed(pending).take(), finish_reason)
            return {"content": piece} if piece else None
        if self.answer:
            piece = self._visible(self._unwrapped(finish_reason, complete), finish_reason)
            return {"content": piece} if piece else None
        return self._call_delta(finish_reason, complete)

    def _visible(self, piece: str, finish_reason: str | None) -> str:
        """Of the visible text's next piece, what goes out now: under stop strings, up to the first
        one (then `stopped`), the end that may begin one kept for the next piece."""
        if self._stops is None:
            return piece
        piece = self._stops.feed(piece, finish_reason is not None)
        self.stopped = self._stops.matched
        return piece

    def finish_reason(self, finish_reason: str, complete: bool) -> str:
        if self.stopped is not None:
            return "stop"
        if self.text is not None or self.answer:
            return finish_reason
        return call_finish_reason(finish_reason, complete)

    def _unwrapped(self, finish_reason: str | None, complete: bool) -> str:
        """The pending text that is the envelope's inner value for sure: a tail that may close the
        envelope waits for what follows (or, at the end, is dropped if it does)."""
        wrapped = self.plan.forced is None
        if wrapped and not self._started:
            self._pending = self._pending.lstrip()
        if finish_reason is not None:
            out = _strip_wrapper(self._pending) if wrapped and complete else self._pending
            self._pending = ""
        elif wrapped:  # the tail may close the envelope
            cut = _WRAPPER_TAIL.search(self._pending).start()
            out, self._pending = self._pending[:cut], self._pending[cut:]
        else:
            out, self._pending = self._pending, ""
        if out:
            self._started = True
        return out

    def _call_delta(self, finish_reason: str | None, complete: bool) -> dict | None:
        out = self._visible(self._unwrapped(finish_reason, complete), finish_reason)
        if not self._header_sent:
            if not out and finish_reason is None and self.stopped is None:  # the header goes with the
                return None                                                 # first piece of arguments
            self._header_sent = True
            return {"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                    "function": {"name": self.name, "arguments": out}}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": out}}]} if out else None


class TextAnswer:
    """The string of a `{"content": "..."}` envelope, decoded as it arrives: the raw text is scanned
    once, escapes are decoded only when complete, and the string's closing quote ends it."""

    def __init__(self):
        self._raw = ""  # the envelope's text so far
        self._start: int | None = None  # where the string's body starts
        self._scan = 0  # next raw index to look at
        self._escape: int | None = None  # where an incomplete escape starts
        self._end: int | None = None  # the closing quote
        self.decoded = ""
        self._sent = 0

    def feed(self, text: str) -> "TextAnswer":
        self._raw += text
        if self._start is None:
            head = _TEXT_HEAD.match(self._raw)
            if head is None:
                return self
            self._start = self._scan = head.end()
        raw, i = self._raw, self._scan
        while i < len(raw) and self._end is None:
            c = raw[i]
            if self._escape is not None:
                if i - self._escape + 1 >= (6 if raw[self._escape + 1] == "u" else 2):
                    self._escape = None
            elif c == "\\":
                self._escape = i
            elif c == '"':
                self._end = i
            i += 1
        self._scan = i
        stop = self._end if self._end is not None else (self._escape if self._escape is not None else i)
        body = raw[self._start:stop]
        for candidate in (body, body[:-6]):  # the second: a high surrogate whose low half has not come yet
            try:
                self.decoded = orjson.loads(f'"{candidate}"')
                break
            except orjson.JSONDecodeError:
                continue
        return self

    def take(self) -> str:
        """What was decoded since the last take."""
        piece, self._sent = self.decoded[self._sent:], len(self.decoded)
        return piece


def _envelope_parameters(name: str, params: dict) -> tuple[dict, dict]:
    """A function's parameters placed in an envelope (`anyOf/i/properties/arguments`), and the `$defs`
    they need at the envelope's root: their own `$defs`/`definitions` move there under the function's
    name (two functions may both define `Address`), and refs to them, or to the parameters' root
    (a recursive schema), follow. Pydantic's schemas of nested models are made of such refs."""
    own = {**params.get("definitions", {}), **params.get("$defs", {})}
    root_ref = _refers_to(params, "#")
    if not own and not root_ref:
        return params, {}
    prefix = f"{name}__"

    def moved(node):
        if isinstance(node, list):
            return [moved(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = rewrite_children(node, lambda v, _below, _keyword: moved(v))  # (an enum's `$ref` is data)
        ref = node.get("$ref")
        if ref == "#":
            out["$ref"] = f"#/$defs/{prefix}root"
        elif isinstance(ref, str):
            m = _LOCAL_DEF.fullmatch(ref)
            if m is not None:
                out["$ref"] = f"#/$defs/{prefix}{m.group(1)}"
        return out

    body = moved({k: v for k, v in params.items() if k not in ("$defs", "definitions", "$schema")})
    defs = {prefix + k: moved(v) for k, v in own.items()}
    if root_ref:
        defs[prefix + "root"] = body
        return {"$ref": f"#/$defs/{prefix}root"}, defs
    return body, defs


def _refers_to(node, ref: str) -> bool:
    if isinstance(node, dict):
        return node.get("$ref") == ref or any(_refers_to(v, ref) for _, _, v in children(node))
    if isinstance(node, list):
        return any(_refers_to(v, ref) for v in node)
    return False


def _strip_wrapper(arguments_and_close: str) -> str:
    """A complete envelope's text after `"arguments":`: the arguments without the envelope's
    closing brace."""
    s = arguments_and_close.rstrip()
    return s[:-1].rstrip() if s.endswith("}") else s


def _unescape(json_string_body: str) -> str:
    return orjson.loads(f'"{json_string_body}"')


def tool_call_plan(req) -> ToolCallPlan | None:
    """The request's plan, or None (no tools, or tool_choice "none"). Raises APIError(400) for a
    function that is not among the tools, or tools whose names repeat."""
    tools, choice = req.tools, req.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    functions = tuple(t.function for t in tools)
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise bad_request("tools must have distinct function names", param="tools")
    for i, f in enumerate(functions):  # arguments are a JSON object (what clients json.loads into keywords)
        kind = f.parameters.get("type", "object") if isinstance(f.parameters, dict) else "object"
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise bad_request(f"the parameters of function {f.name!r} must be a JSON schema of an object; its type "
                              f"is {kind!r}", param=f"tools.{i}.function.parameters", code="invalid_schema")
    if choice == "none":
        return None
    forced, allow_text, allowed = None, choice is None or choice == "auto", None
    if isinstance(choice, AllowedToolsChoice):
        allowed, allow_text = frozenset(choice.names), choice.allowed_tools.mode == "auto"
        for i, name in enumerate(choice.names):
            if name not in names:
                raise bad_request(f"tool_choice.allowed_tools names the function {name!r}, which is not among the "
                                  f"tools ({', '.join(names)})", param=f"tool_choice.allowed_tools.tools.{i}")
    elif not isinstance(choice, str) and choice is not None:
        forced = choice.function.name
        if forced not in names:
            raise bad_request(f"tool_choice names the function {forced!r}, which is not among the tools "
                              f"({', '.join(names)})", param="tool_choice")
        allowed = frozenset([forced])
    strict_of = [f for f in functions if allowed is None or f.name in allowed]
    # strict as response_format's json_schema: closed objects unless a function says strict false;
    # stop strings: an envelope's visible text meets them here (a named call's output, in the engine)
    stop = tuple(s for s in req.stop_list() if s) if forced is None else ()
    return ToolCallPlan(functions, forced, strict=all(f.strict is not False for f in strict_of), allow_text=allow_text,
                        answer_schema=response_format_schema(req) if allow_text else None, stop=stop,
                        allowed=allowed)


def response_format_schema(req) -> dict | None:
    """The schema of a text answer beside tools: the request's JSON `response_format`, if any (with
    `tool_choice` "required" or a named function the answer is a call, and it does not apply)."""
    rf = getattr(req, "response_format", None)
    kind = getattr(rf, "type", None)
    if kind == "json_schema":
        schema = rf.json_schema.schema_
        return schema if schema is not None else {"type": "object"}
    if kind == "json_object":
        return rf.schema_ if rf.schema_ is not None else {"type": "object"}
    return None


def history_text(content: str, tool_calls: list[Any] | None) -> str:
    """An assistant turn that called tools, as text for the chat template: its content, then each
    call as {"name", "arguments"} JSON (the envelope the server generates)."""
    parts = [content] if content else []
    for call in tool_calls or []:
        try:
            arguments: Any = orjson.loads(call.function.arguments)
        except orjson.JSONDecodeError:
            arguments = call.function.arguments
        parts.append(orjson.dumps({"name": call.function.name, "arguments": arguments}).decode())
    return "\n".join(parts)

"""OpenAI's Responses API (`POST /v1/responses`) over the chat route: a request becomes the chat
request it means (instructions as the system turn, `input` as the turns, `text.format` as
`response_format`, function tools as chat tools), runs as one, and its answer is written back as
a Response object, or streamed as Responses events (`response.created` ... `response.completed`).

Responses are stored unless `store` is false (`response_store.py`): `previous_response_id`
continues a stored one's conversation. No built-in tools (a 400 names the field). The chat route's
extension fields (regex, ebnf, choice, grammar_backend, seed, stop, top_k and the rest) pass
through as they are.
"""
from __future__ import annotations

import re
import time
from typing import Any, Literal, Union

import orjson
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .errors import APIError, bad_request, validation_error_to_api
from .protocol import ChatCompletionRequest, _Lenient, boolean_schema, new_id

LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for the answer's logprobs
# chat request fields a Responses request may carry under the same name (our extensions, sampling)
_PASSED_THROUGH = ("model", "temperature", "top_p", "seed", "stop", "user", "frequency_penalty", "presence_penalty",
                   "logit_bias", "regex", "ebnf", "grammar", "choice", "guided_regex", "guided_grammar",
                   "guided_choice", "guided_json", "structured_outputs", "grammar_backend", "top_k", "min_p", "stop_token_ids",
                   "ignore_eos", "parallel_tool_calls")


class TextFormat(_Lenient):
    # extra keys refused: a chat-style `json_schema` wrapper pasted here was dropped, schema and all,
    # and the answer was any JSON object (QA 1130c compat H1)
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    _boolean_schema = field_validator("schema_", mode="before")(boolean_schema)

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> "TextFormat":
        if self.type == "json_schema" and self.schema_ is None:  # (OpenAI's Responses require it)
            raise PydanticCustomError("missing", "a json_schema format needs its schema (text.format.schema)")
        return self


class TextConfig(_Lenient):
    format: TextFormat | None = None


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, strict=True)
    stream: bool = Field(default=False, strict=True)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    previous_response_id: str | None = None
    store: bool = Field(default=True, strict=True)
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20, strict=True)

    @property
    def format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None


def parse(data: dict) -> ResponsesRequest:
    """The Responses request; a 400 names the field."""
    try:
        req = ResponsesRequest.model_validate(data)
    except ValidationError as e:
        raise validation_error_to_api(e.errors(include_url=False), data)
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise bad_request("reasoning options are not supported by this model", param="reasoning",
                          code="unsupported_parameter")
    # each changes what the answer is; ignored, the client would get another answer than it asked for
    if data.get("background"):
        raise bad_request("background responses are not supported: the answer comes in this request "
                          "(stream it for progress)", param="background", code="unsupported_parameter")
    if data.get("conversation") is not None:
        raise bad_request("conversations are not supported; continue a response with previous_response_id",
                          param="conversation", code="unsupported_parameter")
    return req


def chat_request(req: ResponsesRequest, data: dict, history: list[dict] = ()) -> ChatCompletionRequest:
    """The chat request a Responses request runs as: its instructions, the `history` of a previous
    response's conversation (chat messages), then its input; a 400 names the Responses field."""
    chat: dict[str, Any] = {k: data[k] for k in _PASSED_THROUGH if k in data}
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    chat["messages"] = system + list(history) + input_messages(req)
    if not chat["messages"]:
        raise bad_request("input is empty", param="input")
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if req.format is not None:
        chat["response_format"] = _response_format(req.format)
    if req.tools is not None:
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if LOGPROBS in (req.include or ()):  # (top_logprobs alone asks for none, as OpenAI's: a client's default 0)
        chat.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        raise in_responses_terms(validation_error_to_api(e.errors(include_url=False), chat))


def conversation(history: list[dict], req: ResponsesRequest, output: list[dict]) -> list[dict]:
    """The conversation a response ends, as chat messages, for a later previous_response_id: the
    history it continued, its input, its output items (as a client sending `input += output` would
    send them). Its instructions stay out: OpenAI does not carry them over."""
    return list(history) + input_messages(req) + [_message(item, "output") for item in output]


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's `input` as the Responses API lists a response's input items: each with an id
    (its own, or a new one) and a status, a message's text content as parts."""
    given = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    items = []
    for item in given:
        kind = item.get("type", "message")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(kind, "item")
        out = {**item, "type": kind, "id": item.get("id") or new_id(prefix, "_"), "status": item.get("status", "completed")}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": part, "text": item["content"]}]
        items.append(out)
    return items


def items_page(items: list[dict], after: str | None, limit: int, order: str) -> dict:
    """One page of a stored response's input items, as ``GET /v1/responses/{id}/input_items``
    answers: `order` asc (as given) or desc (newest first), from the item after `after`."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_request(f"no input item '{after}' in this response", param="after")
        start = ids.index(after) + 1
    page = ordered[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's `input` as chat messages."""
    if isinstance(req.input, str):
        if not req.input:  # as an empty prompt: nothing asked
            raise bad_request("input is empty", param="input")
        return [{"role": "user", "content": req.input}]
    return [_message(item, f"input.{i}") for i, item in enumerate(req.input)]


def _message(item: dict, param: str) -> dict:
    kind = item.get("type", "message")
    if kind == "message":
        role, content = item.get("role"), item.get("content")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad_request(f"{param}.role must be system, developer, user or assistant", param=param)
        return {"role": role, "content": content if isinstance(content, str) else _text_of(content, f"{param}.content")}
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "tool_call_id": item.get("call_id"),
                "content": output if isinstance(output, str) else _text_of(output, f"{param}.output")}
    raise bad_request(f"{param} has type '{kind}'; this server takes messages, function_call and "
                      "function_call_output items", param=param, code="unsupported_parameter")


def _text_of(parts: Any, param: str) -> str:
    """A content list's text (input_text / output_text / text parts); other parts are refused. `param`
    names the field (`input.2.content`, `input.3.output`)."""
    if not isinstance(parts, list):
        raise bad_request(f"{param} must be a string or a list of text parts", param=param)
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{param} has a '{kind}' part; this model takes text only", param=param,
                              code="unsupported_parameter")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _format_echo(fmt: TextFormat | None) -> dict:
    """The answer's `text.format` as the request gave it, with the name the server used where it
    gave none (the openai package's json_schema format requires one)."""
    if fmt is None:
        return {"type": "text"}
    echo = fmt.model_dump(by_alias=True, exclude_none=True)
    if fmt.type == "json_schema":
        echo.setdefault("name", "response")
    return echo


def _response_format(fmt: TextFormat) -> dict:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    spec = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    if fmt.description is not None:
        spec["description"] = fmt.description
    return {"type": "json_schema", "json_schema": spec}


def _chat_tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function":
        raise bad_request(f"tools.{i} has type '{tool.get('type')}'; this server runs function tools only",
                          param=f"tools.{i}", code="unsupported_parameter")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Union[str, dict]) -> Union[str, dict]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "allowed_tools" and isinstance(choice.get("tools"), list):
        tools = [{"type": t.get("type"), "function": {"name": t.get("name")}} if isinstance(t, dict) else t
                 for t in choice["tools"]]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": tools}}
    raise bad_request("tool_choice must be none, auto, required, {\"type\": \"function\", \"name\": ...} or "
                      "{\"type\": \"allowed_tools\", \"mode\": ..., \"tools\": [...]}", param="tool_choice")


# chat fields that errors name -> the Responses fields they came from
_PARAM_NAMES = (("response_format.json_schema.schema", "text.format.schema"),
                ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                ("max_completion_tokens", "max_output_tokens"), ("logprobs", "include"),
                ("tool_choice.allowed_tools", "tool_choice"))


def in_responses_terms(e: APIError) -> APIError:
    """A chat request's error as the Responses request has it: its param renamed, and in its
    message too (a tool's `'tools.0.function.parameters'` is `'tools.0.parameters'` here)."""
    old, e.param = e.param, param_name(e.param)
    if old and e.param != old:
        e.message = e.message.replace(f"'{old}'", f"'{e.param}'")
    return e


def param_name(param: str | None) -> str | None:
    """A chat request's field, as an error names it, in the Responses request's terms."""
    if param is None:
        return None
    if param.split(".")[0].split("[")[0] == "messages":  # the turns, counted with the instructions: not input's
        return "input"
    for chat, ours in _PARAM_NAMES:
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            return ours + param[len(chat):]
    return re.sub(r"^tools([.\[]\d+\]?)\.function\b", r"tools\1", param)  # a Responses tool is flat


# -- the answer ---------------------------------------------------------------------------------------

def output_items(message: dict, logprobs: list | None = None, status: str = "completed") -> list[dict]:
    """A chat message as Responses output items: its calls as function_call items, or one message
    (with its tokens' `logprobs`, chat's `logprobs.content` entries, where asked), "incomplete"
    where the response is (cut by max_output_tokens), as OpenAI marks it."""
    calls = message.get("tool_calls")
    if calls:  # a cut answer cuts its last call (the others ended where the next began)
        return [function_call_item(c["id"], c["function"]["name"], c["function"]["arguments"],
                                   status if i == len(calls) - 1 else "completed") for i, c in enumerate(calls)]
    return [message_item(new_id("msg", "_"), message.get("content") or "", status, logprobs)]


def message_item(item_id: str, text: str, status: str, logprobs: list | None = None) -> dict:
    content = [] if status == "in_progress" else [_text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _text_part(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def response_object(rid: str, created: int, model: str, req: ResponsesRequest, chat: ChatCompletionRequest,
                    status: str, output: list[dict], usage: dict | None) -> dict:
    """The Response object; `usage` is the chat usage (None while in progress)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    fmt = req.format
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "parallel_tool_calls": chat.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "temperature": chat.temperature, "top_p": chat.top_p,
        "text": {"format": _format_echo(fmt)},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [], "metadata": {}, "store": req.store, "truncation": "disabled",
        "usage": None if usage is None else responses_usage(usage),
    }


def status_of(finish_reason: str) -> str:
    """A finished answer's status: cut by max_output_tokens or the context, incomplete."""
    return "incomplete" if finish_reason == "length" else "completed"


def responses_usage(chat_usage: dict) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"],
            # (cache_write_tokens: required by the openai package's ResponseUsage; the cache writes no tokens apart)
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def now() -> int:
    return int(time.time())


def sse(event: dict) -> bytes:
    """One Responses event as OpenAI sends it: its type as the SSE event name too."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class ResponseEvents:
    """The Responses stream of one answer, from the chat stream's deltas (`delta`: `content` pieces,
    or `tool_calls` pieces whose first names the call): each call below returns the events (dicts)
    to send, numbered in order."""

    def __init__(self, shell: dict):
        self.shell = shell  # the response object in progress (output empty, usage None)
        self.seq = 0
        self.item: dict | None = None  # the output item being streamed
        self.text = ""  # its text or arguments so far
        self.logprobs: list = []  # its tokens' logprobs so far (when asked)
        self.output: list[dict] = []

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.shell),
                self._event("response.in_progress", response=self.shell)]

    def delta(self, delta: dict, logprobs: list | None = None) -> list[dict]:
        events = []
        for call in delta.get("tool_calls") or ():
            fn = call.get("function", {})
            if "id" in call:
                events += self._close_item() + self._open(function_call_item(call["id"], fn["name"], "", "in_progress"))
            piece = fn.get("arguments", "")
            if piece:
                self.text += piece
                events.append(self._event("response.function_call_arguments.delta", item_id=self.item["id"],
                                          output_index=len(self.output), delta=piece))
        piece = delta.get("content")
        if piece or (piece is not None and logprobs):  # tokens of no text yet still bring their logprobs
            if self.item is None:
                events += self._open_message()
            self.text += piece
            self.logprobs += logprobs or []
            events.append(self._event("response.output_text.delta", item_id=self.item["id"],
                                      output_index=len(self.output), content_index=0, delta=piece,
                                      logprobs=logprobs or []))
        return events

    def finish(self, response: dict) -> list[dict]:
        """The closing events; `response` is the finished Response object (its output is replaced by
        the items streamed)."""
        status = "incomplete" if response["status"] == "incomplete" else "completed"
        events = self._close_item(status)
        if not self.output:  # nothing was generated: an empty message, as the non-streamed answer has
            events += self._open_message() + self._close_item(status)
        response = {**response, "output": self.output}
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=response)]

    def failed(self, response: dict) -> list[dict]:
        """The events that end a stream whose generation failed: the item open then closed
        "incomplete" (the output keeps what was streamed), and `response.failed`."""
        events = self._close_item("incomplete")
        return events + [self._event("response.failed", response={**response, "output": self.output})]

    def _open(self, item: dict) -> list[dict]:
        self.item, self.text, self.logprobs = item, "", []
        return [self._event("response.output_item.added", output_index=len(self.output), item=item)]

    def _open_message(self) -> list[dict]:
        events = self._open(message_item(new_id("msg", "_"), "", "in_progress"))
        return events + [self._event("response.content_part.added", item_id=self.item["id"],
                                     output_index=len(self.output), content_index=0, part=_text_part(""))]

    def _close_item(self, status: str = "completed") -> list[dict]:
        """Ends the open item `status`: "completed", or at the end of a cut answer "incomplete" (a
        function call closed by the next call is complete)."""
        item = self.item
        if item is None:
            return []
        index, events = len(self.output), []
        if item["type"] == "function_call":
            done = {**item, "arguments": self.text, "status": status}
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=self.text))
        else:
            part = _text_part(self.text, self.logprobs)
            done = {**item, "status": status, "content": [part]}
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=self.text, logprobs=self.logprobs))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        self.item, self.text = None, ""
        return events

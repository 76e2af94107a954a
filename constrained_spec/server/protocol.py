"""The HTTP protocol: OpenAI-compatible request and response models (pydantic v2).

This module imports only pydantic, so the client SDK can share the response types without pulling
in torch or the engine.

Requests accept OpenAI's fields plus a few extensions (all optional, all documented in docs/api.md):

* constraints: ``regex``, ``ebnf`` (alias ``grammar``), ``choice``; vLLM's ``structured_outputs``
  and its older ``guided_regex``, ``guided_grammar``, ``guided_choice`` and ``guided_json`` are
  accepted as aliases;
* sampling: ``top_k``, ``min_p``, ``stop_token_ids``, ``ignore_eos``.

Unknown fields are ignored, as OpenAI-compatible servers usually do, so newer ``openai`` clients keep
working.
"""
from __future__ import annotations

import functools
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationInfo, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from ..sampling_params import INT64_MAX, INT64_MIN

# -- requests --------------------------------------------------------------------------------------


class _Lenient(BaseModel):
    """A request object. OpenAI's optional fields are nullable and an explicit null means the
    default (the `openai` package sends null for an argument passed as None): a null for a field
    whose default is not None is dropped before validation, so `"n": null` is n = 1 and a
    completion's `"max_tokens": null` is 16, not a 400 or a generation to the end of the context."""
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            keys = _keys_with_defaults(cls)
            data = {k: v for k, v in data.items() if v is not None or k not in keys}
        return data


@functools.cache
def _keys_with_defaults(model: type[BaseModel]) -> frozenset[str]:
    """The names and aliases of `model`'s optional fields whose default is not None."""
    keys = set()
    for name, field in model.model_fields.items():
        if not field.is_required() and field.default is not None:
            keys.update(k for k in (name, field.alias) if k)
    return frozenset(keys)


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


def _text_of(content: Union[str, list[TextPart], None]) -> str:
    """A message's (or a prediction's) content as one string: text parts joined."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


class FunctionCallIn(_Lenient):
    name: str
    arguments: str = ""


class ToolCallIn(_Lenient):
    """A call in an earlier assistant turn (the conversation sent back with the tools' results)."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's: the call it answers
    refusal: str | None = None  # an assistant turn that refused (the `openai` package's parse gives it back)

    @model_validator(mode="before")
    @classmethod
    def _function_role_is_tool(cls, v: Any) -> Any:
        # OpenAI's deprecated `function` role (a function's result, named by `name`), which older
        # agent frameworks still send: the result of a call, as a `tool` turn is
        if isinstance(v, dict) and v.get("role") == "function":
            v = {**v, "role": "tool"}
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, v: Any, info: ValidationInfo) -> Any:
        if not isinstance(v, list):
            return v
        parts = []
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "refusal" and info.data.get("role") == "assistant":  # an earlier answer's refusal, as text
                part = {"type": "text", "text": part.get("refusal")}
            elif kind != "text":
                allowed = "'text' and (in an assistant message) 'refusal'"
                raise ValueError(f"content part {i} has type {kind!r}; only {allowed} parts are supported")
            parts.append(part)
        return parts

    @model_validator(mode="after")
    def _content_unless_calls(self) -> "ChatMessage":
        if self.content is None and self.role == "assistant" and self.refusal:
            self.content = self.refusal  # the turn's words were its refusal
        if self.content is None and self.role != "assistant":  # an assistant turn may be calls alone
            raise ValueError(f"a {self.role} message needs content (a string or a list of text parts)")
        return self

    def text(self) -> str:
        return _text_of(self.content)


UNSUPPORTED = "unsupported_parameter"  # the error code (and pydantic error type) of a part of OpenAI's API not run
INVALID_SCHEMA = "invalid_schema"  # the error code (and pydantic error type) of a schema refused


def boolean_schema(schema: Any) -> Any:
    """JSON Schema's boolean schemas: `true` accepts any JSON value, as `{}` does (and is served as
    `{}`: one grammar, one cache entry); `false` accepts none, refused here with its reason, before
    the tool envelopes read the schema as an object: a 400 with code `invalid_schema` wherever the
    schema came (response_format, guided_json as JSON or as text, a tool's parameters), as the
    grammar's own refusals of a schema have."""
    if schema is True:
        return {}
    if schema is False:  # a ValueError whose pydantic error type says what the 400's code says
        raise PydanticCustomError(INVALID_SCHEMA, "the schema false accepts no JSON value")
    return schema


# The format objects refuse keys they do not know: a misspelled or misplaced schema (`"Schema"`, a
# llama.cpp or TGI spelling) was dropped, and the answer had only to be some JSON object (QA 1130c).
_FORMAT = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaSpec(_Lenient):
    model_config = _FORMAT
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    _boolean_schema = field_validator("schema_", mode="before")(boolean_schema)


class ResponseFormatText(_Lenient):
    model_config = _FORMAT
    type: Literal["text"]


class ResponseFormatJsonObject(_Lenient):
    """Any JSON object; with a `schema` (llama.cpp's spelling), an object of that schema."""
    model_config = _FORMAT
    type: Literal["json_object"]
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    _boolean_schema = field_validator("schema_", mode="before")(boolean_schema)


class ResponseFormatJsonSchema(_Lenient):
    model_config = _FORMAT
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Union[ResponseFormatText, ResponseFormatJsonObject, ResponseFormatJsonSchema]


class Prediction(_Lenient):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat."""
    type: Literal["content"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        return _text_of(self.content)


class ToolFunction(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def _boolean_parameters(cls, value: Any) -> Any:
        # `true`: any arguments, an object as every call's arguments are (clients pass them as keywords)
        return {"type": "object"} if value is True else boolean_schema(value)


class Tool(_Lenient):
    type: Literal["function"]
    function: ToolFunction


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(_Lenient):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)  # (each entry has a named choice's shape)


class AllowedToolsChoice(_Lenient):
    """OpenAI's `allowed_tools`: every tool stays in the prompt, the answer may call only these
    (`required`), or these or none (`auto`)."""
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools

    @property
    def names(self) -> list[str]:
        return [t.function.name for t in self.allowed_tools.tools]


ToolChoiceObject = Annotated[Union[NamedToolChoice, AllowedToolsChoice], Field(discriminator="type")]


class StructuredOutputs(_Lenient):
    """vLLM's `structured_outputs` (its guided_* fields' successor): one constraint. Ignored, as an
    unknown field, it would have let the answer go unconstrained with no word said; so would a key
    it does not know (a typo), refused for that."""
    model_config = _FORMAT
    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    whitespace_pattern: Any = None
    # how vLLM compiles, not what is valid: taken and left alone
    disable_fallback: Any = None
    disable_any_whitespace: Any = None
    disable_additional_properties: Any = None

    _boolean_schema = field_validator("json_", mode="before")(boolean_schema)

    @model_validator(mode="after")
    def _one_constraint_at_least(self) -> "StructuredOutputs":
        if not self.constraints():
            raise PydanticCustomError("missing", "structured_outputs sets no constraint (json, regex, choice, "
                                                 "grammar or json_object)")
        return self

    @field_validator("structural_tag", "whitespace_pattern")
    @classmethod
    def _not_run(cls, v: Any, info) -> Any:
        if v is not None:
            raise PydanticCustomError(UNSUPPORTED, f"structured_outputs.{info.field_name} is not supported")
        return v

    def constraints(self) -> list[tuple[str, Any]]:
        """(field, value) of each constraint set (`json_object: false` sets none)."""
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": self.json_object or None}
        return [(k, v) for k, v in values.items() if v is not None]


class StreamOptions(_Lenient):
    include_usage: bool = False


# field -> the values that ask for nothing (JSON's, so `1` and `1.0` are alike)
_NOT_RUN = {"bad_words": ([], None), "allowed_token_ids": (None,), "min_tokens": (0, None),
            "include_stop_str_in_output": (False, None), "no_stop_trim": (False, None), "stop_regex": ([], None),
            "repetition_penalty": (1, None), "continue_final_message": (False, None),
            "add_generation_prompt": (True, None), "guided_whitespace_pattern": (None,),
            "use_beam_search": (False, None), "prompt_logprobs": (None, 0)}
_NOT_RUN_HINTS = {"repetition_penalty": " (frequency_penalty and presence_penalty are)",
                  "allowed_token_ids": " (logit_bias is)", "bad_words": " (logit_bias is)"}


class _GenerationRequest(_Lenient):
    """Fields /v1/chat/completions and /v1/completions share."""
    model: str | None = None
    # numbers strict too: an integer or a decimal, not true or "0.5" (OpenAI's 400 for a string)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, strict=True)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0, strict=True)
    # integers and booleans strict, as OpenAI's are: "5", 5.0 or true for max_tokens is a 400, not 5 or 1
    n: int = Field(default=1, ge=1, le=16, strict=True)
    seed: int | None = Field(default=None, strict=True, ge=INT64_MIN, le=INT64_MAX)  # the sampler's int64
    stop: Union[str, list[str], None] = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, strict=True)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, strict=True)
    logit_bias: dict[str, StrictFloat] | None = None  # (strict: an integer or a decimal, not true)  # token id (as a string) -> bias in [-100, 100]
    prediction: Prediction | None = None
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = Field(default=None, discriminator="type")
    user: str | None = None
    # extensions: constraints
    regex: str | None = None
    ebnf: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    structured_outputs: StructuredOutputs | None = None
    json_schema: Union[dict[str, Any], str, None] = None  # SGLang's, beside its regex and ebnf
    grammar_backend: str | None = None  # xgrammar | llguidance | auto; None: the server's --grammar-backend
    # extensions: sampling
    top_k: int | None = Field(default=None, strict=True)
    min_p: float | None = Field(default=None, strict=True)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = Field(default=False, strict=True)

    # fields of vLLM's, SGLang's or TGI's APIs this server does not run, with the value that asks for
    # nothing: any other is a 400, for ignored they changed what the answer had to be without a word
    bad_words: Any = None
    allowed_token_ids: Any = None
    min_tokens: Any = None
    include_stop_str_in_output: Any = None
    no_stop_trim: Any = None
    stop_regex: Any = None
    repetition_penalty: Any = None
    continue_final_message: Any = None
    add_generation_prompt: Any = None
    guided_whitespace_pattern: Any = None
    use_beam_search: Any = None
    prompt_logprobs: Any = None

    _boolean_schema = field_validator("guided_json", "json_schema", mode="before")(boolean_schema)

    @field_validator(*_NOT_RUN, mode="before")
    @classmethod
    def _not_run(cls, v: Any, info: ValidationInfo) -> Any:
        if v not in _NOT_RUN[info.field_name]:
            raise PydanticCustomError(UNSUPPORTED, f"{info.field_name} is not supported by this server"
                                                   f"{_NOT_RUN_HINTS.get(info.field_name, '')}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        if v == "" or (isinstance(v, list) and "" in v):  # (it would match nothing, silently)
            raise ValueError("a stop string must not be empty")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: Any, info) -> Any:
        if v is not None and not info.data.get("stream"):  # (`stream` is declared before it)
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    logprobs: bool = Field(default=False, strict=True)
    top_logprobs: int | None = Field(default=None, ge=0, le=20, strict=True)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Union[Literal["none", "auto", "required"], ToolChoiceObject, None] = None
    parallel_tool_calls: bool | None = None  # one call per choice either way
    functions: list[Any] | None = None  # the deprecated form of tools
    function_call: Any = None  # the deprecated form of tool_choice
    modalities: list[str] | None = None  # text only
    audio: dict[str, Any] | None = None  # (audio output)

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, v: Any, info: ValidationInfo) -> Any:
        # (a field validator, so that the 400 names the field; a function_call naming a function,
        # ignored beside tools, let the model call another; its "none" and "auto" ask for nothing)
        if v and v not in ("none", "auto"):
            raise PydanticCustomError(UNSUPPORTED, f"{info.field_name} (deprecated by OpenAI) is not supported; "
                                                   "use tools and tool_choice")
        return v

    @field_validator("modalities", "audio")
    @classmethod
    def _text_only(cls, v: Any, info) -> Any:
        # answered in text alone, a request for audio would get no error and no audio
        if (info.field_name == "audio" and v is not None) or (v and any(m != "text" for m in v)):
            raise PydanticCustomError(UNSUPPORTED, "this model answers in text only")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: Any, info) -> Any:
        if v and not info.data.get("logprobs"):  # (a field validator, so that the 400 names the field)
            raise ValueError("top_logprobs needs logprobs=true")
        return v

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


PromptInput = Union[str, list[str], list[StrictInt], list[list[StrictInt]]]  # ids: not true, not 1.0


class CompletionRequest(_GenerationRequest):
    prompt: PromptInput
    max_tokens: int | None = Field(default=16, ge=1, strict=True)
    logprobs: int | None = Field(default=None, ge=0, le=20, strict=True)
    echo: bool = Field(default=False, strict=True)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, strict=True)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, v: Any, info) -> Any:
        if v:  # (field validators, so that the 400 names the field)
            raise PydanticCustomError(UNSUPPORTED, "{field} is not supported", {"field": info.field_name})
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: Any, info) -> Any:
        if v is not None and v > info.data.get("n", 1):  # (`n` is declared before it, in the base class)
            raise PydanticCustomError(UNSUPPORTED, "best_of is not supported (n completions are sampled and all "
                                                   "returned)")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # one prompt given as token ids
        return list(p)

    def token_limit(self) -> int | None:
        return self.max_tokens


# -- responses -------------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


def new_id(prefix: str, sep: str = "-") -> str:
    """An object id as OpenAI spells it: "chatcmpl-...", "cmpl-..."; the Responses API's with "_"
    ("resp_...", "msg_...")."""
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str = ""


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] | None = "function"
    function: FunctionCall
    index: int | None = None  # in a stream's deltas


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


FinishReasonStr = Literal["stop", "length", "tool_calls", "abort", "error"]


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: FinishReasonStr | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: FinishReasonStr | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReasonStr | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "constrained-spec"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

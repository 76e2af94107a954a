"""Unit tests of the protocol layer (no model): request validation, constraint selection, error shapes,
token bytes."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from constrained_spec.server.constraints import grammar_spec_for
from constrained_spec.server.errors import APIError, validation_error_to_api
from constrained_spec.server.protocol import ChatCompletionRequest, CompletionRequest
from constrained_spec.server.tokens import TokenTexts, _BYTE_DECODER


def chat(**kw):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


def test_chat_request_fields():
    r = chat(max_completion_tokens=5, max_tokens=9, stop="x", stream=True, stream_options={"include_usage": True},
             unknown_field=1)
    assert r.token_limit() == 5 and r.stop_list() == ["x"] and r.include_usage_in_stream
    parts = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert parts.messages[0].text() == "ab"


@pytest.mark.parametrize("bad, param", [({"temperature": 3}, "temperature"), ({"n": 0}, "n"),
                                        ({"top_logprobs": 2}, "top_logprobs"), ({"tools": [{"type": "function"}]}, None),
                                        ({"stream_options": {"include_usage": True}}, "stream_options"),
                                        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
                                         "tools.0.function.name"), ({"tool_choice": "sometimes"}, None)])
def test_chat_request_errors(bad, param):
    with pytest.raises(ValidationError) as e:
        chat(**bad)
    err = validation_error_to_api(e.value.errors(include_url=False))
    assert err.status == 400 and set(err.body()["error"]) == {"message", "type", "param", "code"}
    if param:
        assert err.param == param


@pytest.mark.parametrize("tool_choice, param, says", [
    ({"type": "function"}, "tool_choice.function", "missing required field 'tool_choice.function'"),
    ({"function": {"name": "f"}}, "tool_choice.type", "missing required field 'tool_choice.type'"),
    ({"type": "allowed_tools"}, "tool_choice.allowed_tools", "missing required field 'tool_choice.allowed_tools'"),
    ({"type": "auto"}, "tool_choice.type", "'function', 'allowed_tools'"),
    ("sometimes", "tool_choice", "'none', 'auto' or 'required'")])
def test_a_union_field_names_the_member_the_body_meant(tool_choice, param, says):
    """A union's error is one per member: the first, tool_choice's "none"/"auto"/"required", was
    answered for an object, with pydantic's tag `literal['none','auto','required']` as its param."""
    body = {"messages": [{"role": "user", "content": "hi"}], "tool_choice": tool_choice}
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    err = validation_error_to_api(e.value.errors(include_url=False), body)
    assert err.param == param and says in err.body()["error"]["message"], err.body()


@pytest.mark.parametrize("extra,param,says", [
    ({"response_format": {}}, "response_format.type", "missing required field 'response_format.type'"),
    ({"response_format": {"type": "yaml"}}, "response_format.type",
     "'yaml' is not one of 'text', 'json_object', 'json_schema'"),
    ({"messages": ["hi"]}, "messages.0", "Input should be a JSON object"),
    ({"stream_options": "yes"}, "stream_options", "Input should be a JSON object")])
def test_errors_speak_of_the_json_sent_not_of_the_server_s_classes(extra, param, says):
    """pydantic's own wording named its internals: "Unable to extract tag using discriminator
    'type'", "a valid dictionary or instance of ChatMessage"."""
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    err = validation_error_to_api(e.value.errors(include_url=False), body).body()["error"]
    assert err["param"] == param and says in err["message"], err
    assert "discriminator" not in err["message"] and "instance of" not in err["message"], err


@pytest.mark.parametrize("bad", [{"echo": True}, {"suffix": "x"}])
def test_unsupported_completion_fields_are_named(bad):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "x", **bad})
    assert validation_error_to_api(e.value.errors(include_url=False)).param == next(iter(bad))


def test_completion_prompts():
    assert CompletionRequest.model_validate({"prompt": [1, 2, 3]}).prompts() == [[1, 2, 3]]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": []})


def test_constraint_selection():
    from constrained_spec.grammar import GrammarSpec
    assert grammar_spec_for(chat()) is None
    assert grammar_spec_for(chat(response_format={"type": "text"})) is None
    assert grammar_spec_for(chat(response_format={"type": "json_object"})) == GrammarSpec.json_object()
    spec = grammar_spec_for(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer"}, "strict": False}}))
    assert spec.kind == "json_schema" and spec.strict is False
    assert grammar_spec_for(chat(regex="a+")).kind == "regex"
    assert grammar_spec_for(chat(guided_choice=["a", "b"])).kind == "choice"
    assert grammar_spec_for(chat(grammar='root ::= "a"')).kind == "ebnf"
    # vLLM's structured_outputs: each of its constraints, conflicts and what is not run
    so = {"json": {"type": "integer"}, "regex": "a+", "choice": ["a"], "grammar": 'root ::= "a"', "json_object": True}
    kinds = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf", "json_object": "json_object"}
    for field, value in so.items():
        assert grammar_spec_for(chat(structured_outputs={field: value})).kind == kinds[field]
    assert grammar_spec_for(chat(structured_outputs={"json": '{"type": "string"}'})) == GrammarSpec.json_schema(
        {"type": "string"})
    assert grammar_spec_for(chat(structured_outputs={"json": True})) == GrammarSpec.json_schema({})
    for not_a_schema in (1, 0.0):  # (pydantic read numbers as booleans: 1 was "any value")
        with pytest.raises(ValidationError):
            chat(structured_outputs={"json": not_a_schema})
    from constrained_spec.server import responses
    data = {"input": "hi", "structured_outputs": {"regex": "a+"}}
    assert grammar_spec_for(responses.chat_request(responses.parse(data), data)) == GrammarSpec.regex("a+")
    with pytest.raises(APIError) as e:
        grammar_spec_for(chat(structured_outputs={"regex": "a", "choice": ["a"]}))
    assert e.value.code == "conflicting_constraints" and e.value.param == "structured_outputs.choice"
    with pytest.raises(APIError) as e:
        grammar_spec_for(chat(regex="a", structured_outputs={"regex": "a"}))
    assert e.value.code == "conflicting_constraints"
    with pytest.raises(APIError) as e:
        grammar_spec_for(chat(structured_outputs={"json": "{not json"}))
    assert e.value.param == "structured_outputs.json" and e.value.code == "invalid_schema"
    body = {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"structural_tag": "{}"}}
    with pytest.raises(ValidationError) as v:
        ChatCompletionRequest.model_validate(body)
    err = validation_error_to_api(v.value.errors(include_url=False), body)
    assert err.param == "structured_outputs.structural_tag" and "not supported" in err.message, err.message
    with pytest.raises(APIError) as e:
        grammar_spec_for(chat(regex="a", choice=["a"]))
    assert e.value.code == "conflicting_constraints"


def test_token_bytes_byte_level():
    class Tok:  # a byte-level BPE vocabulary entry for "Ġcaf" + "Ã©" ("é" split in bytes)
        def convert_ids_to_tokens(self, i):
            return {1: "Ġcaf", 2: "Ã"}[i]

        def decode(self, ids, **kw):
            raise AssertionError("not needed for byte-level tokens")
    t = TokenTexts(Tok())
    assert t.lookup(1) == (" caf", list(b" caf"))
    assert t.lookup(2)[1] == [_BYTE_DECODER["Ã"]]


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "foo"}}},
     "response_format.json_schema.schema"),
    ({"stop": 5}, "stop"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"n": "many"}, "n"),
])
def test_error_param_is_the_field_path_without_union_tags(extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    err = validation_error_to_api(e.value.errors(include_url=False), body)
    assert err.param == param, err.body()
    assert param in err.body()["error"]["message"]


@pytest.mark.parametrize("bad", [{"max_tokens": "5"}, {"max_tokens": True}, {"max_tokens": 5.0}, {"stream": "yes"},
                                 {"n": "2"}, {"logprobs": 1}, {"seed": 1.5}])
def test_integers_and_booleans_are_strict(bad):
    """As OpenAI's: a string, float or boolean where an integer goes (or the other way) is a 400 naming
    the field, not a value pydantic made up (`max_tokens: true` ran as 1)."""
    with pytest.raises(ValidationError) as e:
        chat(**bad)
    body = {"messages": [{"role": "user", "content": "hi"}], **bad}
    assert validation_error_to_api(e.value.errors(include_url=False), body).param == next(iter(bad))
    assert chat(max_tokens=5, stream=True, n=2, logprobs=True, seed=3).max_tokens == 5



def test_an_explicit_null_is_the_default():
    """OpenAI's optional fields are nullable, and the `openai` package sends null for an argument
    passed as None: `n`, `stream`, `logprobs`, `echo`, `store` null were a 400, and a completion's
    `max_tokens` null generated to the end of the context instead of OpenAI's 16."""
    from constrained_spec.server.responses import ResponsesRequest
    r = chat(n=None, stream=None, logprobs=None, ignore_eos=None, max_tokens=None, stream_options=None)
    assert (r.n, r.stream, r.logprobs, r.ignore_eos, r.token_limit()) == (1, False, False, False, None)
    c = CompletionRequest.model_validate({"prompt": "x", "max_tokens": None, "echo": None, "n": None, "stream": None})
    assert (c.token_limit(), c.echo, c.n, c.stream) == (16, False, 1, False)
    q = ResponsesRequest.model_validate({"input": "x", "store": None, "stream": None})
    assert (q.store, q.stream) == (True, False)
    assert chat(stream=True, stream_options={"include_usage": None}).include_usage_in_stream is False
    with pytest.raises(ValidationError):  # a required field stays required
        ChatCompletionRequest.model_validate({"messages": None})

def test_only_an_assistant_turn_may_lack_content():
    with pytest.raises(ValidationError, match="a user message needs content"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": None}]})
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": None, "tool_calls": calls}]})


def test_openai_s_older_and_refusal_shapes_are_read():
    """An assistant turn that refused (the `openai` package's parse hands back `refusal`, or a
    content part of type refusal) is its text; the deprecated `function` role is a tool's result."""
    turns = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
             {"role": "assistant", "content": None, "refusal": "No."},
             {"role": "function", "name": "get_time", "content": "12:00"}]
    messages = ChatCompletionRequest.model_validate({"messages": turns}).messages
    assert [m.text() for m in messages[1:]] == ["I can't.", "No.", "12:00"]
    assert messages[3].role == "tool" and messages[3].name == "get_time"
    for part in ({"type": "refusal", "refusal": "x"}, {"type": "image_url", "image_url": {"url": "x"}}):
        with pytest.raises(ValidationError, match="only 'text' and"):  # a refusal is an assistant's alone
            ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [part]}]})


def test_masked_tokens_get_a_finite_logprob():
    """A grammar leaving fewer tokens than top_logprobs asks for: the rest have probability 0. Their
    logprob is OpenAI's -9999.0, not -inf, which JSON writes as null (its schema wants a number)."""
    import orjson

    class Tok:
        def convert_ids_to_tokens(self, i):
            return {1: "yes", 2: "no", 3: "x"}[i]
    t = TokenTexts(Tok())
    entry = {"logprob": 0.0, "top": [(1, 0.0), (2, float("-inf")), (3, float("nan"))]}
    chat_lps = t.chat_logprobs([([1], [entry])], top_n=3)
    assert [e["logprob"] for e in chat_lps["content"][0]["top_logprobs"]] == [0.0, -9999.0, -9999.0]
    legacy = t.completion_logprobs([([1], [entry])], top_n=3)
    assert legacy["top_logprobs"][0] == {"yes": 0.0, "no": -9999.0, "x": -9999.0}
    assert b"null" not in orjson.dumps(chat_lps["content"]) + orjson.dumps(legacy)


def test_request_params():
    """A request's choices get seed, seed + 1, ...; the token budget is clamped to the context left;
    logit_bias keys become token ids; what the engine would refuse is a 400 naming the field."""
    from constrained_spec.server.request_params import RequestParams
    params = RequestParams(vocab=100, max_context=64, default_max_tokens=None)
    sp = params.sampling(chat(n=3, seed=5, temperature=0.5, top_p=0.0, logit_bias={"7": -100, "8": 2.5}), 10, None)
    assert [p.seed for p in sp] == [5, 6, 7] and {p.max_tokens for p in sp} == {10}
    assert sp[0].temperature == 0.5 and sp[0].top_p == 0.0 and sp[0].logit_bias == {7: -100, 8: 2.5}
    assert [p.seed for p in params.sampling(chat(n=2), 4, None)] == [None, None]
    assert params.token_budget(60, None, "messages") == 4 and params.token_budget(10, 20, "messages") == 20
    assert params.token_budget(10, 500, "messages") == 54
    for body, param in (({"logit_bias": {"100": 1}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                        ({"logit_bias": {"3": 101}}, "logit_bias"), ({"stop_token_ids": [3, 100]}, "stop_token_ids"),
                        ({"stop_token_ids": [-1]}, "stop_token_ids")):
        with pytest.raises(APIError) as e:
            params.sampling(chat(**body), 4, None)
        assert e.value.status == 400 and e.value.param == param
    with pytest.raises(APIError) as e:
        params.token_budget(64, None, "prompt")
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    with pytest.raises(APIError):
        params.check_token_ids([1, 100], "prompt")


def test_boolean_schemas():
    """JSON Schema's `true` accepts any JSON value: served as `{}` (it was a 400, the request model
    wanting an object); `false` accepts none: a 400 that says so, in every place a schema goes."""
    from constrained_spec.grammar import GrammarSpec
    from constrained_spec.server import responses
    from constrained_spec.server.tools import tool_call_plan
    any_value = GrammarSpec.json_schema({})
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}
    assert grammar_spec_for(chat(response_format=fmt)) == any_value
    assert grammar_spec_for(chat(guided_json=True)) == any_value
    assert grammar_spec_for(chat(guided_json="true")) == any_value
    data = {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": True}}}
    assert grammar_spec_for(responses.chat_request(responses.parse(data), data)) == any_value
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert tool_call_plan(chat(response_format=fmt, tools=tools)).answer_schema == {}

    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}}
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    err = validation_error_to_api(e.value.errors(include_url=False), body)
    assert err.param == "response_format.json_schema.schema" and "false accepts no JSON value" in err.message
    with pytest.raises(APIError) as api:
        grammar_spec_for(chat(guided_json="false"))
    assert api.value.param == "guided_json" and "false accepts no JSON value" in api.value.message
    with pytest.raises(ValidationError) as e:
        chat(guided_json=False)
    assert "false accepts no JSON value" in str(e.value)
    data["text"]["format"]["schema"] = False
    with pytest.raises(APIError) as api:
        responses.parse(data)
    assert api.value.param == "text.format.schema" and "false accepts no JSON value" in api.value.message

    # a tool's parameters: `true` takes any arguments object, `false` is the same 400 naming the field
    anything = [{"type": "function", "function": {"name": "f", "parameters": True}}]
    assert tool_call_plan(chat(tools=anything, tool_choice="required")).functions[0].parameters == {"type": "object"}
    body = {"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": False}}]}
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    err = validation_error_to_api(e.value.errors(include_url=False), body)
    assert err.param == "tools.0.function.parameters" and "false accepts no JSON value" in err.message


def test_the_schema_false_is_one_400_wherever_it_comes():
    """`false` as a schema is refused with code `invalid_schema` and the field in `param`, the same
    whether it comes as response_format's schema, as vLLM's guided_json (the boolean, or its JSON
    text), in a Responses text.format or as a tool's parameters (guided_json's text said
    `invalid_schema` and the others `invalid_value`)."""
    from constrained_spec.server import responses
    from constrained_spec.server.json_io import parse

    def refusal(**kw) -> APIError:
        with pytest.raises(APIError) as e:
            grammar_spec_for(parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **kw}))
        return e.value

    tool = {"type": "function", "function": {"name": "f", "parameters": False}}
    for kw, param in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
                       "response_format.json_schema.schema"),
                      ({"guided_json": False}, "guided_json"), ({"guided_json": "false"}, "guided_json"),
                      ({"guided_json": " false "}, "guided_json"), ({"tools": [tool]}, "tools.0.function.parameters")):
        err = refusal(**kw)
        assert (err.status, err.code, err.param) == (400, "invalid_schema", param), (kw, err.body())
        assert "the schema false accepts no JSON value" in err.message
    data = {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": False}}}
    with pytest.raises(APIError) as e:
        responses.parse(data)
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_schema", "text.format.schema")


def _refusal(body: dict, model=ChatCompletionRequest):
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return validation_error_to_api(e.value.errors(include_url=False), body)


def test_what_would_be_ignored_is_read_or_refused():
    """Fields and keys other servers' clients send that this one ignored, so the answer need not be
    what they asked for (QA 1130c compat): a schema under another spelling is read; a key a format
    does not know, a structured_outputs without a constraint and a vLLM/SGLang option not run are a
    400 naming it."""
    from constrained_spec.grammar import GrammarSpec
    from constrained_spec.server import responses
    schema = {"type": "object", "properties": {"zip": {"type": "string"}}, "required": ["zip"]}
    msgs = [{"role": "user", "content": "hi"}]
    assert grammar_spec_for(chat(json_schema=schema)) == GrammarSpec.json_schema(schema)  # SGLang's
    assert grammar_spec_for(chat(json_schema=json.dumps(schema))) == GrammarSpec.json_schema(schema)
    llama_cpp = {"type": "json_object", "schema": schema}
    assert grammar_spec_for(chat(response_format=llama_cpp)) == GrammarSpec.json_schema(schema)
    for body, param in (
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "z", "Schema": schema}}},
             "response_format.json_schema.Schema"),
            ({"response_format": {"type": "json_object", "value": schema}}, "response_format.value"),
            ({"structured_outputs": {"jsn": schema}}, "structured_outputs.jsn"),
            ({"structured_outputs": {}}, "structured_outputs"),
            ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
            ({"min_tokens": 30}, "min_tokens"), ({"repetition_penalty": 1.3}, "repetition_penalty"),
            ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
            ({"continue_final_message": True}, "continue_final_message"), ({"bad_words": ["x"]}, "bad_words"),
            ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern")):
        err = _refusal({"messages": msgs, **body})
        assert err.status == 400 and err.param == param, (body, err.param, err.message)
    for asks_nothing in ({"min_tokens": 0}, {"repetition_penalty": 1.0}, {"add_generation_prompt": True},
                         {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}):
        ChatCompletionRequest.model_validate({"messages": msgs, **asks_nothing})
    # Responses: a chat-style wrapper in text.format dropped the schema (any JSON object answered)
    for fmt in ({"type": "json_schema", "json_schema": {"name": "z", "schema": schema}},
                {"type": "json_schema", "name": "z"}):
        with pytest.raises(APIError) as e:
            responses.parse({"input": "hi", "text": {"format": fmt}})
        assert e.value.status == 400 and e.value.param.startswith("text.format"), e.value.message

"""OpenAI tool calls: calls are generated under the called function's parameter schema. The plan and
its stream on their own (every way of cutting an output into streamed pieces gives the same call or
text), then the real SmolLM2 through the `openai` package: a named call's arguments validate,
`required` picks one of the tools, `auto` calls or answers in text, streamed equals non-streamed,
`chat.completions.parse` with `pydantic_function_tool`, a conversation carrying a tool's result,
and the 400s."""
from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, ValidationError

from constrained_spec.server.errors import APIError
from constrained_spec.server.protocol import ChatCompletionRequest
from constrained_spec.server.tools import grammar_complete, tool_call_plan
from server_fixtures import *  # noqa: F401,F403
from server_fixtures import MODEL_ID, chat_body

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                           "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
                                                          "required": ["timezone"]}}}]


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_plan_of_a_request():
    assert tool_call_plan(_request()) is None
    assert tool_call_plan(_request(tools=TOOLS, tool_choice="none")) is None
    named = tool_call_plan(_request(tools=TOOLS, tool_choice=_named("get_weather")))
    assert named.forced == "get_weather" and named.schema == WEATHER and named.strict
    required = tool_call_plan(_request(tools=TOOLS, tool_choice="required"))
    names = [alt["properties"]["name"]["const"] for alt in required.schema["anyOf"]]
    assert names == ["get_weather", "get_time"] and required.forced is None
    bare = tool_call_plan(_request(tools=[{"type": "function", "function": {"name": "ping", "strict": False}}],
                                   tool_choice="required"))
    assert bare.schema["anyOf"][0]["properties"]["arguments"] == {"type": "object", "properties": {},
                                                                  "additionalProperties": False}
    assert not bare.strict
    open_object = tool_call_plan(_request(tools=[{"type": "function", "function": {
        "name": "ping", "strict": False, "parameters": {"type": "object"}}}], tool_choice="required"))
    assert open_object.schema["anyOf"][0]["properties"]["arguments"] == {"type": "object"}  # not strict: any object
    for choice in (None, "auto"):  # OpenAI's default with tools: a call or {"content": text}
        auto = tool_call_plan(_request(tools=TOOLS, tool_choice=choice))
        assert auto.allow_text and auto.forced is None and len(auto.schema["anyOf"]) == 3
        assert auto.schema["anyOf"][-1]["properties"] == {"content": {"type": "string"}}
    for kw, param in (({"tools": TOOLS, "tool_choice": _named("nope")}, "tool_choice"),
                      ({"tool_choice": "required"}, "tool_choice"), ({"tools": TOOLS + TOOLS[:1],
                                                                     "tool_choice": "required"}, "tools"),
                      ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
                       "tools.0.function.parameters")):
        with pytest.raises(APIError) as e:
            tool_call_plan(_request(**kw))
        assert e.value.status == 400 and e.value.param == param, kw


def test_message_and_stream_agree_however_the_output_is_cut():
    cases = [("required", '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}',
              "get_weather", '{"city": "Oslo", "unit": "celsius"}'),
             ("required", '{ "name" : "get_time" ,\n "arguments" : {"timezone": "UTC"} }', "get_time",
              '{"timezone": "UTC"}'),
             (_named("get_weather"), '{"city": "Rome", "unit": "fahrenheit"}', "get_weather",
              '{"city": "Rome", "unit": "fahrenheit"}')]
    for choice, text, name, arguments in cases:
        plan = tool_call_plan(_request(tools=TOOLS, tool_choice=choice))
        message, reason = plan.message(text, "stop", True)
        assert reason == "tool_calls" and message["content"] is None
        (call,) = message["tool_calls"]
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"] == {"name": name, "arguments": arguments}
        for size in range(1, 9):  # every piece size: the stream's deltas add up to the same call
            stream = plan.stream()
            deltas = [stream.update(text[i:i + size]) for i in range(0, len(text), size)] + [stream.update("", "stop", True)]
            items = [it for d in deltas if d for it in d["tool_calls"]]
            assert stream.finish_reason("stop", True) == "tool_calls"
            assert items[0]["id"] == stream.call_id and items[0]["function"]["name"] == name
            assert all("id" not in it and "name" not in it["function"] for it in items[1:])
            assert "".join(it["function"]["arguments"] for it in items) == arguments, (text, size)


def test_a_call_cut_short():
    plan = tool_call_plan(_request(tools=TOOLS, tool_choice="required"))
    message, reason = plan.message('{"name": "get_weather", "arguments": {"city": "Os', "length", False)
    assert reason == "length" and message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                         "arguments": '{"city": "Os'}
    message, reason = plan.message('{"name": "get_wea', "length", False)  # no name yet: no call, no text
    assert reason == "length" and message["content"] is None and "tool_calls" not in message
    stream = plan.stream()
    assert stream.update('{"name": "get_wea') is None and stream.update("", "length") is None
    # cut after its name or where only one function can be called: that call, its arguments empty
    # (QA 1130 wire D11: a message with neither content nor tool_calls did not say what it was doing)
    one = tool_call_plan(_request(tools=TOOLS[:1], tool_choice="required"))
    for p, text in ((plan, '{"name": "get_time", "argu'), (one, '{"na'), (one, "")):
        name = "get_time" if p is plan else "get_weather"
        message, reason = p.message(text, "length", False)
        assert reason == "length" and message["tool_calls"][0]["function"] == {"name": name, "arguments": ""}, text
        stream = p.stream()
        deltas = [stream.update(text), stream.update("", "length")]
        assert deltas[0] is None and deltas[1]["tool_calls"][0]["function"] == {"name": name, "arguments": ""}
    auto = tool_call_plan(_request(tools=TOOLS[:1]))  # text allowed: it may not have been a call at all
    assert "tool_calls" not in auto.message('{"na', "length", False)[0]
    # cut by the request's own stop string: `stop`, not `tool_calls`, and the arguments as they are
    cut = '{"name": "get_weather", "arguments": {"city": "Oslo"'
    message, reason = plan.message(cut, "stop", grammar_complete("stop", ",", None))
    assert reason == "stop" and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"'
    assert grammar_complete("stop", 2, [7]) and not grammar_complete("stop", 7, [7])
    assert grammar_complete("stop", None, None) and not grammar_complete("length", None, None)


def _streamed(plan, text: str, size: int):
    """`text` through the plan's stream in pieces of `size`, as a route feeds it: a choice whose
    visible text reached a stop string ends there (`VisibleStops`: its last update, finish `stop`),
    else it ends `stop` with its grammar complete. (its deltas, its finish reason)"""
    stream = plan.stream()
    deltas = []
    for i in range(0, len(text), size):
        deltas.append(stream.update(text[i:i + size]))
        if stream.stopped is not None:
            deltas.append(stream.update("", "stop", False))
            return deltas, stream.finish_reason("stop", False)
    deltas.append(stream.update("", "stop", True))
    return deltas, stream.finish_reason("stop", True)


def test_stop_strings_meet_what_the_client_sees_not_the_envelope():
    """QA 1129j D1: a stop string that occurs in the envelope ('name', the function's name, a quote,
    a brace, 'content') cut the answer before any call or text existed. Now they apply to a call's
    arguments, a text answer's decoded string, an answer's JSON: the first one there cuts it (finish
    `stop`), streamed in any pieces the same."""
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    answer = '{"content": "It is \\"sunny\\", ok\\nbye"}'  # decoded: It is "sunny", ok\nbye
    cases = [  # (tool_choice, response_format, output, stop, the visible text, finish reason)
        ("required", None, call, ["name", "arguments", "get_weather", "{\"name"], '{"city": "Oslo", "unit": "celsius"}',
         "tool_calls"),
        ("required", None, call, ["}}", "xyz"], '{"city": "Oslo", "unit": "celsius"}', "tool_calls"),
        ("required", None, call, ["name", '"'], "{", "stop"),
        ("required", None, call, ["{"], "", "stop"),
        ("required", None, call, ["city", "Os"], '{"', "stop"),
        ("required", None, call, ["}"], '{"city": "Oslo", "unit": "celsius"', "stop"),
        ("required", None, call, ["celsius", '", "'], '{"city": "Oslo', "stop"),
        ("auto", None, call, ["unit", '"unit": "c'], '{"city": "Oslo", "', "stop"),
        ("auto", None, answer, ["content", "{", "\\"], 'It is "sunny", ok\nbye', "stop"),
        ("auto", None, answer, ['"'], "It is ", "stop"),
        ("auto", None, answer, ["\n", "ok"], 'It is "sunny", ', "stop"),
        ("auto", None, answer, ["\nb"], 'It is "sunny", ok', "stop"),
        ("auto", {"type": "json_object"}, '{"content": {"a": [1, 2]}}', ["content"], '{"a": [1, 2]}', "stop"),
        ("auto", {"type": "json_object"}, '{"content": {"a": [1, 2]}}', [", "], '{"a": [1', "stop"),
    ]
    for choice, response_format, text, stop, visible, reason in cases:
        extra = {"response_format": response_format} if response_format else {}
        plan = tool_call_plan(_request(tools=TOOLS, tool_choice=choice, stop=stop, **extra))
        assert plan.stop == tuple(stop)
        message, got = plan.message(text, "stop", True)
        calls = message.get("tool_calls")
        shown = calls[0]["function"]["arguments"] if calls else message["content"]
        assert (shown, got) == (visible, reason), (text, stop)
        for size in range(1, 10):
            deltas, streamed_reason = _streamed(plan, text, size)
            if calls:
                items = [it for d in deltas if d for it in d["tool_calls"]]
                assert items[0]["function"]["name"] == "get_weather", (stop, size)
                pieces = [it["function"]["arguments"] for it in items]
            else:
                pieces = [d["content"] for d in deltas if d]
            assert ("".join(pieces), streamed_reason) == (visible, reason), (text, stop, size)
    # a named call has no envelope: its output is the arguments, and the engine meets the stop strings
    named = tool_call_plan(_request(tools=TOOLS, tool_choice=_named("get_weather"), stop=["name"]))
    assert named.stop == ()


def test_the_engine_gets_no_stop_strings_under_an_envelope():
    from constrained_spec.sampling_params import SamplingParams
    from constrained_spec.server.tool_stops import engine_params
    params = [SamplingParams(max_tokens=8, stop=["name", ","], seed=i) for i in range(2)]
    required = tool_call_plan(_request(tools=TOOLS, tool_choice="required", stop=["name", ","]))
    assert [p.stop for p in engine_params(required, params)] == [[], []]
    assert [p.seed for p in engine_params(required, params)] == [0, 1]
    named = tool_call_plan(_request(tools=TOOLS, tool_choice=_named("get_weather"), stop=["name", ","]))
    assert engine_params(named, params) is params and engine_params(None, params) is params
    plain = tool_call_plan(_request(tools=TOOLS, tool_choice="required"))
    assert engine_params(plain, params) is params


def test_a_choice_that_reaches_a_stop_string_ends_there():
    """`VisibleStops`: choice 0's arguments reach the stop string in its second update: that update
    is its last (finished `stop`, the tokens made so far), its engine request is aborted, and what
    the engine sent after is dropped; choice 1 never meets one and runs to its end."""
    import asyncio

    from constrained_spec.engine.request import FinishReason, RequestOutput
    from constrained_spec.server.tool_stops import VisibleStops

    class FakeGeneration:
        def __init__(self, updates):
            self.request_ids, self.done, self.updates, self.aborted = ["r-0", "r-1"], [False, False], updates, []
            self.engine = self

        def abort(self, rid=None):
            self.aborted.append(rid)

        def end_choice(self, i):
            self.done[i] = True
            self.abort(self.request_ids[i])

        async def batches(self):
            for items in self.updates:
                if all(self.done):
                    return
                for i, out in items:
                    self.done[i] = self.done[i] or out.finished
                yield items

        async def __aiter__(self):
            async for items in self.batches():
                for item in items:
                    yield item

    def out(rid, text, n, finished=False):
        return RequestOutput(rid, text, [n], finished, FinishReason.STOP if finished else None, None, 5, n, None,
                             2 if finished else None)

    updates = [[(0, out("r-0", '{"name": "get_weather", ', 1)), (1, out("r-1", '{"name": "get_time", ', 1))],
               [(0, out("r-0", '"arguments": {"city": "Os', 2)), (1, out("r-1", '"arguments": {"tz": "UTC"}', 2))],
               [(0, out("r-0", 'lo"}}', 3, True)), (1, out("r-1", "}", 3, True))]]
    plan = tool_call_plan(_request(tools=TOOLS, tool_choice="required", stop=["Os"]))

    async def run(method):
        gen = FakeGeneration(updates)
        view = VisibleStops(gen, plan, 2)
        if method == "batches":
            got = [item async for items in view.batches() for item in items]
        else:
            got = [item async for item in view]
        return gen, got

    for method in ("batches", "iter"):
        gen, got = asyncio.run(run(method))
        assert gen.aborted == ["r-0"]
        ends = {i: o for i, o in got if o.finished}
        assert [i for i, _ in got] == [0, 1, 0, 1, 1]
        assert (ends[0].finish_reason, ends[0].matched_stop, ends[0].completion_tokens) == (FinishReason.STOP, "Os", 2)
        assert ends[1].matched_stop == 2
        text = "".join(o.new_text for i, o in got if i == 0)
        message, reason = plan.message(text, "stop", grammar_complete("stop", ends[0].matched_stop, None))
        assert reason == "stop" and message["tool_calls"][0]["function"]["arguments"] == '{"city": "'


def test_auto_answers_in_text_or_calls():
    plan = tool_call_plan(_request(tools=TOOLS, tool_choice="auto"))
    message, reason = plan.message('{"name": "get_time", "arguments": {"timezone": "UTC"}}', "stop", True)
    assert reason == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "get_time"
    answer = r'It is \"sunny\" \\ 20\u00b0C \ud83c\udf1e\nok'  # JSON string escapes, a surrogate pair
    text = '{"content": "' + answer + '"}'
    decoded = json.loads('"' + answer + '"')
    message, reason = plan.message(text, "stop", True)
    assert reason == "stop" and message["content"] == decoded and "tool_calls" not in message
    for size in range(1, 9):  # streamed in any pieces: the decoded text, escapes never split
        stream = plan.stream()
        deltas = [stream.update(text[i:i + size]) for i in range(0, len(text), size)] + [stream.update("", "stop", True)]
        pieces = [d["content"] for d in deltas if d]
        assert "".join(pieces) == decoded and stream.finish_reason("stop", True) == "stop", size
    message, reason = plan.message(text[:30], "length", False)  # cut inside the string: as far as it decodes
    assert reason == "length" and decoded.startswith(message["content"]) and message["content"]
    # cut before it said which: nothing, as its stream says nothing (QA 1129m agents D7: content "" here)
    assert plan.message('{"con', "length", False)[0]["content"] is None
    stream = plan.stream()
    assert not stream.update('{"con') and not stream.update("", "length", False)


def test_auto_with_a_response_format_answers_under_its_schema():
    """Tools and a JSON response_format together (what an agent with tools and a structured output
    type sends): the answer branch is {"content": <JSON under the format's schema>}, with its $defs
    moved beside the functions'; the message's content is that JSON, streamed in any pieces alike.
    With a call forced or required the format does not apply."""
    point = {"type": "object", "properties": {"at": {"$ref": "#/$defs/xy"}}, "required": ["at"],
             "$defs": {"xy": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": point}}
    plan = tool_call_plan(_request(tools=TOOLS, response_format=fmt))
    answer = plan.schema["anyOf"][-1]
    assert answer["required"] == ["content"] and answer["properties"]["content"]["properties"]["at"] == {
        "$ref": "#/$defs/answer.format__xy"}
    assert plan.schema["$defs"]["answer.format__xy"] == point["$defs"]["xy"]
    assert "under this schema" in plan.with_instructions([{"role": "user", "content": "x"}])[0]["content"]
    inner = '{"at": {"x": 3}}'
    text = '{"content": ' + inner + ' }'
    message, reason = plan.message(text, "stop", True)
    assert reason == "stop" and message["content"] == inner and "tool_calls" not in message
    assert plan.message(text[:20], "length", False)[0]["content"] == inner[:20 - len('{"content": ')]
    for size in range(1, 9):
        stream = plan.stream()
        deltas = [stream.update(text[i:i + size]) for i in range(0, len(text), size)] + [stream.update("", "stop", True)]
        assert "".join(d["content"] for d in deltas if d) == inner and stream.finish_reason("stop", True) == "stop"
    call = '{"name": "get_time", "arguments": {"timezone": "UTC"}}'
    assert plan.message(call, "stop", True)[0]["tool_calls"][0]["function"]["name"] == "get_time"
    assert tool_call_plan(_request(tools=TOOLS, response_format={"type": "json_object"})).answer_schema == {
        "type": "object"}
    for choice in ("required", _named("get_time")):
        assert tool_call_plan(_request(tools=TOOLS, tool_choice=choice, response_format=fmt)).answer_schema is None


def test_instructions_for_a_template_without_tools():
    plan = tool_call_plan(_request(tools=TOOLS, tool_choice=_named("get_time")))
    alone = plan.with_instructions([{"role": "user", "content": "What time is it in Paris?"}])
    assert alone[0]["role"] == "system" and "get_time" in alone[0]["content"] and "timezone" in alone[0]["content"]
    merged = plan.with_instructions([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}])
    assert len(merged) == 2 and merged[0]["content"].startswith("Be brief.\n\nYou can call these functions")


# -- the real server ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_named_call_through_openai(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        tool_choice=_named("get_weather"), max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # streamed: the same call, piece by piece
    chunks = list(openai_client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        tool_choice=_named("get_weather"), max_tokens=60, temperature=0, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0][0].function.name == "get_weather" and deltas[0][0].id
    assert "".join(d[0].function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_auto_through_openai(openai_client):
    """`auto` (also what leaving tool_choice out means): a call whose arguments validate, or text;
    the streamed answer is the same."""
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for question in ("What time is it in Tokyo?", "Tell me a short joke about cats."):
        kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": question}], tools=TOOLS, max_tokens=60,
                  temperature=0)
        choice = openai_client.chat.completions.create(**kw).choices[0]
        chunks = list(openai_client.chat.completions.create(**kw, stream=True))
        streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert chunks[-1].choices[0].finish_reason == choice.finish_reason
        if choice.message.tool_calls:
            (call,) = choice.message.tool_calls
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
            assert "".join(d.function.arguments or "" for d in calls) == call.function.arguments
        else:
            assert choice.finish_reason in ("stop", "length") and not calls
            assert choice.message.content and streamed_text == choice.message.content


@pytest.mark.slow
def test_auto_with_a_response_format_through_openai(openai_client):
    """Tools and a structured output type in one request: a valid call, or content that validates
    under the response format's schema; streamed alike."""
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    joke = {"type": "object", "properties": {"setup": {"type": "string", "maxLength": 60},
                                             "punchline": {"type": "string", "maxLength": 60}},
            "required": ["setup", "punchline"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "joke", "schema": joke}}
    answers = 0
    # SmolLM2-135M calls a function whatever it is asked; the second request bans the envelope's `name`
    # key as SmolLM2 spells it ('name', 'n'), so that it answers
    for question, bias in (("What time is it in Tokyo?", None), ("Tell me a joke about cats.", {"1245": -100, "94": -100})):
        kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": question}], tools=TOOLS, max_tokens=80,
                  temperature=0, response_format=fmt, **({"logit_bias": bias} if bias else {}))
        choice = openai_client.chat.completions.create(**kw).choices[0]
        chunks = list(openai_client.chat.completions.create(**kw, stream=True))
        streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        if choice.message.tool_calls:
            (call,) = choice.message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
        else:
            answers += 1
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), joke)
            # streamed alike: an answer under the format too (not the same text: the second request
            # extends the first's cached prompt, and this CPU's bfloat16 without AMX is not
            # shape-invariant, so greedy may pick another first token)
            if not calls and chunks[-1].choices[0].finish_reason == "stop":
                jsonschema.validate(json.loads(streamed_text), joke)
    assert answers >= 1


@pytest.mark.slow
def test_a_stop_string_cuts_a_call(http):
    """The request's own stop string ends a call where it appears: `stop`, not `tool_calls`, with the
    arguments up to it, streamed or not."""
    body = chat_body(content="What is the weather in Paris?", tools=TOOLS, tool_choice=_named("get_weather"),
                     stop=[","], max_tokens=60, temperature=0)
    r = http.post("/v1/chat/completions", json=body).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop", r
    arguments = choice["message"]["tool_calls"][0]["function"]["arguments"]
    assert arguments.startswith("{") and "," not in arguments
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    pieces = [c["function"].get("arguments", "") for e in events for ch in e["choices"]
              for c in ch["delta"].get("tool_calls") or ()]
    assert "".join(pieces) == arguments and events[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_stop_string_in_the_envelope_leaves_the_call(http):
    """QA 1129j D1: under `required`, stop "name" (a key of the envelope) came back as an empty
    `stop` answer with no call. It now meets only the arguments; a stop string inside them cuts the
    call there (finish `stop`), streamed as unstreamed."""
    body = chat_body(content="What is the weather in Paris?", tools=TOOLS, tool_choice="required", stop=["name"],
                     max_tokens=40, temperature=0)
    r = http.post("/v1/chat/completions", json=body).json()
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] in ("get_weather", "get_time") and call["function"]["arguments"].startswith("{")

    def streamed(b):
        with http.stream("POST", "/v1/chat/completions", json={**b, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        items = [c for e in events for ch in e["choices"] for c in ch["delta"].get("tool_calls") or ()]
        return items, events[-1]["choices"][0]["finish_reason"]

    items, reason = streamed(body)
    assert items[0]["function"]["name"] == call["function"]["name"] and reason == r["choices"][0]["finish_reason"]
    assert "".join(c["function"].get("arguments", "") for c in items) == call["function"]["arguments"]
    items, reason = streamed({**body, "stop": ['"']})  # the arguments' first quote: the call ends there
    assert reason == "stop" and "".join(c["function"].get("arguments", "") for c in items) == "{"


@pytest.mark.slow
def test_required_picks_a_tool(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], tools=TOOLS,
        tool_choice="required", max_tokens=60, temperature=0.8, seed=3, n=3)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


class Lookup(BaseModel):
    city: str
    days: int


class Address(BaseModel):
    city: str


class Person(BaseModel):  # nested and recursive: pydantic writes $defs and refs to them
    name: str
    home: Address
    friends: list["Person"] = []


class Shipment(BaseModel):
    to: "Parcel"


class Parcel(BaseModel):  # another function's own `Address`-like def of the same name as a field type
    city: int


def test_envelopes_keep_each_function_s_defs():
    """`required`/`auto` put each function's parameters inside an envelope, where refs to their
    `$defs` (pydantic's nested models) would point at the envelope's root: they move there, under
    the function's name, and an instance of either function validates against the envelope."""
    openai = pytest.importorskip("openai")
    tools = [openai.pydantic_function_tool(Person), openai.pydantic_function_tool(Shipment)]
    for choice in ("required", "auto"):
        schema = tool_call_plan(_request(tools=tools, tool_choice=choice)).schema
        assert all(key.split("__")[0] in ("Person", "Shipment") for key in schema["$defs"])
        friend = {"name": "b", "home": {"city": "Oslo"}, "friends": []}
        jsonschema.validate({"name": "Person", "arguments": {"name": "a", "home": {"city": "Rome"},
                                                             "friends": [friend]}}, schema)
        jsonschema.validate({"name": "Shipment", "arguments": {"to": {"city": 3}}}, schema)
        with pytest.raises(jsonschema.ValidationError):  # Parcel's city is an integer, Address's a string
            jsonschema.validate({"name": "Shipment", "arguments": {"to": {"city": "Rome"}}}, schema)


@pytest.mark.slow
def test_parse_with_a_pydantic_tool(openai_client):
    openai = pytest.importorskip("openai")
    r = openai_client.chat.completions.parse(
        model=MODEL_ID, messages=[{"role": "user", "content": "Forecast for Lima, three days."}],
        tools=[openai.pydantic_function_tool(Lookup)], tool_choice=_named("Lookup"), max_tokens=40, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Lookup)
    # nested models, the model picking the function: pydantic's $defs inside the envelope
    r = openai_client.chat.completions.parse(
        model=MODEL_ID, messages=[{"role": "user", "content": "Ann lives in Oslo; her friend Bo lives in Rome."}],
        tools=[openai.pydantic_function_tool(Person), openai.pydantic_function_tool(Lookup)],
        tool_choice="required", max_tokens=120, temperature=0)
    choice = r.choices[0]
    if choice.finish_reason == "tool_calls":  # (a 135M model may write past max_tokens)
        (call,) = choice.message.tool_calls
        assert isinstance(call.function.parsed_arguments, (Person, Lookup))


@pytest.mark.slow
def test_conversation_with_a_tool_result(http):
    body = chat_body(messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": -3}'},
        {"role": "user", "content": "And in Rome?"}], tools=TOOLS, tool_choice=_named("get_weather"), max_tokens=40,
        temperature=0)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    # the same conversation answered in text when no call is forced
    plain = http.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json()
    assert plain["choices"][0]["message"]["content"] and "tool_calls" not in plain["choices"][0]["message"]


@pytest.mark.slow
@pytest.mark.parametrize("extra, param", [({"tool_choice": _named("nope")}, "tool_choice"),
                                          ({"tool_choice": _named("get_weather"), "logprobs": True}, "logprobs"),
                                          ({"tool_choice": "auto", "regex": "[a-z]+"}, "tools"),
                                          ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                              "type": "object", "if": {"required": ["a"]}, "then": {}}}}],
                                            "tool_choice": "required"}, "tools.0.function.parameters")])
def test_refused_tool_requests(http, extra, param):
    r = http.post("/v1/chat/completions", json=chat_body(**{"tools": TOOLS, **extra}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    if "if" in str(extra):  # a function's schema the compiler refuses: the keyword named, as for response_format
        assert "'if'" in r.json()["error"]["message"] and r.json()["error"]["code"] == "unsupported_schema", r.json()


NEVER_ENDS = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}  # each x needs another
TREE = {"type": "object", "properties": {"value": {"type": "integer"},
                                         "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["value"]}


@pytest.mark.parametrize("backend", [None, "xgrammar", "llguidance"])
@pytest.mark.parametrize("choice", ["required", "auto", _named("loop")])
def test_a_function_whose_parameters_accept_no_arguments_is_a_400_naming_them(http, choice, backend):
    """Its call was a dead branch of the calls' grammar, pruned: the function silently never
    called (named, a 400 naming only `tools`). A recursive function that can end is served."""
    extra = {} if backend is None else {"grammar_backend": backend}
    untyped = {k: v for k, v in NEVER_ENDS.items() if k != "type"}  # an object all the same: arguments are one
    # no type, and only other values at the root: as an object's schema, none (under auto they were
    # a dead branch, pruned: the function silently never called)
    not_objects = [{"anyOf": [{"type": "string"}, {"type": "integer"}]}, {"enum": ["a", "b"]}]
    # required properties no value meets: under llguidance (and auto, which tries it first) a 200
    # whose function could never be called (QA round 2 A)
    no_value = [{"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 2}},
                 "required": ["n"]},
                {"type": "object", "properties": {"s": {"type": "string", "minLength": 5, "maxLength": 2}},
                 "required": ["s"]},
                {"type": "object", "properties": {"f": False}, "required": ["f"]}]
    for never_ends in (NEVER_ENDS, untyped, *not_objects, *no_value):
        tools = TOOLS[:1] + [{"type": "function", "function": {"name": "loop", "parameters": never_ends}}]
        r = http.post("/v1/chat/completions", json=chat_body(tools=tools, tool_choice=choice, max_tokens=4, **extra))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tools.1.function.parameters" and err["code"] == "invalid_schema", err
    tools[1]["function"]["parameters"] = TREE
    r = http.post("/v1/chat/completions", json=chat_body(tools=tools, tool_choice=choice, max_tokens=4, **extra))
    assert r.status_code == 200, r.text
    if choice == "auto":  # the answer format beside the tools: its branch was as silently gone
        answer = {"type": "json_schema", "json_schema": {"name": "a", "schema": no_value[0]}}
        r = http.post("/v1/chat/completions", json=chat_body(tools=TOOLS[:1], response_format=answer, max_tokens=4,
                                                             **extra))
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text


def _allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [_named(n) for n in names]}}


def test_allowed_tools_plan():
    """OpenAI's `allowed_tools`: every tool in the prompt, calls of the listed ones alone."""
    required = tool_call_plan(_request(tools=TOOLS, tool_choice=_allowed("required", "get_time")))
    assert [alt["properties"]["name"]["const"] for alt in required.schema["anyOf"]] == ["get_time"]
    assert not required.allow_text and required.forced is None
    assert [t["function"]["name"] for t in required.tools_for_template()] == ["get_weather", "get_time"]
    assert "may call now: get_time." in required.with_instructions([])[0]["content"]
    auto = tool_call_plan(_request(tools=TOOLS, tool_choice=_allowed("auto", "get_weather")))
    assert [alt["properties"].get("name", {}).get("const") for alt in auto.schema["anyOf"]] == ["get_weather", None]
    with pytest.raises(APIError) as e:
        tool_call_plan(_request(tools=TOOLS, tool_choice=_allowed("required", "get_time", "nope")))
    assert e.value.param == "tool_choice.allowed_tools.tools.1" and "'nope'" in e.value.message
    with pytest.raises(ValidationError):  # an empty list, an unknown mode
        _request(tools=TOOLS, tool_choice=_allowed("required"))
    with pytest.raises(ValidationError):
        _request(tools=TOOLS, tool_choice=_allowed("sometimes", "get_time"))


def test_allowed_tools_through_openai(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "What is the weather in Oslo?"}], tools=TOOLS,
        tool_choice=_allowed("required", "get_time"), max_tokens=40, temperature=1.0, seed=5, n=3)
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time", call
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])


@pytest.mark.parametrize("choice", ["required", "auto", _named("bad"), _allowed("required", "bad")])
def test_a_fault_in_a_function_s_parameters_names_the_function_and_its_own_path(http, choice):
    """The calls' grammar holds every function's parameters inside an envelope of its own
    (`/anyOf/1/properties/arguments`, `$defs` renamed `bad__Y`): a fault there is named as the user
    wrote it, in the function's parameters, not in the envelope. The answer format too (auto)."""
    bad_regex = {"type": "string", "pattern": "(["}
    cases = [({"type": "object", "properties": {"b": bad_regex}}, "/properties/b"),
             ({"type": "object", "properties": {"x": {"$ref": "#"}, "b": bad_regex}}, "/properties/b"),  # body moved
             ({"type": "object", "properties": {"y": {"$ref": "#/definitions/Y"}}, "definitions": {"Y": bad_regex}},
              "/definitions/Y"),
             ({"type": "object", "properties": {"y": {"$ref": "#/$defs/Y"}}, "$defs": {"Y": bad_regex}}, "/$defs/Y"),
             ({"type": "object", "properties": {"y": {"$ref": "#/$defs/a~1b"}}, "$defs": {"a/b": bad_regex}},
              "/$defs/a~1b")]  # (was named under /definitions: the escaped key looked up unescaped)
    for parameters, path in cases:
        tools = TOOLS[:1] + [{"type": "function", "function": {"name": "bad", "parameters": parameters}}]
        r = http.post("/v1/chat/completions", json=chat_body(tools=tools, tool_choice=choice, max_tokens=4))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tools.1.function.parameters" and err["code"] == "invalid_schema", err
        assert f"at {path}:" in err["message"] and "anyOf" not in err["message"] and "bad__" not in err["message"], err
    if choice == "auto":
        answer = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "properties": {
            "n": {"$ref": "#/$defs/N"}}, "$defs": {"N": bad_regex}}}}
        r = http.post("/v1/chat/completions", json=chat_body(tools=TOOLS, response_format=answer, max_tokens=4))
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "response_format.json_schema.schema", r.text
        assert "at /$defs/N:" in err["message"] and "answer.format" not in err["message"], err


@pytest.mark.parametrize("bad", [{"type": "object", "properties": {"b": {"type": "string", "pattern": "(["}}},
                                 {"type": "object", "properties": {"x": {"if": {"required": ["a"]}, "then": {}}}}])
def test_under_llguidance_a_refused_function_is_named_too(http, bad):
    """llguidance's refusals carry no path: among the calls (`required`) the 400 named `tools`
    alone; the function at fault, compiled alone, is named (its own path where the compiler gives one)."""
    tools = TOOLS[:1] + [{"type": "function", "function": {"name": "bad", "parameters": bad}}]
    r = http.post("/v1/chat/completions", json=chat_body(tools=tools, tool_choice="required", max_tokens=4,
                                                         grammar_backend="llguidance"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.1.function.parameters", r.text


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("parameters, an_object", [
    ({}, "{}"), ({"type": "object"}, "{}"), ({"type": "object", "description": "no inputs"}, "{}"),
    ({"properties": {"city": {"type": "string"}}, "required": ["city"]}, '{"city": "Paris"}'),
    ({"type": ["object", "null"], "properties": {"city": {"type": "string"}}}, '{"city": "Paris"}')])
def test_arguments_are_an_object_whatever_the_parameters_leave_out(tokenizer, backend, parameters, an_object):
    """A schema with no `type` (`{}`, `properties` alone) also accepts a string or an array: the
    model wrote `"Paris"` as a call's arguments. Every call's arguments are an object. One that
    says nothing of its properties (`{}`, `{"type": "object"}`: an MCP server's tool without inputs)
    is no arguments under strict, the default, as omitted parameters are (QA 1129m agents D5: the
    model filled it with whatever, the tool listing copied, or a call cut by max_tokens)."""
    from constrained_spec.grammar import GrammarBackend
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
    grammars = GrammarBackend(tokenizer, len(tokenizer), cache_dir=None)
    try:
        for choice in (_named("get_weather"), "required", "auto"):
            plan = tool_call_plan(_request(tools=tools, tool_choice=choice))
            compiled = grammars.compile(plan.grammar().with_backend(backend), timeout_s=60)
            head = "" if plan.forced else '{"name": "get_weather", "arguments": '
            other = '{"city": "Paris"}' if an_object == "{}" else "{}"
            for arguments, legal in (('"Paris"', False), ('["Paris"]', False), ('null', False),
                                     (an_object, True), (other, an_object != "{}" and other == "{}" and
                                                         "required" not in parameters)):
                ids = tokenizer.encode(head + arguments, add_special_tokens=False)
                matcher = grammars.matcher(compiled)
                assert (matcher.accept_tokens(ids) == len(ids)) == legal, (choice, arguments)
    finally:
        grammars.close()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_nested_models_compile_in_envelopes(tokenizer, backend):
    openai = pytest.importorskip("openai")
    from constrained_spec.grammar import GrammarBackend
    tools = [openai.pydantic_function_tool(Person), openai.pydantic_function_tool(Shipment)]
    grammars = GrammarBackend(tokenizer, len(tokenizer), cache_dir=None)
    try:
        for choice in ("required", "auto", _named("Person")):
            plan = tool_call_plan(_request(tools=tools, tool_choice=choice))
            assert grammars.compile(plan.grammar().with_backend(backend), timeout_s=60) is not None
    finally:
        grammars.close()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_openai_s_128_tools_compile(tokenizer, backend):
    """OpenAI takes up to 128 tools: with `auto` their calls and the text answer are one 129-branch
    anyOf, within the schema normalizer's bound (grammar/schema.py MAX_BRANCHES)."""
    from constrained_spec.grammar import GrammarBackend
    # (no maxLength: xgrammar unrolls a bounded string, 40 s for WEATHER's in 128 branches, against 0.9 s
    # with llguidance, which the server's default `auto` backend compiles a new grammar with)
    params = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city"]}
    many = [{"type": "function", "function": {"name": f"fn_{i}", "parameters": params}} for i in range(128)]
    plan = tool_call_plan(_request(tools=many))
    assert len(plan.schema["anyOf"]) == 129
    grammars = GrammarBackend(tokenizer, len(tokenizer), cache_dir=None)
    try:
        assert grammars.compile(plan.grammar().with_backend(backend), timeout_s=60) is not None
    finally:
        grammars.close()
    with pytest.raises(ValidationError):  # more than OpenAI's limit
        _request(tools=many + many[:1])


def test_an_enum_value_shaped_like_a_ref_is_data():
    """Moving a function's `$defs` into the envelope renames its `$ref`s, not an enum value that looks
    like one (it was rewritten to `#/$defs/f__A`, changing the value allowed: review 1130c L1)."""
    from constrained_spec.server.tools import _envelope_parameters
    params = {"$defs": {"A": {"type": "string"}}, "type": "object",
              "properties": {"x": {"$ref": "#/$defs/A"}, "y": {"enum": [{"$ref": "#/$defs/A"}]}}}
    body, defs = _envelope_parameters("f", params)
    assert body["properties"]["x"] == {"$ref": "#/$defs/f__A"} and set(defs) == {"f__A"}
    assert body["properties"]["y"] == {"enum": [{"$ref": "#/$defs/A"}]}

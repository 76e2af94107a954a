"""The Responses API (`POST /v1/responses`) through the official `openai` package, unchanged, against
the real server with the real SmolLM2: `responses.create` (text and json_schema), `responses.parse`
with a pydantic model, `responses.stream` (events reassemble to the answer, parsed), function tools
(a forced call, streamed and not, and a function_call_output turn; beside a format, an answer under
it), max_output_tokens as an
incomplete response, stored responses (retrieve, delete, previous_response_id, shared by the
front-ends of one engine process), and the 400s for what the server does not take."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import API_KEY, MODEL_ID, break_off, give_up_on, wait_kv_full

openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install -e '.[dev]')")

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                       "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


class Pet(BaseModel):
    name: str
    species: str
    legs: int


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


def test_text_response(openai_client, http):
    r = openai_client.responses.create(model=MODEL_ID, input="Say hello.", instructions="Be brief.",
                                       max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.output[0].id.startswith("msg_") and r.model
    assert r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text == r.output[0].content[0].text and r.output_text
    assert 0 < r.usage.output_tokens <= 8 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.usage.output_tokens == 8:  # cut: the response and its message are incomplete, as OpenAI's are
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == r.status
    assert 'constrained_spec_http_requests_total{endpoint="/v1/responses",status="200"}' in http.get("/metrics").text
    # one label per route, not "other" (nor one per id)
    assert http.get(f"/v1/responses/{r.id}").status_code == 200
    assert http.get(f"/v1/responses/{r.id}/input_items").status_code == 200
    metrics = http.get("/metrics").text
    for route in ("/v1/responses/{id}", "/v1/responses/{id}/input_items"):
        assert f'constrained_spec_http_requests_total{{endpoint="{route}",status="200"}}' in metrics, route


def test_json_schema_response_validates(openai_client):
    r = openai_client.responses.create(
        model=MODEL_ID, input=[{"role": "user", "content": [{"type": "input_text", "text": "A person as JSON."}]}],
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
        max_output_tokens=64, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)


# one grammar backend for answers compared (`auto` may hand a repeated grammar to xgrammar, whose
# whitespace rules differ); the extension field passes through as on the chat route
ONE_BACKEND = {"extra_body": {"grammar_backend": "xgrammar"}}


def test_parse_and_stream_agree(openai_client):
    kw = dict(model=MODEL_ID, input="Describe a pet.", text_format=Pet, max_output_tokens=80, temperature=0,
              **ONE_BACKEND)
    parsed = openai_client.responses.parse(**kw)
    assert isinstance(parsed.output_parsed, Pet)
    deltas, kinds = [], []
    with openai_client.responses.stream(**kw) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(deltas) == final.output_text == parsed.output_text  # greedy: the same answer
    assert final.output_parsed == parsed.output_parsed
    assert final.usage.output_tokens == parsed.usage.output_tokens


def test_a_function_call_cut_by_max_output_tokens_is_incomplete(openai_client):
    """A call whose arguments max_output_tokens cut is an "incomplete" item, as a cut message is (QA
    1129m agents D1: it said "completed" with arguments no JSON parser takes, which an agent loop
    runs), streamed and not."""
    kw = dict(model=MODEL_ID, input="What is the weather in Paris?", tools=[WEATHER],
              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=3, temperature=0,
              **ONE_BACKEND)
    r = openai_client.responses.create(**kw)
    assert r.status == "incomplete" and [(o.type, o.status) for o in r.output] == [("function_call", "incomplete")]
    events = list(openai_client.responses.create(**kw, stream=True))
    done = [e.item.status for e in events if e.type == "response.output_item.done"]
    assert done == ["incomplete"] and events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].status == "incomplete"


def test_forced_function_call(openai_client):
    kw = dict(model=MODEL_ID, input="What is the weather in Paris?", tools=[WEATHER],
              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40, temperature=0,
              **ONE_BACKEND)
    r = openai_client.responses.create(**kw)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with openai_client.responses.stream(**kw) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert final.output[0].type == "function_call" and "".join(pieces) == final.output[0].arguments
    assert final.output[0].arguments == call.arguments
    # the call's result as the next turn, the response's own output items passed back as OpenAI's
    # guides do (`input += response.output`): a text answer
    follow = openai_client.responses.create(
        model=MODEL_ID, tools=[WEATHER], max_output_tokens=16, temperature=0, tool_choice="none",
        input=[{"role": "user", "content": "What is the weather in Paris?"}, *r.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert follow.output[0].type == "message" and follow.output_text
    again = openai_client.responses.create(model=MODEL_ID, max_output_tokens=8, temperature=0,
                                           input=[{"role": "user", "content": "Hi"}, *follow.output,
                                                  {"role": "user", "content": "And tomorrow?"}])
    assert again.output_text


def test_a_stop_string_in_the_envelope_leaves_the_call(http):
    """QA 1129j D1: `required` with stop "name" (a key of the server's call envelope) answered one
    empty message and no function_call; the stop strings meet only the arguments."""
    r = http.post("/v1/responses", json={"model": MODEL_ID, "input": "What is the weather in Paris?",
                                         "tools": [WEATHER], "tool_choice": "required", "stop": ["name"],
                                         "max_output_tokens": 40, "temperature": 0}).json()
    (call,) = r["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather", r
    assert call["arguments"].startswith("{")


def test_tools_beside_a_format_answer_under_it(openai_client):
    """Function tools and `text.format` together (the agent case): an answer, not a call, is JSON
    under the format, streamed alike. SmolLM2-135M always calls; `logit_bias` bans the envelope's
    `name` key as it spells it ('name', 'n') to reach the answer."""
    kw = dict(model=MODEL_ID, input="A person as JSON.", tools=[WEATHER], max_output_tokens=64, temperature=0,
              text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
              extra_body={"logit_bias": {"1245": -100, "94": -100}, "grammar_backend": "xgrammar"})
    r = openai_client.responses.create(**kw)
    assert r.status == "completed" and r.output[0].type == "message", r.output
    jsonschema.validate(json.loads(r.output_text), PERSON)
    with openai_client.responses.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text


def test_previous_response_id_continues_the_stored_conversation(openai_client):
    """A response is stored (OpenAI's default): retrieved whole by id, and continued with
    previous_response_id, whose prompt is exactly the conversation sent by hand (the earlier input,
    `*r.output`, the new input) without the earlier instructions, which OpenAI does not carry over."""
    first = openai_client.responses.create(model=MODEL_ID, input="My name is Ada. Say hi.",
                                           instructions="Answer in one short sentence.", max_output_tokens=8,
                                           temperature=0)
    got = openai_client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    chained = openai_client.responses.create(model=MODEL_ID, previous_response_id=first.id,
                                             input="What is my name?", max_output_tokens=8, temperature=0)
    assert chained.previous_response_id == first.id and chained.instructions is None
    by_hand = openai_client.responses.create(
        model=MODEL_ID, input=[{"role": "user", "content": "My name is Ada. Say hi."}, *first.output,
                               {"role": "user", "content": "What is my name?"}],
        max_output_tokens=8, temperature=0, store=False)
    assert chained.usage.input_tokens == by_hand.usage.input_tokens > first.usage.input_tokens
    assert chained.output_text == by_hand.output_text
    # and a third turn on the second: the whole conversation carries on
    third = openai_client.responses.create(model=MODEL_ID, previous_response_id=chained.id, input="Thanks.",
                                           max_output_tokens=4, temperature=0)
    assert third.usage.input_tokens > chained.usage.input_tokens + chained.usage.output_tokens


def test_a_chained_turn_finds_the_conversation_in_the_prefix_cache(openai_client):
    """previous_response_id rebuilds the conversation through the chat template; its earlier prompt
    and answer come back token for token, so the prefix cache serves them (all but the last token)."""
    first = openai_client.responses.create(model=MODEL_ID, input="Name three colors.", max_output_tokens=12,
                                           temperature=0)
    chained = openai_client.responses.create(model=MODEL_ID, previous_response_id=first.id,
                                             input="And three fruits?", max_output_tokens=4, temperature=0)
    cached = chained.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens + first.usage.output_tokens - 2, (cached, first.usage)


def test_input_items_list_a_stored_responses_input(openai_client, http):
    """`responses.input_items.list` pages through the stored response's own input items, newest first
    by default, each with an id (the SDK follows `has_more` / `after` across pages)."""
    turns = [{"role": "user", "content": f"Turn {i}."} for i in range(5)]
    r = openai_client.responses.create(model=MODEL_ID, input=turns, max_output_tokens=2, temperature=0)
    listed = list(openai_client.responses.input_items.list(r.id, limit=2))  # three pages
    assert [item.content[0].text for item in listed] == [f"Turn {i}." for i in range(4, -1, -1)]
    assert len({item.id for item in listed}) == 5 and all(item.type == "message" for item in listed)
    asc = openai_client.responses.input_items.list(r.id, order="asc", limit=100)
    assert [item.id for item in asc.data] == [item.id for item in reversed(listed)] and not asc.has_more
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=msg_nope", "after")):
        bad = http.get(f"/v1/responses/{r.id}/input_items?{query}")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param
    assert http.get("/v1/responses/resp_nope/input_items").status_code == 404


def test_deleted_and_unstored_responses_are_not_found(openai_client):
    r = openai_client.responses.create(model=MODEL_ID, input="Hi", max_output_tokens=4, temperature=0)
    deleted = openai_client.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    for gone in (r.id, "resp_never_made"):
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            openai_client.responses.retrieve(gone)
        with pytest.raises(openai.NotFoundError) as e:
            openai_client.responses.create(model=MODEL_ID, input="Hi", previous_response_id=gone)
        assert e.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.delete(r.id)
    unstored = openai_client.responses.create(model=MODEL_ID, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(unstored.id)


def test_streamed_response_is_stored(openai_client):
    with openai_client.responses.stream(model=MODEL_ID, input="Count to three.", max_output_tokens=12,
                                        temperature=0) as stream:
        final = list(stream)[-1].response  # response.completed, or .incomplete at max_output_tokens
    got = openai_client.responses.retrieve(final.id)
    assert got.output_text == final.output_text and got.status == final.status
    assert final.output[0].status == final.status and final.id.startswith("resp_")


def test_stored_responses_are_shared_by_front_ends(openai_client, secured_server, single_server):
    """Stored in the engine process, a response made through one front-end is found through another;
    the single-process server keeps its own store."""
    r = openai_client.responses.create(model=MODEL_ID, input="Hi", max_output_tokens=4, temperature=0)
    other = httpx.get(f"{secured_server.url}/v1/responses/{r.id}", headers={"Authorization": f"Bearer {API_KEY}"})
    assert other.status_code == 200 and other.json()["output"][0]["content"][0]["text"] == r.output_text
    single = openai.OpenAI(base_url=single_server.url + "/v1", api_key="unused", max_retries=0)
    mine = single.responses.create(model=MODEL_ID, input="Hi", max_output_tokens=4, temperature=0)
    assert single.responses.retrieve(mine.id).output_text == mine.output_text
    with pytest.raises(openai.NotFoundError):
        single.responses.retrieve(r.id)
    single.close()
    for url in (secured_server.url, single_server.url):  # both stores report themselves
        metrics = httpx.get(f"{url}/metrics").text
        count = re.search(r"^constrained_spec_stored_responses (\S+)$", metrics, re.M)
        size = re.search(r"^constrained_spec_stored_responses_bytes (\S+)$", metrics, re.M)
        assert count and size and float(count.group(1)) >= 1 and float(size.group(1)) > 0, metrics[-2000:]


def test_a_response_store_file_outlives_the_server(server_engine, tmp_path):
    """`serve --single-process --response-store FILE`: a server started again over the same file
    retrieves the response and continues its conversation."""
    from constrained_spec.server.app import ServerConfig, create_app
    from constrained_spec.server.runner import start_server_thread
    config = ServerConfig(served_model_name=MODEL_ID, response_store=str(tmp_path / "responses.db"))
    first = start_server_thread(create_app(server_engine, config), log_level="warning")
    try:
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.responses.create(model=MODEL_ID, input="Name a color.", max_output_tokens=4, temperature=0)
    finally:
        first.stop()
    again = start_server_thread(create_app(server_engine, config), log_level="warning")
    try:
        client = openai.OpenAI(base_url=again.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert client.responses.retrieve(r.id).output_text == r.output_text
        more = client.responses.create(model=MODEL_ID, previous_response_id=r.id, input="Another.",
                                       max_output_tokens=4, temperature=0)
        assert more.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    finally:
        again.stop()


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input.0.content"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object",
                                                                                        "minProperties": "a"}}}},
     "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/$defs/a",
                                                                                        "$defs": {"a": {"$ref": "#/$defs/a"}}}}}},
     "text.format.schema"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),  # was served: the model wrote for an empty user turn
    ({"input": [{"role": "user", "content": 5}]}, "input.0.content"),
    # a tool's result as a dict (a common slip): the field it is in, not a `content` it lacks (QA 1129m agents D6)
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": {"temp": 12}}]}, "input.1.output"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools.0.parameters"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [
        {"type": "function", "name": "get_weather"}, {"type": "function", "name": "nope"}]}}, "tool_choice.tools.1"),
    # logprobs asked for beside tools: the field that asks, `include`
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "include": ["message.output_text.logprobs"]},
     "include"),
])
def test_bad_requests_are_400s(http, body, param):
    r = http.post("/v1/responses", json={"model": MODEL_ID, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] and (param is None or error["param"] == param), error
    assert not param.startswith("input.") or error["message"].startswith(param), error
    assert ".function." not in error["message"], error  # a chat field's name (Responses tools are flat)


def test_allowed_tools_limit_the_calls(http):
    clock = {"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]}}
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    r = http.post("/v1/responses", json={"model": MODEL_ID, "input": "Weather in Oslo?", "tools": [WEATHER, clock],
                                         "tool_choice": allowed, "max_output_tokens": 30, "temperature": 0})
    assert r.status_code == 200, r.text
    assert [(o["type"], o["name"]) for o in r.json()["output"]] == [("function_call", "get_time")], r.text
    assert r.json()["tool_choice"] == allowed


def test_top_logprobs_alone_asks_for_none(http):
    """A client's default `top_logprobs: 0` (or any) without `include` is no logprobs request: beside
    tools it was a 400 naming `include`, which the request never sent (QA 1129m agents D2), and
    alone it returned logprobs nobody asked for."""
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
    for extra in ({"tools": tools, "tool_choice": "required"}, {}):
        r = http.post("/v1/responses", json={"model": MODEL_ID, "input": "hi", "top_logprobs": 0,
                                             "max_output_tokens": 8, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        parts = [p for item in r.json()["output"] for p in item.get("content") or []]
        assert all(not p.get("logprobs") for p in parts), parts


def test_disconnects_free_kv(openai_client, server, http):
    """A Responses stream the client closes early, or a non-streamed one it gives up on, is aborted:
    the KV pool is full again and the server admits no one in its name."""
    wait_kv_full(server)
    stream = openai_client.responses.create(model=MODEL_ID, input="Write an endless poem.", max_output_tokens=2000,
                                            stream=True, extra_body={"ignore_eos": True})
    break_off(stream, server, after=8)
    give_up_on(server, "/v1/responses", {"model": MODEL_ID, "input": "A long story.", "max_output_tokens": 2000,
                                         "ignore_eos": True})
    assert http.get("/health").json()["pending_requests"] == 0


def test_single_process_server_answers_the_same(server, single_server):
    """`serve --single-process` serves /v1/responses too, with the split server's answer (greedy),
    streamed or not."""
    body = {"model": MODEL_ID, "input": "Describe a person.", "max_output_tokens": 40, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
            "grammar_backend": "xgrammar"}
    answers = []
    for srv in (server, single_server):
        r = httpx.post(srv.url + "/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        text = r.json()["output"][0]["content"][0]["text"]
        with httpx.stream("POST", srv.url + "/v1/responses", json={**body, "stream": True}, timeout=120) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == text
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        answers.append((text, r.json()["status"], r.json()["usage"]["output_tokens"]))
    assert answers[0] == answers[1]


def test_a_failed_stream_keeps_what_it_streamed():
    """QA 1130 wire D2: `response.failed` had an empty output though an item was streamed, whose
    `output_item.done` never came."""
    from constrained_spec.server.responses import ResponseEvents
    text = ResponseEvents({"id": "resp_1", "status": "in_progress", "output": []})
    events = text.start() + text.delta({"content": "Hel"})
    events += text.failed({"id": "resp_1", "status": "failed", "output": [],
                           "error": {"code": "server_error", "message": "engine_error: x"}})
    assert [e["type"] for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                                "response.output_item.done", "response.failed"]
    (item,) = events[-1]["response"]["output"]
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "Hel"


def test_event_sequence_from_chat_deltas():
    """ResponseEvents alone: text pieces become one message item's events, a call's pieces a
    function_call item's, numbered in order, and the final response carries the items streamed."""
    from constrained_spec.server.responses import ResponseEvents

    text = ResponseEvents({"id": "resp_1", "status": "in_progress", "output": []})
    events = text.start() + text.delta({"content": "{\"a\""}) + text.delta({"content": ": 1}"})
    events += text.finish({"id": "resp_1", "status": "completed", "output": []})
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]["output"]
    assert done[0]["type"] == "message" and done[0]["content"][0]["text"] == '{"a": 1}'

    call = ResponseEvents({"id": "resp_2", "status": "in_progress", "output": []})
    first = {"tool_calls": [{"index": 0, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{"}}]}
    events = call.delta(first) + call.delta({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]})
    events += call.finish({"id": "resp_2", "status": "incomplete", "output": []})
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.incomplete"]
    item = events[-1]["response"]["output"][0]
    assert (item["type"], item["call_id"], item["name"], item["arguments"]) == ("function_call", "call_x", "f", "{}")

    empty = ResponseEvents({"id": "resp_3", "status": "in_progress", "output": []})
    events = empty.finish({"id": "resp_3", "status": "completed", "output": []})
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""  # an empty answer is one empty message


def test_logprobs(openai_client):
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: each output token's logprob
    and alternatives, in the output_text part and, streamed, in the deltas (the same tokens)."""
    kw = dict(model=MODEL_ID, input="Name a color.", max_output_tokens=6, temperature=0,
              include=["message.output_text.logprobs"], top_logprobs=2)
    r = openai_client.responses.create(**kw)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert "".join(lp.token for lp in lps) == r.output_text
    # raw events: the SDK's stream helper gives a final response only for `response.completed`, and
    # six tokens may end this one `incomplete` (OpenAI's event for that)
    events = list(openai_client.responses.create(**kw, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete") and final.status == r.status
    assert [lp.token for lp in streamed] == [lp.token for lp in lps]
    assert [lp.token for lp in final.output[0].content[0].logprobs] == [lp.token for lp in lps]

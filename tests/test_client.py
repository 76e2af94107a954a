"""Acceptance 2: the SDK's `parse` returns a validated pydantic instance; the async client streams.
Against the real server with the real SmolLM2."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
from pydantic import BaseModel, Field

from constrained_spec.client import APIError, AsyncClient, ChatCompletion, Client, ParseError
from constrained_spec.client._client import _chat_body, _response_format
from server_fixtures import *  # noqa: F401,F403
from server_fixtures import API_KEY, MODEL_ID


class Book(BaseModel):
    title: str = Field(max_length=40)
    year: int
    genre: str = Field(pattern="^(fantasy|science|history)$")


# -- unit: request building (no server) -----------------------------------------------------------------

def test_response_format_from_model_and_dict():
    rf = _response_format(None, Book, None, True)
    assert rf["type"] == "json_schema" and rf["json_schema"]["name"] == "Book"
    assert rf["json_schema"]["schema"] == Book.model_json_schema() and rf["json_schema"]["strict"] is True
    assert _response_format({"type": "json_object"}, None, None, True) == {"type": "json_object"}
    with pytest.raises(ValueError):
        _response_format({"type": "json_object"}, Book, None, True)


def test_chat_body_string_message_and_extensions():
    body = _chat_body("m", "hi", model=None, system="be brief", stream=True, max_tokens=5, temperature=None,
                      top_p=None, seed=1, stop=None, n=None, frequency_penalty=None, presence_penalty=None,
                      logprobs=None, top_logprobs=None, response_format=None, json_schema=None, schema_name=None,
                      strict=True, regex="a+", ebnf=None, choice=None, include_usage=None,
                      extra_body={"top_k": 5})
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert body["model"] == "m" and body["regex"] == "a+" and body["top_k"] == 5 and body["seed"] == 1
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "temperature" not in body


# -- against the server ------------------------------------------------------------------------------



@pytest.mark.slow
def test_sync_parse_and_chat(server):
    with Client(server.url) as client:
        assert [m.id for m in client.models()] == [MODEL_ID]
        book = client.parse("Describe a fantasy book as JSON.", response_model=Book, max_tokens=80, temperature=0)
        assert isinstance(book, Book) and book.genre in ("fantasy", "science", "history")
        reply = client.chat([{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0)
        assert isinstance(reply, ChatCompletion) and reply.usage.completion_tokens <= 8
        with client.chat("Say hi.", max_tokens=8, temperature=0, stream=True) as stream:
            assert stream.text() == reply.choices[0].message.content
            assert stream.usage.completion_tokens == reply.usage.completion_tokens
        assert client.chat_text("Pick one.", choice=["left", "right"], max_tokens=4) in ("left", "right")
        weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
        called = client.chat("Weather in Paris?", tools=[weather], max_tokens=40, temperature=0,
                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert called.choices[0].finish_reason == "tool_calls"
        assert "city" in json.loads(called.choices[0].message.tool_calls[0].function.arguments)
        done = client.complete("1, 2, 3,", max_tokens=12, temperature=0, regex=r" [0-9]{1,2}, [0-9]{1,2}")
        assert done.choices[0].finish_reason == "stop"
        assert re.fullmatch(r" [0-9]{1,2}, [0-9]{1,2}", done.choices[0].text)


@pytest.mark.slow
def test_sync_errors(server):
    with Client(server.url, model="no-such-model") as client:
        with pytest.raises(APIError) as e:
            client.chat("hi", max_tokens=2)
        assert e.value.status_code == 404 and e.value.code == "model_not_found" and e.value.param == "model"
    with Client(server.url) as client:
        with pytest.raises(APIError) as e:
            client.chat("hi", json_schema={"type": "object", "if": {}})
        assert e.value.status_code == 400 and "'if'" in e.value.message
        with pytest.raises(ParseError) as pe:  # cut off by max_tokens: a clear error, not a broken object
            client.parse("Describe a book.", response_model=Book, max_tokens=3, temperature=0)
        assert pe.value.finish_reason == "length"


@pytest.mark.slow
def test_api_key(secured_server):
    with Client(secured_server.url, api_key=API_KEY) as client:
        assert client.models()[0].id == MODEL_ID
    with Client(secured_server.url, api_key="wrong") as client:
        with pytest.raises(APIError) as e:
            client.models()
        assert e.value.status_code == 401


@pytest.mark.slow
def test_async_stream_and_parse(server):
    async def main():
        async with AsyncClient(server.url + "/v1") as client:
            stream = await client.chat("Count from one to five.", max_tokens=24, temperature=0.5, seed=11,
                                       stream=True)
            pieces = [p async for p in stream.text_deltas()]
            full = await client.chat("Count from one to five.", max_tokens=24, temperature=0.5, seed=11)
            book = await client.parse("Describe a history book as JSON.", response_model=Book, max_tokens=80,
                                      temperature=0)
            # concurrent streams through one client
            streams = await asyncio.gather(*(client.chat(f"Say {w}.", max_tokens=6, stream=True)
                                             for w in ("one", "two", "three")))
            texts = await asyncio.gather(*(s.text() for s in streams))
            return pieces, full, book, texts, stream

    pieces, full, book, texts, stream = asyncio.run(main())
    assert len(pieces) > 1
    assert "".join(pieces) == full.choices[0].message.content
    assert stream.finish_reasons[0] == full.choices[0].finish_reason
    assert isinstance(book, Book)
    assert len(texts) == 3 and all(isinstance(t, str) for t in texts)


@pytest.mark.slow
def test_async_complete_stream(server):
    async def main():
        async with AsyncClient(server.url) as client:
            stream = await client.complete("The sky is", max_tokens=6, temperature=0, stream=True)
            text = await stream.text()
            full = await client.complete("The sky is", max_tokens=6, temperature=0)
            return text, full
    text, full = asyncio.run(main())
    assert text == full.choices[0].text


def test_error_bodies_become_api_errors():
    """An unhealthy /health (503, its `error` a string) raises APIError, not AttributeError; an error
    inside a stream (after the 200) carries the status the same error has unstreamed."""
    import httpx
    from constrained_spec.client._client import _parse_chunk, _raise_for
    unhealthy = httpx.Response(503, json={"status": "unhealthy", "error": "the engine is not running"})
    with pytest.raises(APIError) as e:
        _raise_for(unhealthy)
    assert e.value.status_code == 503 and e.value.message == "the engine is not running"
    for code, kind, status in (("engine_unavailable", "server_error", 503), ("invalid_value", "invalid_request_error", 400),
                               ("server_shutting_down", "server_error", 503),  # (QA 1130 D4: a 500)
                               (None, "server_error", 500)):
        with pytest.raises(APIError) as e:
            _parse_chunk(json.dumps({"error": {"message": "m", "type": kind, "param": None, "code": code}}),
                         ChatCompletion)
        assert e.value.status_code == status and e.value.code == code


def test_health_answers_unhealthy_at_once():
    """A server whose engine is down answers /health 503 {"status": "unhealthy", "error": why}:
    `health()` returns that, once (it raised AttributeError after two retries); other errors raise."""
    import httpx
    calls = []

    def server(request):
        calls.append(request.url.path)
        if request.url.path == "/health":
            return httpx.Response(503, json={"status": "unhealthy", "model": "m", "error": "the engine is not running"})
        return httpx.Response(503, json={"error": {"message": "busy", "type": "server_error", "code": "server_busy"}},
                              headers={"Retry-After": "0"})
    http = httpx.Client(transport=httpx.MockTransport(server), base_url="http://x")
    with Client("http://x", http_client=http, max_retries=2) as client:
        assert client.health() == {"status": "unhealthy", "model": "m", "error": "the engine is not running"}
        assert calls == ["/health"]
        with pytest.raises(APIError) as e:
            client.models()
        assert e.value.status_code == 503 and e.value.code == "server_busy" and len(calls) == 4  # retried twice

    async def main():
        ahttp = httpx.AsyncClient(transport=httpx.MockTransport(server), base_url="http://x")
        async with AsyncClient("http://x", http_client=ahttp) as client:
            return await client.health()
    assert asyncio.run(main())["status"] == "unhealthy"

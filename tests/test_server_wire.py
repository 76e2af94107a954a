"""HTTP-level compatibility with what clients of OpenAI's API expect (QA 1130 wire): CORS preflights
(before the API key, which a browser's preflight never carries), HEAD on the GET routes, a 405's
`Allow`, no redirect for a trailing slash, parameter errors in the error shape, an unsupported body
encoding named, an `x-request-id` on every answer, and Responses fields the openai package requires."""
from __future__ import annotations

import gzip
import json

import httpx
import pytest

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import MODEL_ID

pytestmark = pytest.mark.slow


def test_a_browser_s_preflight_is_answered_before_the_api_key(secured_server):
    r = httpx.options(secured_server.url + "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*", (r.status_code, r.headers)
    r = httpx.get(secured_server.url + "/v1/models", headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"  # the key still needed
    assert r.json()["error"]["type"] == "invalid_request_error"  # OpenAI's 401


def test_http_level_answers(http):
    assert http.head("/health").status_code == 200 and http.head("/v1/models").status_code == 200
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == "method_not_allowed"
    r = http.post("/v1/chat/completions/", json={})  # was a 307 to an absolute http:// URL
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = http.get("/v1/responses/resp_x/input_items?limit=abc")  # was FastAPI's 422 {"detail": [...]}
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text
    body = gzip.compress(json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode())
    r = http.post("/v1/chat/completions", content=body, headers={"Content-Encoding": "gzip",
                                                                 "Content-Type": "application/json"})
    assert r.status_code == 415 and "gzip" in r.json()["error"]["message"], r.text  # was "not valid UTF-8"
    ids = {http.get("/v1/models").headers["x-request-id"] for _ in range(2)}
    assert len(ids) == 2 and all(i.startswith("req_") for i in ids)
    assert http.get("/health", headers={"x-request-id": "mine"}).headers["x-request-id"] == "mine"


def test_responses_carry_what_the_openai_types_require(http):
    r = http.post("/v1/responses", json={"model": MODEL_ID, "input": "hi", "max_output_tokens": 3, "temperature": 0,
                                         "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["input_tokens_details"]["cache_write_tokens"] == 0
    assert body["text"]["format"]["name"] == "response"  # the name it was served under


def test_chat_bodies_and_model_cards_carry_what_openai_sends(http):
    """OpenAI always sends `message.annotations` and `usage.completion_tokens_details`; a model card's
    `created` of 0 showed as 1970 in UIs."""
    r = http.post("/v1/chat/completions", json={"model": MODEL_ID, "max_tokens": 2, "temperature": 0,
                                                "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["annotations"] == []
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert http.get("/v1/models").json()["data"][0]["created"] > 1_700_000_000

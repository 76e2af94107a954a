"""Acceptance 4: 50 concurrent requests (several schemas, plain, streaming, regex/choice) all finish with
valid output; a client that disconnects mid-stream (or mid non-streaming request) is aborted and the
KV pool is full again afterwards."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import jsonschema
import pytest

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import MODEL_ID, break_off, chat_body, engine_state, give_up_on, wait_kv_full

pytestmark = pytest.mark.slow

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"mood": {"type": "string", "enum": ["happy", "sad", "calm"]},
                                      "score": {"type": "number"}, "tags": {"type": "array", "maxItems": 2,
                                                                            "items": {"type": "string",
                                                                                      "maxLength": 8}}},
     "required": ["mood", "score", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "id": {"type": "integer"}},
     "required": ["ok", "id"], "additionalProperties": False},
]


def _schema_req(i: int) -> tuple[dict, callable]:
    schema = SCHEMAS[i % len(SCHEMAS)]
    # greedy: sampled JSON from a 135M model can loop on whitespace until max_tokens (see report)
    body = chat_body(f"Reply with JSON (request {i}).", max_tokens=80, temperature=0, seed=i,
                     response_format={"type": "json_schema", "json_schema": {"name": f"s{i % 3}", "schema": schema}})

    def check(text, finish):
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), schema)
    return body, check


def _plain_req(i: int):
    body = chat_body(f"Say something about the number {i}.", max_tokens=24, temperature=0.8, seed=i)

    def check(text, finish):
        assert finish in ("stop", "length") and isinstance(text, str)
    return body, check


def _regex_req(i: int):
    if i % 2:
        body = chat_body("Pick a fruit.", max_tokens=16, choice=["apple", "pear", "plum"], seed=i)
        return body, lambda t, f: (assert_(f == "stop" and t in ("apple", "pear", "plum"), t))
    body = chat_body("Give a time.", max_tokens=16, regex=r"[0-2][0-9]:[0-5][0-9]", seed=i)
    return body, lambda t, f: assert_(f == "stop" and re.fullmatch(r"[0-2][0-9]:[0-5][0-9]", t), t)


def assert_(cond, msg=""):
    assert cond, msg


async def _one(client: httpx.AsyncClient, body: dict, stream: bool):
    if not stream:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["message"]["content"], c["finish_reason"]
    pieces, finish = [], None
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                pieces.append(c["delta"].get("content") or "")
                finish = c["finish_reason"] or finish
        assert done
    return "".join(pieces), finish


def test_fifty_concurrent_mixed(server):
    jobs = []
    for i in range(50):
        kind = i % 4
        body, check = (_schema_req, _plain_req, _regex_req, _schema_req)[kind](i)
        stream = i % 3 == 0  # streaming mixed into every kind
        jobs.append((body, check, stream))

    async def main():
        limits = httpx.Limits(max_connections=60, max_keepalive_connections=60)
        async with httpx.AsyncClient(base_url=server.url, timeout=240, limits=limits) as client:
            return await asyncio.gather(*(_one(client, b, s) for b, _, s in jobs))

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    for (body, check, stream), (text, finish) in zip(jobs, results):
        check(text, finish)
    wait_kv_full(server)
    print(f"50 concurrent requests in {elapsed:.1f} s")


def test_disconnect_mid_stream_frees_kv(server):
    wait_kv_full(server)
    body = chat_body("Tell me a very long story about the sea.", max_tokens=2000, ignore_eos=True, stream=True)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            n = 0
            for line in lines:
                if line.startswith("data: "):
                    n += 1
                if n >= 6:
                    break
            h = engine_state(server)
            assert h["kv_free_slots"] < h["kv_capacity"]  # it holds KV now
            assert h["requests_running"] >= 1
        # leaving the block closes the connection mid-stream
    wait_kv_full(server, timeout=10)


def test_disconnect_non_streaming_frees_kv(server):
    wait_kv_full(server)
    body = chat_body("Tell me a very long story about a forest.", max_tokens=2000, ignore_eos=True)
    give_up_on(server, "/v1/chat/completions", body)


def test_openai_stream_break_frees_kv(openai_client, server):
    stream = openai_client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Write an endless poem."}], max_tokens=2000,
        stream=True, extra_body={"ignore_eos": True})
    break_off(stream, server, after=5)


def test_single_process_server_disconnect_frees_kv(single_server):
    wait_kv_full(single_server)
    body = chat_body("Tell me a very long story about the sea.", max_tokens=2000, ignore_eos=True, stream=True)
    with httpx.Client(base_url=single_server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: dropping the iterator would close the connection
            for i, _ in enumerate(lines):
                if i >= 6:
                    break
            h = engine_state(single_server)
            assert h["requests_running"] >= 1, h
    wait_kv_full(single_server, timeout=10)

"""Acceptance 3: every error case answers its status with an OpenAI-shaped body, and the server keeps
serving; a bad schema does not disturb a concurrent good request. Also auth, body limit and 503."""
from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import pytest

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import API_KEY, MODEL_ID, chat_body, wait_kv_full

pytestmark = pytest.mark.slow

GOOD_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
               "required": ["ok", "n"], "additionalProperties": False}


def assert_error(resp: httpx.Response, status: int, param=..., code=None) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not ...:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def schema_body(schema) -> dict:
    return chat_body("Give JSON.", response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                          "schema": schema}})


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b'"text"'])
def test_malformed_json_body(http, content):
    assert_error(http.post("/v1/chat/completions", content=content,
                           headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL_ID}, "messages"),
    ({"model": MODEL_ID, "messages": []}, "messages"),
    ({"model": MODEL_ID, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    (chat_body(temperature=7), "temperature"),
    (chat_body(max_tokens=0), "max_tokens"),
    (chat_body(top_logprobs=50, logprobs=True), "top_logprobs"),
    (chat_body(response_format={"type": "yaml"}), None),
    (chat_body(regex="[a-z]+", grammar_backend="outlines"), "grammar_backend"),
    (chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), None),
    (chat_body(logit_bias={"hello": 1}), "logit_bias"),
    (chat_body(logit_bias={"-3": 1}), "logit_bias"),
    (chat_body(logit_bias={"99999999": 1}), "logit_bias"),
    (chat_body(logit_bias={"12": 250}), "logit_bias"),
    (chat_body(logit_bias={"12": "a lot"}), "logit_bias.12"),
    (chat_body(functions=[{"name": "f", "parameters": {"type": "object"}}]), "functions"),
    (chat_body(function_call={"name": "f"}), "function_call"),
])
def test_invalid_fields(http, body, param):
    err = assert_error(http.post("/v1/chat/completions", json=body), 400)
    if param is not None:
        assert err["param"] == param, err


def test_unknown_model_404(http):
    assert_error(http.post("/v1/chat/completions", json=chat_body(model="gpt-17")), 404, param="model",
                 code="model_not_found")
    assert_error(http.post("/v1/completions", json={"model": "gpt-17", "prompt": "hi"}), 404, param="model")
    assert_error(http.get("/v1/models/gpt-17"), 404)
    assert_error(http.get("/v1/nothing-here"), 404)


def test_the_model_s_other_names_are_served(http):
    """A registry model's HF id and its GGUF file's name, in any case: a client set up with the string
    the server was started with (`--model Qwen/Qwen2.5-Coder-0.5B-Instruct`) got a 404 on every call
    (QA 1130c Qwen F2). (This server serves a folder, as `smollm2`: its names in another case.)"""
    from constrained_spec.models.registry import names_of
    assert names_of("Qwen/Qwen2.5-Coder-0.5B-Instruct") == names_of("qwen2.5-coder-0.5b") == {
        "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct", "qwen/qwen2.5-coder-0.5b-instruct"}
    assert "smollm2-135m-instruct.q4_1" in names_of("smollm2-135m") and names_of("./my-model") == set()
    for name in ("SmolLM2", " smollm2"):
        r = http.post("/v1/chat/completions", json=chat_body(model=name, max_tokens=1))
        assert r.status_code == 200, (name, r.text)
        assert http.get(f"/v1/models/{name.strip()}").status_code == 200, name


def test_unsupported_schema_names_keyword_and_path(http):
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}},
                                                     "if": {"required": ["b"]}, "then": {}}}}
    err = assert_error(http.post("/v1/chat/completions", json=schema_body(schema)), 400,
                       param="response_format.json_schema.schema")
    assert "'if'" in err["message"] and "/properties/a" in err["message"], err
    assert err["code"] in ("unsupported_schema", "invalid_schema")


@pytest.mark.parametrize("schema", [{"type": "strng"}, {"type": "object", "required": "a"},
                                    {"properties": {"x": {"type": "integer", "minimum": "zero"}}},
                                    {"$ref": "#"},  # accepts no value: was a 500 from the engine
                                    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}])
def test_invalid_schema(http, schema):
    assert_error(http.post("/v1/chat/completions", json=schema_body(schema)), 400)


def nested(levels: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_schema_nesting_limit(http):
    """Past MAX_SCHEMA_DEPTH a 400 naming the limit (1,000 levels was a 500: a RecursionError); just
    below it, served. The deep body is written as text: Python's json cannot encode it."""
    deep = '{"type":"object","properties":{"a":' * 500 + '{"type":"integer"}' + '}}' * 500
    body = json.dumps(schema_body({"$PLACEHOLDER": 1})).replace('{"$PLACEHOLDER": 1}', deep)
    err = assert_error(http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}),
                       400, param="response_format.json_schema.schema")
    assert "nests more than 256 levels" in err["message"]
    assert http.post("/v1/chat/completions", json=schema_body(nested(127))).status_code == 200
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("extra", [{"regex": "(unclosed"}, {"ebnf": "root ::= undefined_rule"}, {"choice": []},
                                   {"regex": "a+", "choice": ["a"]},
                                   {"regex": "a[^\\x00-\\U0010FFFF]"},  # no string: was a 500 under llguidance
                                   {"ebnf": "root ::= a\na ::= a"}])
def test_bad_other_constraints(http, extra):
    assert_error(http.post("/v1/chat/completions", json=chat_body(**extra)), 400)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}}}},
     "response_format.json_schema.schema"),
    ({"ebnf": 'root ::= "a" root'}, "ebnf"),
])
def test_a_grammar_that_accepts_no_finite_string_is_a_400(http, extra, param):
    """It was served: the answer ran to max_tokens ("length"), never a complete value."""
    err = assert_error(http.post("/v1/chat/completions", json=chat_body(**extra)), 400, param=param)
    assert "accepts no finite string" in err["message"], err


def test_boolean_schemas_true_is_any_json_value_false_a_400(http):
    """`true` was a 400 (the request model wanted an object)."""
    resp = http.post("/v1/chat/completions", json={**schema_body(True), "max_tokens": 48})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        json.loads(choice["message"]["content"])
    err = assert_error(http.post("/v1/chat/completions", json=schema_body(False)), 400,
                       param="response_format.json_schema.schema")
    assert "false accepts no JSON value" in err["message"]


def test_prompt_longer_than_context(http, engine_info):
    long = "word " * (engine_info.max_context + 100)
    assert_error(http.post("/v1/chat/completions", json=chat_body(long)), 400, code="context_length_exceeded")
    assert_error(http.post("/v1/completions", json={"model": MODEL_ID, "prompt": long}), 400,
                 code="context_length_exceeded")


def test_bad_schema_does_not_disturb_concurrent_good_request(server):
    result = {}

    def good():
        with httpx.Client(base_url=server.url, timeout=120) as c:
            result["resp"] = c.post("/v1/chat/completions", json={
                **schema_body(GOOD_SCHEMA), "max_tokens": 48, "temperature": 0})

    t = threading.Thread(target=good)
    t.start()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for _ in range(5):
            assert_error(c.post("/v1/chat/completions", json=schema_body({"type": "object", "if": {}})), 400)
            assert_error(c.post("/v1/chat/completions", content=b"{oops"), 400)
    t.join(120)
    resp = result["resp"]
    assert resp.status_code == 200, resp.text
    jsonschema.validate(json.loads(resp.json()["choices"][0]["message"]["content"]), GOOD_SCHEMA)
    wait_kv_full(server)


def test_auth(secured_server):
    url = secured_server.url
    assert_error(httpx.post(url + "/v1/chat/completions", json=chat_body()), 401)
    assert_error(httpx.post(url + "/v1/chat/completions", json=chat_body(),
                            headers={"Authorization": "Bearer wrong"}), 401, code="invalid_api_key")
    assert_error(httpx.get(url + "/v1/models"), 401)
    assert httpx.get(url + "/health").status_code == 200  # health stays open for probes
    ok = httpx.post(url + "/v1/chat/completions", json=chat_body(max_tokens=4),
                    headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_openai_client_auth(secured_server):
    import openai
    bad = openai.OpenAI(base_url=secured_server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=secured_server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.models.list().data[0].id == MODEL_ID


def test_body_size_limit(secured_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    big = chat_body("x" * 10_000)
    assert_error(httpx.post(secured_server.url + "/v1/chat/completions", json=big, headers=headers), 413,
                 code="request_too_large")

    def chunked():  # no Content-Length: the limit still holds while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]
    assert_error(httpx.post(secured_server.url + "/v1/chat/completions", content=chunked(),
                            headers={**headers, "content-type": "application/json"}), 413)


def test_busy_503_with_retry_after(busy_server):
    with httpx.Client(base_url=busy_server.url, timeout=60) as c:
        body = chat_body("Tell me a long story.", max_tokens=400, stream=True, ignore_eos=True)
        with c.stream("POST", "/v1/chat/completions", json=body) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # keep the iterator: dropping it would close the connection
            next(lines)  # the stream holds the one admission slot now
            assert c.get("/health").json()["pending_requests"] == 1
            err = assert_error(c.post("/v1/chat/completions", json=chat_body()), 503, code="server_busy")
            assert "retry" in err["message"]
            second = c.post("/v1/chat/completions", json=chat_body())
            assert second.headers.get("retry-after") == "2"
            # refused before its prompt and grammar work: its grammar is never compiled (QA 1130b soak D2)
            compiles = _metric(c, "constrained_spec_grammar_compiles_total")
            unseen = {"type": "object", "properties": {"refused_before_compiling": {"type": "integer"}}}
            for route, extra in (("/v1/chat/completions", {}), ("/v1/completions", {"prompt": "x"})):
                assert_error(c.post(route, json={**schema_body(unseen), **extra}), 503, code="server_busy")
            assert _metric(c, "constrained_spec_grammar_compiles_total") == compiles
        wait_kv_full(busy_server)
        ok = c.post("/v1/chat/completions", json=chat_body(max_tokens=4))
        assert ok.status_code == 200, ok.text


def test_a_grammar_that_waited_too_long_to_compile_is_a_503_with_retry_after(server):
    """The compile queue's GrammarBusy for a grammar that waited past twice the compile timeout for
    a thread (behind overrunning compiles) comes through the up-front compile's future: a 503 the
    client retries, as a full queue is, not a 400 and not a 500."""
    from concurrent.futures import Future
    from constrained_spec.grammar import GrammarBusy
    grammar = server.engine.grammar
    compile_async = grammar.compile_async

    def busy(spec, check_only=True):
        f = Future()
        f.set_exception(GrammarBusy("the grammar waited 60s for a compile thread behind slower compiles; retry later"))
        return f
    grammar.compile_async = busy
    try:
        schema = {"type": "object", "properties": {"waited_too_long": {"type": "boolean"}}}
        resp = httpx.post(server.url + "/v1/chat/completions", json=schema_body(schema), timeout=60)
        err = assert_error(resp, 503, code="server_busy")
        assert "waited 60s" in err["message"] and resp.headers.get("retry-after") == "1"
    finally:
        grammar.compile_async = compile_async


def test_a_client_gone_before_its_body_is_no_server_error(server, http, caplog):
    """A client that closes its connection halfway through sending its body is not an error of the
    server's: no 'unhandled error' traceback (there was one, twice, per such client), and the
    server goes on serving."""
    import logging
    import socket
    from urllib.parse import urlparse
    url = urlparse(server.url)
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            with socket.create_connection((url.hostname, url.port), timeout=5) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 5000\r\n\r\n" + b'{"model": "smollm2", "messages": [')
        time.sleep(0.5)
        r = http.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert not errors, [rec.getMessage() for rec in errors]


def test_still_serving_after_errors(http):
    assert http.get("/health").json()["status"] == "ok"
    r = http.post("/v1/chat/completions", json=chat_body(max_tokens=4))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_grammar_checked_once_per_front_end(server):
    """A grammar seen to compile skips the up-front check afterwards (no trip to the engine process);
    one that fails is checked, and refused, every time."""
    grammar = server.engine.grammar
    asked = []
    compile_async = grammar.compile_async

    def counting(spec, check_only=True):
        asked.append(spec.kind)
        return compile_async(spec, check_only=check_only)
    grammar.compile_async = counting
    try:
        schema = {"type": "object", "properties": {"checked_once": {"type": "boolean"}}, "required": ["checked_once"]}
        with httpx.Client(base_url=server.url, timeout=120) as c:
            for _ in range(3):
                resp = c.post("/v1/chat/completions", json={**schema_body(schema), "max_tokens": 16, "temperature": 0})
                assert resp.status_code == 200, resp.text
            assert asked == ["json_schema"]
            for _ in range(2):
                assert_error(c.post("/v1/chat/completions", json=schema_body({"type": "strng"})), 400)
        assert asked == ["json_schema"] * 3
    finally:
        grammar.compile_async = compile_async


def test_checked_grammars_bounded_by_size():
    from constrained_spec.grammar import GrammarSpec
    from constrained_spec.server.constraints import CheckedGrammars
    checked = CheckedGrammars(max_chars=100)
    specs = [GrammarSpec.regex(f"{i}" * 40) for i in range(1, 5)]
    for spec in specs[:2]:
        checked.add(spec)
    assert specs[0] in checked  # now the most recently used
    checked.add(specs[2])  # 120 characters: the least recently used goes
    assert specs[1] not in checked and specs[0] in checked and specs[2] in checked
    checked.add(GrammarSpec.regex("x" * 500))  # alone over the bound: nothing stays
    assert not any(s in checked for s in specs)


def _metric(client, name: str) -> float:
    line = next(ln for ln in client.get("/metrics").text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[-1])

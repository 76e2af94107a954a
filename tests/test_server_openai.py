"""Acceptance 1: the official `openai` package, unchanged, against a real uvicorn server with the real
SmolLM2: json_schema output validates, streaming reassembles to the non-streaming text, and
`chat.completions.parse` returns a parsed pydantic object. Plus the other constraint kinds,
/v1/completions, logprobs, n, finish reasons, usage, /v1/models, /health and /metrics."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
from pydantic import BaseModel

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import MODEL_ID

# a dev dependency: a GPU host that installed the project without its extras collects the others
openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install -e '.[dev]')")

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["engineer", "doctor", "artist"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


class Pet(BaseModel):
    name: str
    species: str
    legs: int


def test_models_health(openai_client, http):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    h = http.get("/health").json()
    assert h["status"] == "ok" and h["kv_capacity"] > 0


def _compiles_by_backend(http) -> dict:
    lines = [ln for ln in http.get("/metrics").text.splitlines()
             if ln.startswith("constrained_spec_grammar_compiles_by_backend_total{")]
    return {ln.split('"')[1]: float(ln.split()[-1]) for ln in lines}


@pytest.mark.parametrize("grammar_backend", [None, "xgrammar", "llguidance"])
def test_json_schema_output_validates(openai_client, http, grammar_backend):
    # a schema no other test compiles, so that this request's compile shows in /metrics
    schema = {**PERSON, "properties": {**PERSON["properties"], f"probe_{grammar_backend}": {"type": "boolean"}}}
    before = _compiles_by_backend(http)
    r = openai_client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=80,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": schema, "strict": True}},
        extra_body={} if grammar_backend is None else {"grammar_backend": grammar_backend})
    # compiled by the backend asked for (the server default, auto, takes llguidance for a schema's first request)
    after = _compiles_by_backend(http)
    served_by = grammar_backend or "llguidance"
    delta = {b: after.get(b, 0) - before.get(b, 0) for b in ("xgrammar", "llguidance")}
    assert delta[served_by] == 1, delta
    # (auto may compile an earlier test's repeated schema with xgrammar in the background meanwhile)
    assert served_by == "llguidance" or delta["llguidance"] == 0, delta
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)
    assert r.usage.prompt_tokens > 5 and r.usage.completion_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "chat.completion" and r.model == MODEL_ID


def test_stream_reassembles_to_non_stream(openai_client):
    kw = dict(model=MODEL_ID, messages=[{"role": "system", "content": "You are a poet."},
                                        {"role": "user", "content": [{"type": "text", "text": "A line about rain."}]}],
              max_tokens=40, temperature=0.8, top_p=0.95, seed=1234)
    full = openai_client.chat.completions.create(**kw)
    stream = openai_client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    assert roles == ["assistant"]
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_parse_returns_pydantic_object(openai_client):
    r = openai_client.chat.completions.parse(
        model=MODEL_ID, messages=[{"role": "user", "content": "Describe a pet as JSON with name, species, legs."}],
        response_format=Pet, max_tokens=80, temperature=0)
    msg = r.choices[0].message
    assert isinstance(msg.parsed, Pet), msg.content
    assert msg.parsed.legs >= 0 or msg.parsed.legs < 0  # an int


def test_stream_helper_parses(openai_client):
    """`chat.completions.stream` (the SDK's streaming parse helper) accumulates our chunks into the
    non-streamed parse's object (one grammar backend: `auto` may switch a repeated grammar's)."""
    kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Describe a pet as JSON."}], response_format=Pet,
              max_tokens=80, temperature=0, extra_body={"grammar_backend": "xgrammar"})
    parsed = openai_client.chat.completions.parse(**kw).choices[0].message
    with openai_client.chat.completions.stream(**kw) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion().choices[0].message
    assert {"content.delta", "content.done", "chunk"} <= kinds
    assert final.content == parsed.content and final.parsed == parsed.parsed and isinstance(final.parsed, Pet)


@pytest.mark.parametrize("extra, check", [
    ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"ebnf": 'root ::= "The answer is " ("red" | "blue") "."'}, lambda t: t in ("The answer is red.",
                                                                                "The answer is blue.")),
    # vLLM's current spelling (answered unconstrained while it was an unknown field)
    ({"structured_outputs": {"json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                      "required": ["ok"]}}},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
    ({"structured_outputs": {"regex": "[0-9]{2}"}}, lambda t: re.fullmatch("[0-9]{2}", t)),
])
def test_extension_constraints(openai_client, extra, check):
    r = openai_client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Answer briefly: is the sky blue?"}], max_tokens=24,
        temperature=0.7, seed=3, extra_body=extra)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert check(text), text


def test_json_object(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Give me a JSON object about a city."}], max_tokens=64,
        temperature=0, response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.finish_reason == "length" and c.message.content.lstrip().startswith("{")


def test_finish_reason_length_and_usage(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        max_completion_tokens=6, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6


def test_stop_string(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Count from 1 to 10 separated by commas."}],
        max_tokens=48, temperature=0, stop=["5"])
    assert r.choices[0].finish_reason == "stop"
    assert "5" not in r.choices[0].message.content


def test_n_and_logprobs(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8, temperature=1.0,
        seed=7, n=2, logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert content and all(len(t.top_logprobs) == 3 for t in content)
        assert all(t.logprob <= 0.0 for t in content)
        assert "".join(t.token for t in content) == c.message.content
    # the EOS that ends a "stop" answer counts as generated but is no token of its content
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) + (c.finish_reason == "stop") for c in r.choices)


def test_logprobs_leave_out_the_stop_token(openai_client):
    """The tokens listed in logprobs join to the answer (OpenAI lists no end token), streamed or not,
    with a grammar or without; usage still counts the EOS the model generated."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    for fmt in (None, {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}):
        kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": "What is 2+2? One word."}], max_tokens=48,
                  temperature=0, logprobs=True, **({"response_format": fmt} if fmt else {}))
        r = openai_client.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.finish_reason == "stop"
        assert "".join(t.token for t in c.logprobs.content) == c.message.content
        assert r.usage.completion_tokens == len(c.logprobs.content) + 1
        tokens, text = [], ""
        for ev in openai_client.chat.completions.create(stream=True, **kw):
            if ev.choices:
                text += ev.choices[0].delta.content or ""
                tokens += [t.token for t in (ev.choices[0].logprobs.content if ev.choices[0].logprobs else [])]
        assert text == c.message.content and "".join(tokens) == text
    done = openai_client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=40,
                                            temperature=0, logprobs=1)
    assert done.choices[0].finish_reason == "stop"
    assert "".join(done.choices[0].logprobs.tokens) == done.choices[0].text


def test_logprobs_leave_out_a_stop_strings_tokens(openai_client, server_engine):
    """A stop string is no part of the answer, and neither are its tokens: the listed tokens join to
    the content, streamed or not, through the engine process (the front-end finds the stop) and the
    in-process engine (the engine does). They listed the stop string's tokens: content "1. 1\n2. 2"
    came with tokens joining to "1. 1\n2. 2\n3"."""
    from constrained_spec import SamplingParams
    messages = [{"role": "user", "content": "Count from 1 to 20 separated by commas."}]
    kw = dict(model=MODEL_ID, messages=messages, max_tokens=40, temperature=0, logprobs=True)
    plain = openai_client.chat.completions.create(**kw).choices[0].message.content
    stops = [s for s in ("\n3", "3\n4", "\n4\n") if s in plain]
    assert stops, plain
    for stop in stops:
        c = openai_client.chat.completions.create(stop=stop, **kw).choices[0]
        assert c.finish_reason == "stop" and c.message.content == plain[:plain.find(stop)]
        assert "".join(t.token for t in c.logprobs.content) == c.message.content, stop
        tokens, text = [], ""
        for ev in openai_client.chat.completions.create(stream=True, stop=stop, **kw):
            if ev.choices:
                text += ev.choices[0].delta.content or ""
                tokens += [t.token for t in (ev.choices[0].logprobs.content if ev.choices[0].logprobs else [])]
        assert text == c.message.content and "".join(tokens) == text, stop
    done = openai_client.completions.create(model=MODEL_ID, prompt="1, 2, 3, 4, 5,", max_tokens=16, temperature=0,
                                            logprobs=1, stop=", 8")
    assert done.choices[0].finish_reason == "stop" and done.choices[0].text.endswith("7")
    assert "".join(done.choices[0].logprobs.tokens) == done.choices[0].text

    prompt = server_engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    params = SamplingParams(max_tokens=40, temperature=0, logprobs=0, stop=[stops[0]])
    whole = server_engine.generate(prompt, params)[0]
    updates = []
    server_engine.add_request(prompt, params, on_output=updates.append)
    while not (updates and updates[-1].finished):
        time.sleep(0.01)
    for text, ids in ((whole.text, whole.token_ids), ("".join(u.new_text for u in updates),
                                                       [i for u in updates for i in u.new_token_ids])):
        assert text == plain[:plain.find(stops[0])]
        assert server_engine.tokenizer.decode(ids) == text
    assert len(whole.logprobs) == len(whole.token_ids)


def test_logit_bias(openai_client, engine_info):
    """logit_bias as the openai package sends it (token ids as string keys): +100 forces a token,
    -100 keeps the greedy answer's first tokens out; top_p 0 keeps the most likely token (greedy)."""
    ask = lambda **kw: openai_client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6, temperature=0, **kw)
    greedy = ask()
    banana = engine_info.tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert ask(logit_bias={str(banana): 100}).choices[0].message.content == " banana" * 6
    first = engine_info.tokenizer.encode(greedy.choices[0].message.content, add_special_tokens=False)[:2]
    banned = ask(logit_bias={str(t): -100 for t in first}).choices[0].message.content
    assert not set(engine_info.tokenizer.encode(banned, add_special_tokens=False)) & set(first)
    sampled = openai_client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6, temperature=1.0,
        top_p=0.0, seed=11)
    assert sampled.choices[0].message.content == greedy.choices[0].message.content


def test_predicted_output(openai_client):
    """`prediction` (OpenAI's Predicted Outputs) is taken, as a string or text parts, and changes no
    greedy answer (this server does not speculate; tests/test_speculative.py shows the drafting)."""
    ask = lambda **kw: openai_client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8, temperature=0,
        **kw).choices[0].message.content
    plain = ask()
    assert ask(prediction={"type": "content", "content": plain}) == plain
    assert ask(prediction={"type": "content", "content": [{"type": "text", "text": "an apple"}]}) == plain
    with pytest.raises(openai.BadRequestError):
        ask(prediction={"type": "audio", "content": "x"})


def test_completions_endpoint(openai_client, engine_info):
    r = openai_client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=5,
                                         temperature=0, logprobs=2)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length") and c.text
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == r.usage.completion_tokens
    ids = engine_info.tokenizer.encode("The capital of France is", add_special_tokens=False)
    r2 = openai_client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=5, temperature=0)
    assert r2.choices[0].text == c.text
    r3 = openai_client.completions.create(model=MODEL_ID, prompt="Answer yes or no:", max_tokens=4,
                                          extra_body={"choice": ["yes", "no"]})
    assert r3.choices[0].text in ("yes", "no")
    pieces = [ch.choices[0].text for ch in openai_client.completions.create(
        model=MODEL_ID, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True) if ch.choices]
    assert "".join(pieces) == c.text
    with pytest.raises(openai.BadRequestError, match="best_of"):
        openai_client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2, best_of=3)


def test_cached_tokens_in_usage(openai_client, http):
    """A prompt that starts like an earlier one reports the cached part in
    usage.prompt_tokens_details.cached_tokens (non-streamed and streamed), and /metrics counts it."""
    system = {"role": "system", "content": "You answer in one short sentence about geography. " * 8}
    ask = lambda q, **kw: openai_client.chat.completions.create(
        model=MODEL_ID, messages=[system, {"role": "user", "content": q}], max_tokens=3, temperature=0, **kw)
    first = ask("Where is Lima?")
    second = ask("Where is Oslo?")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 60 < cached < second.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens <= cached
    chunks = list(ask("Where is Quito?", stream=True, stream_options={"include_usage": True}))
    usage = [c.usage for c in chunks if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens >= cached
    # an answer a stop string ends (the split server's front-end finds it, on a step's streamed
    # token, which carries no cache count: it reported 0)
    stopped = openai_client.chat.completions.create(
        model=MODEL_ID, messages=[system, {"role": "user", "content": "Where is Bern?"}], max_tokens=24,
        temperature=0, stop=["."], stream=True, stream_options={"include_usage": True})
    chunks = list(stopped)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    stopped = [c for c in chunks if c.usage is not None][-1]
    assert 1 < stopped.usage.completion_tokens < 24, stopped.usage
    assert stopped.usage.prompt_tokens_details.cached_tokens >= cached
    text = http.get("/metrics").text
    hits = re.search(r"^constrained_spec_prefix_cache_hit_tokens_total (\S+)$", text, re.M)
    assert hits and float(hits.group(1)) >= 2 * cached
    for name in ("constrained_spec_prefix_cache_hit_rate", "constrained_spec_prefix_cache_evicted_tokens_total",
                 "constrained_spec_prefix_cache_tokens "):
        assert name in text, name


def test_metrics(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL_ID, "max_tokens": 4,
                                                "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    text = http.get("/metrics").text
    for name in ("constrained_spec_http_requests_total", "constrained_spec_prompt_tokens_total",
                 "constrained_spec_completion_tokens_total", "constrained_spec_time_to_first_token_seconds_bucket",
                 "constrained_spec_time_per_output_token_seconds_bucket", "constrained_spec_requests_running",
                 "constrained_spec_requests_waiting", "constrained_spec_kv_usage_ratio",
                 "constrained_spec_grammar_compile_seconds_total", "constrained_spec_grammar_cache_hits_total"):
        assert name in text, name
    assert re.search(r'constrained_spec_http_requests_total\{endpoint="/v1/chat/completions",status="200"\} \d', text)
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("constrained_spec_engine_") and " " in line}
    # the engine's part of TTFT, split at admission: some time after admission, none negative
    assert values["constrained_spec_engine_first_tokens_total"] >= 1, values
    assert values["constrained_spec_engine_prefill_seconds_total"] > 0, values
    assert values["constrained_spec_engine_queue_seconds_total"] >= 0, values
    assert values["constrained_spec_engine_device_wait_seconds_total"] >= 0, values


@pytest.mark.parametrize("extra", [
    {"max_tokens": 24},
    {"max_tokens": 48, "stop": ["5", "\n\n"], "logprobs": True, "top_logprobs": 2},
    {"max_tokens": 80, "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
])
def test_single_process_server_answers_the_same(server, single_server, extra):
    """`serve --single-process` (the engine detokenizes in its own thread) and the split server (the
    front-end detokenizes and finds stop strings) give the same greedy answer, streamed or not."""
    import httpx

    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Count from 1 to 10 and describe a person."}],
            "temperature": 0, **extra}
    answers = []
    for srv in (server, single_server):
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        usage = r.json()["usage"]
        usage.pop("prompt_tokens_details")  # the two engines' prefix caches saw different requests before
        answers.append((c["message"]["content"], c["finish_reason"], usage, _split_floats(c["logprobs"])))
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
        assert text == c["message"]["content"]
    # the same tokens and logprobs up to float32 rounding: an engine whose prefix cache held more of
    # the prompt computed the rest in a smaller extend (other GEMM shapes, other last bits)
    assert answers[0][:3] == answers[1][:3]
    assert answers[0][3][0] == answers[1][3][0]
    assert answers[0][3][1] == pytest.approx(answers[1][3][1], abs=1e-4)


def _split_floats(tree):
    """(the structure with every float replaced by None, the floats in order)."""
    floats = []

    def walk(x):
        if isinstance(x, float):
            floats.append(x)
            return None
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x
    return walk(tree), floats

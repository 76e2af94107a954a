"""A request's grammar that fails in the engine (not at the server's up-front check: that one passed,
or was skipped for a grammar the front-end saw compile before, since evicted from the engine's
cache) is answered as the same failure up front is: busy in the compile queue, 503 with
Retry-After; refused, 400 naming the field. Streamed: the same status while nothing was sent, an
error event with that code after. And a client that leaves while its grammar waits in the compile
queue leaves no waiter there (in the engine process too), so the job leaves the queue as nobody's. Both servers: the single process (the app over an in-process
Engine) and the split one, whose engine process is here an `EngineServer` in this process over
the same Engine (so that its grammar backend can be made to fail), behind a real `EngineClient`.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from concurrent.futures import Future

import httpx
import pytest

from constrained_spec.engine import Engine, EngineConfig
from constrained_spec.grammar import GrammarBusy, GrammarError, GrammarSpec
from constrained_spec.server.app import ServerConfig, create_app
from constrained_spec.server.engine_client import EngineClient
from constrained_spec.server.engine_process import EngineInfo, EngineServer
from constrained_spec.server.runner import start_server_thread

MODEL = "tiny"
BUSY = "the grammar waited 60s for a compile thread behind slower compiles (2 x the 30s compile timeout); retry later"


class Servers:
    def __init__(self, engine, single, split, client, engine_server):
        self.engine, self.single, self.split, self.client, self.engine_server = (engine, single, split, client,
                                                                                 engine_server)

    def url(self, which: str) -> str:
        return (self.single if which == "single" else self.split).url


@pytest.fixture(scope="module")
def servers(tiny_llama_dir):
    # one compile worker (two threads), and a compile timeout that puts the queue's deadline
    # (2 x the timeout) within a test's time
    engine = Engine(EngineConfig(model=tiny_llama_dir, device="cpu", dtype="float32", grammar_cache_dir="none",
                                 max_running_requests=8, grammar_threads=1, grammar_compile_timeout_s=3.0))
    address = os.path.join(tempfile.mkdtemp(prefix="cs-test-"), "engine.sock")
    engine_server = EngineServer(engine, address)
    runner = engine.runner
    engine_server.info = EngineInfo(
        address=address, pid=os.getpid(), model_name=engine.model_name, tokenizer=engine.tokenizer,
        max_context=int(engine.max_context), kv_capacity=int(runner.pool.capacity),
        max_running_requests=engine.config.max_running_requests,
        max_queued_requests=engine.config.max_queued_requests, device=str(engine.device), dtype="float32")
    client = EngineClient(engine_server.info)
    single = start_server_thread(create_app(engine, ServerConfig(served_model_name=MODEL)))
    split = start_server_thread(create_app(client, ServerConfig(served_model_name=MODEL)))
    yield Servers(engine, single, split, client, engine_server)
    split.stop()
    single.stop()
    client.shutdown()
    engine_server.close()
    engine.shutdown()


class RequestCompiles:
    """The engine's grammar backend with each request's own compile (not the up-front check) answered
    by `fail(n)` (n counts those compiles from 0): a Future, an exception to raise, or None for the
    real compile."""

    def __init__(self, engine, fail):
        self.grammar, self.fail, self.n = engine.grammar, fail, 0

    def __enter__(self):
        real = self.real = self.grammar.compile_async

        def compile_async(spec, timeout_s=None, check_only=False):
            if check_only:
                return real(spec, timeout_s, check_only=True)
            answer, self.n = self.fail(self.n), self.n + 1
            if answer is None:
                return real(spec, timeout_s)
            if isinstance(answer, BaseException):
                raise answer
            return answer
        self.grammar.compile_async = compile_async
        return self

    def __exit__(self, *exc):
        self.grammar.compile_async = self.real


def failed(exc: BaseException) -> Future:
    f = Future()
    f.set_exception(exc)
    return f


def body(schema: dict, **kw) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return {"model": MODEL, "messages": [{"role": "user", "content": "Give JSON."}], "max_tokens": 8,
            "temperature": 0, "response_format": fmt, **kw}


def schema(name: str) -> dict:  # a schema of its own per test: the front-end skips the check of one seen
    return {"type": "object", "properties": {name: {"type": "boolean"}}}


def error_of(r: httpx.Response, status: int, code: str, param=...) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    if param is not ...:
        assert err["param"] == param, err
    return err


WHICH = ["single", "split"]


@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("how", ["waited", "queue full"])
def test_a_grammar_busy_in_the_engine_is_a_503_with_retry_after(servers, which, how):
    """The request's compile failed with GrammarBusy: after waiting in the compile queue (its future)
    or at once, the queue full (raised by the engine's add_request). It was a 500 `engine_error`
    (split: both; single process: the first)."""
    answer = failed(GrammarBusy(BUSY)) if how == "waited" else GrammarBusy("4096 grammars are waiting to compile")
    with RequestCompiles(servers.engine, lambda n: answer):
        r = httpx.post(servers.url(which) + "/v1/chat/completions", json=body(schema(f"busy_{how[0]}_{which}")),
                       timeout=60)
    err = error_of(r, 503, "server_busy")
    assert r.headers.get("retry-after") == "1"
    assert ("waited 60s" if how == "waited" else "4096 grammars") in err["message"]


@pytest.mark.parametrize("which", WHICH)
def test_a_grammar_busy_in_the_engine_before_a_streamed_answer_began_is_a_503(servers, which):
    """Streamed, nothing sent yet: the same 503 with Retry-After, not a 200 stream ending in an error."""
    with RequestCompiles(servers.engine, lambda n: failed(GrammarBusy(BUSY))):
        with httpx.stream("POST", servers.url(which) + "/v1/chat/completions",
                          json=body(schema(f"busy_stream_{which}"), stream=True), timeout=60) as r:
            r.read()
    error_of(r, 503, "server_busy")
    assert r.headers.get("retry-after") == "1"
    _still_serving(servers, which)


@pytest.mark.parametrize("which", WHICH)
def test_a_grammar_busy_in_the_engine_after_a_streamed_answer_began_is_a_server_busy_event(servers, which):
    """n=2: the first choice streams; the second's compile then fails busy. The 200 went out: the
    error event, which ends the second choice, says `server_busy` (it said `engine_error`)."""
    late = Future()
    with RequestCompiles(servers.engine, lambda n: None if n == 0 else late):
        events = []
        with httpx.stream("POST", servers.url(which) + "/v1/chat/completions",
                          json=body(schema(f"busy_late_{which}"), stream=True, n=2, max_tokens=64,
                                    ignore_eos=True), timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if not late.done() and any(c.get("delta", {}).get("content") for c in events[-1].get("choices", ())):
                    late.set_exception(GrammarBusy(BUSY))
    assert late.done()
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == "server_busy" and "waited 60s" in errors[0]["message"]
    ends = {c["index"]: c["finish_reason"] for e in events for c in e.get("choices", ()) if c.get("finish_reason")}
    assert 1 not in ends and ends[0] in ("stop", "length")  # the error event ends choice 1 (no finish chunk)


@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_refused_in_the_engine_is_a_400_naming_the_field(servers, which, stream):
    """The request's compile refused its grammar (the up-front check passed, or was skipped): a 400
    `invalid_schema` naming the field, streamed or not (it was a 500). The refusal's keyword and
    path do not cross from the engine: its message does."""
    refusal = GrammarError("the pattern at /properties/later matches no string")
    with RequestCompiles(servers.engine, lambda n: failed(refusal)):
        with httpx.stream("POST", servers.url(which) + "/v1/chat/completions",
                          json=body(schema(f"refused_{which}_{stream}"), stream=stream), timeout=60) as r:
            r.read()
    err = error_of(r, 400, "invalid_schema", param="response_format.json_schema.schema")
    assert "matches no string" in err["message"]


def _still_serving(servers, which) -> None:
    r = httpx.post(servers.url(which) + "/v1/chat/completions", json=body(schema("still_serving")), timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["completions", "responses"])
def test_the_other_routes_answer_the_engines_grammar_failures_alike(servers, route, stream):
    """/v1/completions and /v1/responses (split server): busy is the 503, a refusal the 400 naming
    their own field."""
    if route == "completions":
        path, make = "/v1/completions", lambda tag: {"model": MODEL, "prompt": "Say", "max_tokens": 8,
                                                     "regex": f"{tag}[a-z]+", "stream": stream}
        param = "regex"
    else:
        path = "/v1/responses"
        make = lambda tag: {"model": MODEL, "input": "Give JSON.", "max_output_tokens": 16, "stream": stream,
                            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema(tag)}}}
        param = "text.format.schema"
    for tag, answer, status, code in (("busy", GrammarBusy(BUSY), 503, "server_busy"),
                                      ("refused", GrammarError("no string matches it"), 400, None)):
        with RequestCompiles(servers.engine, lambda n: failed(answer)):
            with httpx.stream("POST", servers.split.url + path, json=make(f"{tag}{route}{stream}"), timeout=60) as r:
                r.read()
        err = error_of(r, status, code or ("invalid_regex" if route == "completions" else "invalid_schema"))
        assert err["param"] == (None if status == 503 else param), err


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(rf"^constrained_spec_{name}(?:_total)? (\S+)$", text, re.M).group(1))


def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("stage", ["check", "request", "request-stream"])
def test_a_client_gone_while_its_grammar_waits_to_compile_leaves_no_waiter(servers, which, stage):
    """Two compiles hold both compile threads; a request's grammar waits in the queue behind them,
    at the server's up-front check (`check`) or, that check passed, at the request's own compile in
    the engine (`request`, `request-stream`). Its client gives up: its wait ends within moments
    (the compile future cancelled; split: the front-end tells the engine process, which had kept
    the up-front check's waiter until the queue's deadline), and at the deadline the job leaves the
    queue as one nobody waits for: no queue timeout counted, no 503 for a client gone."""
    grammar = servers.engine.grammar
    queue, url = grammar.queue, servers.url(which)
    release = threading.Event()
    build, compile_async = grammar._build, grammar.compile_async

    def blocking_build(spec, prepared=None, key=None):
        if "blocker" in spec.value:
            release.wait(60)
        return build(spec, prepared, key)

    def checked(spec, timeout_s=None, check_only=False):  # `request`: the up-front check passed
        if check_only:
            done = Future()
            done.set_result(None)
            return done
        return compile_async(spec, timeout_s)

    grammar._build = blocking_build
    tag = f"{which}_{stage}"
    blockers = [compile_async(GrammarSpec.json_schema(schema(f"blocker{i}_{tag}")), timeout_s=0, check_only=True)
                for i in range(2)]  # no timeout: they hold their threads, and no spare starts
    try:
        _until(lambda: queue.stats["compiling"] == 2, 10, "the blockers hold both compile threads")
        timeouts = _metric(url, "grammar_compile_queue_timeouts")
        if stage != "check":
            grammar.compile_async = checked
        with httpx.Client(base_url=url, timeout=1.0) as c:
            with pytest.raises(httpx.ReadTimeout):
                if stage == "request-stream":
                    with c.stream("POST", "/v1/chat/completions", json=body(schema(f"target_{tag}"), stream=True)) as r:
                        r.read()
                else:
                    c.post("/v1/chat/completions", json=body(schema(f"target_{tag}")))
        gone = time.monotonic()
        job = next(j for j in list(queue._jobs.values()) if f"target_{tag}" in j.spec.value)
        assert job.started is None and _metric(url, "grammar_compile_queue_depth") == 1
        _until(lambda: job.waiters and all(w.done() for w, _ in job.waiters), 1.5,
               "the compile queue still has a waiter for a client gone")
        assert all(w.cancelled() for w, _ in job.waiters)
        _until(lambda: queue.stats["queue_depth"] == 0, 2 * queue.timeout_s + 5, "the job left the queue")
        assert job.key not in queue._jobs and not job.done.done() or job.done.exception() is not None
        assert _metric(url, "grammar_compile_queue_timeouts") == timeouts  # nobody was refused
        assert time.monotonic() - gone < 2 * queue.timeout_s + 5
    finally:
        grammar.compile_async = compile_async
        grammar._build = build
        release.set()
        for f in blockers:
            f.result(30)
    assert httpx.post(url + "/v1/chat/completions", json=body(schema(f"target_{tag}")), timeout=60).status_code == 200


class LLGuidanceFailsAt:
    """Every llguidance matcher fails on its `n`-th accepted token as llguidance does past one of
    its lazily built limits (an enum of 60,000 strings: "lexer error: too many expressions
    constructed" at its second mask): the token is refused and `error()` says why."""
    ERROR = "lexer error: too many expressions constructed"

    def __init__(self, n: int):
        from constrained_spec.grammar.llguidance_backend import LLGuidanceMatcher
        self.cls, self.n, self.accepted, self.failed = LLGuidanceMatcher, n, {}, set()

    def __enter__(self):
        real_accept, real_error = self.real = self.cls.accept_token, self.cls.error

        def accept_token(m, tok):
            k = self.accepted[id(m)] = self.accepted.get(id(m), 0) + 1
            if k >= self.n:
                self.failed.add(id(m))
                return False
            return real_accept(m, tok)

        self.cls.accept_token = accept_token
        self.cls.error = lambda m: self.ERROR if id(m) in self.failed else real_error(m)
        return self

    def __exit__(self, *exc):
        self.cls.accept_token, self.cls.error = self.real


@pytest.mark.parametrize("which", WHICH)
def test_a_grammar_backend_failing_mid_answer_is_grammar_too_complex_and_auto_moves_it_to_xgrammar(servers, which):
    """llguidance failing on a token its own mask allowed (a limit past the compile's probe of two
    masks) was a 500 `engine_error`: it is the 400 `grammar_too_complex` naming the field, and under
    auto the grammar's next request is served by xgrammar."""
    s = dict(schema(f"fails_mid_answer_{which}"), required=[f"fails_mid_answer_{which}"])  # no `{}` in 2 tokens
    url = servers.url(which) + "/v1/chat/completions"
    with LLGuidanceFailsAt(3) as patch:
        r = httpx.post(url, json=body(s), timeout=60)
        assert patch.failed, f"no llguidance matcher reached its third token: {r.text}"
        err = error_of(r, 400, "grammar_too_complex", "response_format.json_schema.schema")
        assert "too complex for the llguidance backend" in err["message"] and patch.ERROR in err["message"]
        r = httpx.post(url, json=body(s), timeout=60)
    assert r.status_code == 200, r.text  # llguidance, still failing at the third token, did not serve it
    assert servers.engine.grammar.compile(GrammarSpec.json_schema(s)).backend == "xgrammar"


def test_a_streamed_grammar_request_gets_its_headers_once_its_grammar_compiled(servers):
    """The 200 waits for the engine's word on the grammar, not for the first token: the engine
    announces the request once its grammar compiled. Here the first forward is held: the headers
    come while it is (they had waited for the first token), and the stream then completes."""
    engine = servers.engine
    release, entered = threading.Event(), threading.Event()
    real = engine.runner.forward

    def held_forward(*a, **k):
        entered.set()
        release.wait(30)
        return real(*a, **k)

    engine.runner.forward = held_forward
    got: dict = {}

    def client():
        with httpx.stream("POST", servers.url("single") + "/v1/chat/completions",
                          json=body(schema("announced"), stream=True), timeout=60) as r:
            got["status"] = r.status_code
            got["headers_at"] = time.monotonic()
            got["text"] = r.read().decode()

    t = threading.Thread(target=client)
    try:
        t.start()
        assert entered.wait(30), "no forward ran"
        deadline = time.monotonic() + 10
        while "status" not in got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got.get("status") == 200 and not release.is_set(), got  # headers with the forward still held
    finally:
        release.set()
        engine.runner.forward = real
        t.join(60)
    assert got["text"].rstrip().endswith("data: [DONE]"), got["text"][-300:]
    events = [json.loads(line[6:]) for line in got["text"].splitlines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length"), events[-1]

"""Stress the real HTTP server with many distinct JSON schemas sent concurrently; validate every answer.

    python benchmarks/stress_schemas.py --clients 64 --configs plain-greedy,plain-t0.7,ngram-greedy,ngram-t0.7-stream
    python benchmarks/stress_schemas.py --server-args "--device cuda" --configs plain-t0.7-c128,ngram-greedy-stream-c128
    python benchmarks/stress_schemas.py --server-args "--device cpu" --clients 8 --limit 24 --max-tokens 96
    python benchmarks/stress_schemas.py --url http://127.0.0.1:8000 --limit 50

Schemas: schemas/jsonschemabench-dev.jsonl (400) plus schemas/conformance/cases.jsonl. Each configuration
(`--configs`, comma separated; tokens joined by '-': plain|ngram|eagle, chain (EAGLE's top-1 chains),
always (speculate at every step),
greedy|t<T>, stream, c<clients>, fp<frequency penalty>, tools: each object schema as the parameters of a
function the request forces a call of, its arguments validated as the answer; responses: every request
through the Responses API, /v1/responses, instead of /v1/chat/completions) starts
its own server on a free 127.0.0.1 port (or uses `--url`). Every answer is classified:

  valid         200, finish "stop", JSON that validates (the schema's draft, with a format checker)
  refused       400 naming an unsupported keyword (tallied per keyword) or another property of the schema
  refused_load  400/429/503 about compile time, queueing or load: must never happen
  truncated     finish "length"
  invalid       200 "stop" whose content does not parse or validate: an engine bug
  error         5xx, finish "error", transport errors

Writes <out>.json, <out>.md and <out>.png; exits 1 when any answer is invalid, error or refused_load, or
the server's grammar end-invariant counter rose.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEV_SCHEMAS = ROOT / "schemas" / "jsonschemabench-dev.jsonl"
CONFORMANCE = ROOT / "schemas" / "conformance" / "cases.jsonl"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "stress_schemas"
OUTCOMES = ("valid", "refused", "refused_load", "truncated", "invalid", "error")
FAILING = ("invalid", "error", "refused_load")
KINDS = ("free-form", "unbounded-string", "unbounded-array", "bounded")
LOAD_WORDS = re.compile(r"compile exceeded|timed? ?out|queue|busy|overload|retry later|\bload\b|capacity", re.I)
KEYWORD_IN_MESSAGE = re.compile(r"keyword '([^']+)'")
END_VIOLATIONS = "grammar_end_violations"


# ---------------------------------------------------------------- schemas, prompts, kinds

@dataclass
class Case:
    id: str
    schema: dict
    kind: str
    top: str


def load_cases(limit: int | None = None, conformance: bool = True) -> list[Case]:
    """The first `limit` development schemas (all when None), then the conformance cases."""
    rows = [json.loads(line) for line in DEV_SCHEMAS.read_text().splitlines() if line.strip()]
    rows = rows[:limit] if limit is not None else rows
    if conformance:
        rows += [json.loads(line) for line in CONFORMANCE.read_text().splitlines() if line.strip()]
    return [Case(r["id"], r["schema"], schema_kind(r["schema"]), top_level_type(r["schema"])) for r in rows]


def build_prompt(schema: dict, max_schema_chars: int = 1500) -> str:
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if len(text) > max_schema_chars:
        text = text[:max_schema_chars] + " ...(schema cut)"
    return f"Write one JSON value that follows this JSON schema. Reply with the JSON only.\nSchema: {text}"


def top_level_type(schema) -> str:
    if not isinstance(schema, dict):
        return "any"
    t = schema.get("type")
    if isinstance(t, list):
        return "|".join(sorted(t))
    if t:
        return t
    if "enum" in schema or "const" in schema:
        return "enum"
    if "properties" in schema or "patternProperties" in schema:
        return "object"
    if any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref")):
        return "composite"
    return "any"


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("items", "additionalProperties", "contains", "then", "else", "additionalItems",
               "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_BOUNDED_FORMATS = {"date", "time", "date-time", "uuid", "ipv4", "ipv6", "duration"}


def subschemas(schema):
    """Every subschema that describes a value of the instance (refs are not followed: their targets are in $defs;
    propertyNames, not, if and dependentSchemas constrain rather than describe, and are left out)."""
    stack = [schema]
    while stack:
        s = stack.pop()
        if not isinstance(s, dict):
            continue
        yield s
        for k in _SCHEMA_MAPS:
            if isinstance(s.get(k), dict):
                stack.extend(s[k].values())
        for k in _SCHEMA_ONE:
            if isinstance(s.get(k), dict):
                stack.append(s[k])
        for k in _SCHEMA_LISTS:
            if isinstance(s.get(k), list):
                stack.extend(s[k])


def _types(s: dict) -> set:
    t = s.get("type")
    return set(t) if isinstance(t, list) else {t} if t else set()


def schema_kind(schema) -> str:
    """free-form (some value or object is unconstrained), unbounded-string (a string without maxLength, enum,
    const, pattern or a fixed-size format), unbounded-array (an array without maxItems), or bounded."""
    subs = list(subschemas(schema)) if isinstance(schema, dict) else []

    def free(s):
        if not _types(s) and not (s.keys() & {"enum", "const", "anyOf", "oneOf", "allOf", "$ref"}):
            return True  # no type: any JSON value
        return "object" in _types(s) and not (s.keys() & {"properties", "patternProperties"}) \
            and s.get("additionalProperties", True) is not False and not isinstance(s.get("additionalProperties"), dict)

    if not subs or any(free(s) for s in subs):
        return "free-form"
    if any("string" in _types(s) and not (s.keys() & {"maxLength", "enum", "const", "pattern"})
           and s.get("format") not in _BOUNDED_FORMATS for s in subs):
        return "unbounded-string"
    if any("array" in _types(s) and "maxItems" not in s for s in subs):
        return "unbounded-array"
    return "bounded"


# ---------------------------------------------------------------- validation

_JSON_POINTER = re.compile(r"(/([^~/]|~[01])*)*", re.S)
_REL_JSON_POINTER = re.compile(r"(0|[1-9][0-9]*)(#|(/([^~/]|~[01])*)*)", re.S)
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:[^\s\"<>\\^`{|}]*")
_TIME = re.compile(r"(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))")


def _is_time(s: str) -> bool:
    m = _TIME.fullmatch(s)
    return bool(m) and int(m[1]) < 24 and int(m[2]) < 60 and int(m[3]) <= 60 \
        and (m[6] is None or (int(m[6]) < 24 and int(m[7]) < 60))


def _is_date(s: str) -> bool:
    try:
        return bool(re.fullmatch(r"\d{4}-\d{2}-\d{2}", s)) and bool(datetime.date.fromisoformat(s))
    except ValueError:
        return False


def _format_checker(V):
    """The draft's format checker plus the RFC formats jsonschema checks only with optional packages."""
    import jsonschema
    fc = jsonschema.FormatChecker(formats=())
    fc.checkers = dict(V.FORMAT_CHECKER.checkers)
    extra = {
        "date-time": lambda s: len(s) > 10 and s[10] in "Tt" and _is_date(s[:10]) and _is_time(s[11:]),
        "time": _is_time,
        "date": _is_date,
        "uri": lambda s: bool(_URI.fullmatch(s)),
        "json-pointer": lambda s: bool(_JSON_POINTER.fullmatch(s)),
        "relative-json-pointer": lambda s: bool(_REL_JSON_POINTER.fullmatch(s)),
    }
    for name, check in extra.items():
        if name not in fc.checkers:
            fc.checkers[name] = (lambda c: (lambda x: not isinstance(x, str) or c(x)))(check), ()
    return fc


def validation_error(schema: dict, content: str) -> str | None:
    """None when `content` is JSON that validates against `schema`; else what is wrong."""
    import jsonschema
    try:
        value = json.loads(content)
    except ValueError as e:
        return f"not JSON: {e}"
    V = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    err = jsonschema.exceptions.best_match(V(schema, format_checker=_format_checker(V)).iter_errors(value))
    return None if err is None else f"{err.message} (at {'/'.join(map(str, err.absolute_path)) or 'root'})"


# ---------------------------------------------------------------- classification

@dataclass
class Answer:
    id: str
    kind: str
    top: str
    outcome: str = "error"
    status: int | None = None
    finish: str | None = None
    keyword: str | None = None  # refused: the keyword (or error code) the server named
    detail: str | None = None  # error message, validation error
    content: str | None = None  # kept for invalid answers and errors
    content_chars: int = 0
    open_string_chars: int | None = None  # truncated inside a string: that string's length so far
    looping: bool = False  # truncated with its tail repeating a piece of text (see ends_in_loop)
    completion_tokens: int = 0
    latency_s: float = 0.0
    ttft_s: float | None = None


def open_string_length(prefix: str) -> int | None:
    """Characters of the JSON string `prefix` ends inside (None when it ends outside any string)."""
    start, escaped = None, False
    for i, ch in enumerate(prefix):
        if start is None:
            if ch == '"':
                start = i + 1
        elif escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            start = None
    return None if start is None else len(prefix) - start


def ends_in_loop(text: str, max_period: int = 40, min_span: int = 24) -> bool:
    """The text ends with one piece (1 to max_period chars) repeated back to back, at least 3 times and
    min_span chars in all: a model looping until max_tokens."""
    for p in range(1, max_period + 1):
        reps = max(3, -(-min_span // p))
        if len(text) >= reps * p and text[-reps * p:] == text[-p:] * reps:
            return True
    return False


def classify_refusal(status: int, body) -> tuple[str, str | None, str]:
    """(outcome, keyword, message) for a non-200 answer."""
    err = body.get("error", body) if isinstance(body, dict) else {}
    err = err if isinstance(err, dict) else {"message": str(err)}
    message = str(err.get("message") or body)
    code = err.get("code")
    if status in (429, 503) or (status == 400 and LOAD_WORDS.search(message)):
        return "refused_load", code, message
    if status == 400:
        m = KEYWORD_IN_MESSAGE.search(message)
        return "refused", m.group(1) if m else (code or "other"), message
    return "error", code, message


def classify_completion(ans: Answer, schema: dict, content: str, finish: str | None) -> Answer:
    ans.finish, ans.content_chars = finish, len(content)
    if finish == "length":
        ans.outcome, ans.open_string_chars = "truncated", open_string_length(content)
        ans.looping = ends_in_loop(content)
    elif finish == "stop":
        ans.detail = validation_error(schema, content)
        ans.outcome = "valid" if ans.detail is None else "invalid"
    else:
        ans.outcome, ans.detail = "error", f"finish_reason {finish!r}"
    if ans.outcome != "valid" and ans.outcome != "truncated":
        ans.content = content
    return ans


# ---------------------------------------------------------------- requests

def request_body(case: Case, model: str, temperature: float, max_tokens: int, stream: bool, seed: int,
                 sampling: dict | None = None, tools: bool = False) -> dict:
    """The case's request: its schema as response_format, or with `tools` (for an object schema) as the
    parameters of a function the request forces a call of."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", case.id)[:64]
    body = {**(sampling or {}), "model": model, "messages": [{"role": "user", "content": build_prompt(case.schema)}],
            "max_tokens": max_tokens, "temperature": temperature, "seed": seed}
    if tools and case.top == "object":
        body["tools"] = [{"type": "function", "function": {"name": name, "parameters": case.schema, "strict": True}}]
        body["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": case.schema,
                                                                          "strict": True}}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def responses_body(body: dict) -> dict:
    """A chat request body (`request_body`) as the same request to the Responses API."""
    out = {k: v for k, v in body.items()
           if k not in ("messages", "max_tokens", "response_format", "tools", "tool_choice", "stream_options")}
    out.update(input=body["messages"], max_output_tokens=body["max_tokens"])
    if "response_format" in body:
        out["text"] = {"format": {"type": "json_schema", **body["response_format"]["json_schema"]}}
    if "tools" in body:
        out["tools"] = [{"type": "function", **t["function"]} for t in body["tools"]]
        out["tool_choice"] = {"type": "function", "name": body["tool_choice"]["function"]["name"]}
    return out


def response_answer(data: dict) -> tuple[dict, str]:
    """A Response object as the chat message and finish reason it stands for (`_answer` takes them)."""
    output = data.get("output") or []
    calls = [{"function": {"name": o.get("name"), "arguments": o.get("arguments", "")}}
             for o in output if o.get("type") == "function_call"]
    text = "".join(part.get("text", "") for o in output if o.get("type") == "message" for part in o.get("content") or ())
    finish = "length" if data.get("status") == "incomplete" else "tool_calls" if calls else "stop"
    if data.get("status") not in ("completed", "incomplete"):
        finish = f"status {data.get('status')}"
    return ({"content": None, "tool_calls": calls} if calls else {"content": text}), finish


async def send_one(client: httpx.AsyncClient, case: Case, body: dict, responses: bool = False) -> Answer:
    ans = Answer(case.id, case.kind, case.top)
    t0 = time.perf_counter()
    try:
        if responses:
            await _send_response(client, case, body, ans, t0)
        elif body.get("stream"):
            await _send_streamed(client, case, body, ans, t0)
        else:
            r = await client.post("/v1/chat/completions", json=body)
            if not await _refused(r, ans):
                data = r.json()
                choice = data["choices"][0]
                ans.completion_tokens = (data.get("usage") or {}).get("completion_tokens", 0)
                text, finish = _answer(choice["message"], choice["finish_reason"], body)
                classify_completion(ans, case.schema, text, finish)
    except Exception as e:  # transport errors, broken bodies
        ans.outcome, ans.detail = "error", f"{type(e).__name__}: {e}"
    ans.latency_s = time.perf_counter() - t0
    return ans


async def _refused(r: httpx.Response, ans: Answer) -> bool:
    """Records the answer's status; a non-200 is classified (`classify_refusal`) and True returned."""
    ans.status = r.status_code
    if r.status_code == 200:
        return False
    text = (await r.aread()).decode(errors="replace")
    ans.outcome, ans.keyword, ans.detail = classify_refusal(r.status_code, _json_or_text(text))
    return True


async def _send_response(client, case, body, ans: Answer, t0: float) -> None:
    """The request through /v1/responses: one Response object, or its event stream, whose deltas must
    add up to the final response's answer."""
    rbody = responses_body(body)
    if not body.get("stream"):
        r = await client.post("/v1/responses", json=rbody)
        if await _refused(r, ans):
            return
        data = r.json()
        ans.completion_tokens = (data.get("usage") or {}).get("output_tokens", 0)
        classify_completion(ans, case.schema, *_answer(*response_answer(data), body))
        return
    async with client.stream("POST", "/v1/responses", json=rbody) as r:
        if await _refused(r, ans):
            return
        pieces, final = [], None
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            kind = event.get("type", "")
            if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
                if ans.ttft_s is None:
                    ans.ttft_s = time.perf_counter() - t0
                pieces.append(event["delta"])
            elif kind in ("response.completed", "response.incomplete", "response.failed"):
                final = event["response"]
    if final is None:
        ans.outcome, ans.detail, ans.content = "error", "stream ended without a final response", "".join(pieces)
        return
    if final.get("status") == "failed":
        ans.outcome, ans.detail, ans.content = "error", str(final.get("error")), "".join(pieces)
        return
    ans.completion_tokens = (final.get("usage") or {}).get("output_tokens", 0)
    message, finish = response_answer(final)
    answer = message["tool_calls"][0]["function"]["arguments"] if message.get("tool_calls") else message["content"]
    if "".join(pieces) != answer:
        ans.outcome, ans.detail, ans.content = "error", "the stream's deltas differ from its final response", answer
        return
    classify_completion(ans, case.schema, *_answer(message, finish, body))


async def _send_streamed(client, case, body, ans: Answer, t0: float) -> None:
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if await _refused(r, ans):
            return
        pieces, finish, done, called = [], None, False, None
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                ans.outcome, ans.keyword, ans.detail = "error", None, str(chunk["error"])
                ans.content = "".join(pieces)
                return
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                text = delta.get("content")
                for call in delta.get("tool_calls") or ():  # a forced call: its arguments are the answer
                    text = (text or "") + (call.get("function") or {}).get("arguments", "")
                    called = (call.get("function") or {}).get("name") or called
                if text:
                    if ans.ttft_s is None:
                        ans.ttft_s = time.perf_counter() - t0
                    pieces.append(text)
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                ans.completion_tokens = chunk["usage"].get("completion_tokens", 0)
        if not done:
            ans.outcome, ans.detail, ans.content = "error", "stream ended without [DONE]", "".join(pieces)
            return
        message = {"content": "".join(pieces)} if "tools" not in body else {
            "tool_calls": [{"function": {"name": called, "arguments": "".join(pieces)}}]}
        classify_completion(ans, case.schema, *_answer(message, finish, body))


def _answer(message: dict, finish: str | None, body: dict) -> tuple[str, str | None]:
    """The text to validate and the finish reason to classify: a forced call's arguments, its
    `tool_calls` finish counting as `stop`, and a call of another function (or none) as an error."""
    if "tools" not in body:
        return message.get("content") or "", finish
    calls = message.get("tool_calls") or []
    wanted = body["tool_choice"]["function"]["name"]
    if finish == "length":
        return (calls[0]["function"]["arguments"] if calls else message.get("content") or ""), finish
    if finish != "tool_calls" or len(calls) != 1 or calls[0]["function"]["name"] != wanted:
        return message.get("content") or "", f"{finish} without one call of {wanted}"
    return calls[0]["function"]["arguments"], "stop"


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return {"message": text}


async def run_load(url: str, cases: list[Case], model: str, clients: int, temperature: float, max_tokens: int,
                   stream: bool, seed: int, sampling: dict | None = None,
                   timeout_s: float = 1800.0, tools: bool = False, responses: bool = False
                   ) -> tuple[list[Answer], float]:
    """Sends every case with `clients` concurrent workers; returns the answers (in case order) and wall time."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, case in enumerate(cases):
        queue.put_nowait((i, case))
    answers: list[Answer | None] = [None] * len(cases)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def worker(client):
        while not queue.empty():
            i, case = queue.get_nowait()
            body = request_body(case, model, temperature, max_tokens, stream, seed + i, sampling, tools)
            answers[i] = await send_one(client, case, body, responses)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    return answers, time.perf_counter() - t0


# ---------------------------------------------------------------- server and metrics

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`constrained-spec serve` as a subprocess on a free 127.0.0.1 port; its log goes to `log_path`. Its
    compiled-grammar disk cache is a fresh folder beside the log (cold compiles), unless `args` name one."""

    def __init__(self, args: list[str], log_path: Path, ready_timeout_s: float = 900.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "constrained_spec.cli", "serve", "--host", "127.0.0.1", "--port",
               str(self.port), "--served-model-name", "stress", "--log-level", "warning", *args]
        env = dict(os.environ, CONSTRAINED_SPEC_GRAMMAR_CACHE_DIR=tempfile.mkdtemp(
            prefix="grammar-cache-", dir=log_path.parent))
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.started_s = time.perf_counter()
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise TimeoutError(f"server not ready in {ready_timeout_s}s:\n{tail}")
            time.sleep(0.5)
        from constrained_spec.server.runner import wait_for_frontends
        wait_for_frontends(self.url)  # the whole server: front-ends past the first join as they start
        self.ready_s = time.perf_counter() - self.started_s

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def read_metrics(url: str) -> dict[str, float]:
    """Prometheus samples of /metrics as {name{labels}: value} (histogram buckets left out)."""
    out = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if line.startswith("#") or not line.strip() or "_bucket{" in line:
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def grammar_metrics(before: dict, after: dict) -> dict[str, float]:
    """The grammar and compile samples: counters as their change between two reads, gauges and quantiles
    as read after."""
    def is_gauge(k):
        return "quantile=" in k or k.endswith(("_depth", "_running"))
    keys = [k for k in after if "grammar" in k or "compile" in k]
    return {k.replace("constrained_spec_", ""): after[k] - (0.0 if is_gauge(k) else before.get(k, 0.0))
            for k in sorted(keys)}


def compile_figures(metrics: dict) -> dict[str, float | None]:
    """Compiles during the run and the server's recent compile-time p50/p99 (None where not exported)."""
    def pick(*names):
        return next((metrics[n] for n in names if n in metrics), None)
    return {"compiles": pick("grammar_compiles_total", "grammar_compile_duration_seconds_count"),
            "p50_s": pick('grammar_compile_duration_seconds_recent{quantile="0.5"}'),
            "p99_s": pick('grammar_compile_duration_seconds_recent{quantile="0.99"}'),
            "timeouts": pick("grammar_compile_timeouts_total")}


# ---------------------------------------------------------------- configurations and summaries

@dataclass
class Config:
    name: str
    server_args: list[str]
    clients: int
    temperature: float
    stream: bool
    sampling: dict = field(default_factory=dict)  # more request fields, e.g. frequency_penalty
    tools: bool = False  # object schemas as forced tool calls' parameters
    responses: bool = False  # through /v1/responses


def parse_config(name: str, clients: int, temperature: float, stream: bool, extra_args: list[str]) -> Config:
    """'ngram-t0.7-stream-c128' -> n-gram speculation, T=0.7, streamed, 128 clients (unset parts: the flags);
    'eagle-always' speculates with the EAGLE head at every step ('eagle-chain-always': its top-1
    chains, each verified with the next one drafted in the same launch); 'tools' sends object schemas as forced
    tool calls; 'responses' sends every request to /v1/responses; 'fp0.5' adds frequency_penalty 0.5 to
    every request."""
    server_args, sampling, tools, responses = list(extra_args), {}, False, False
    for tok in name.split("-"):
        if tok == "plain":
            pass
        elif tok in ("ngram", "eagle"):
            server_args += ["--speculative-algorithm", tok]
        elif tok == "chain":  # EAGLE's top-1 chains (verify and next draft fused), not its trees
            server_args += ["--eagle-topk", "1", "--eagle-depth", "7"]
        elif tok == "always":  # speculate at every step (the measured policy may keep a drafter off)
            server_args += ["--speculative-policy", "always"]
        elif tok == "greedy":
            temperature = 0.0
        elif re.fullmatch(r"t\d+(\.\d+)?", tok):
            temperature = float(tok[1:])
        elif tok == "stream":
            stream = True
        elif re.fullmatch(r"c\d+", tok):
            clients = int(tok[1:])
        elif tok == "tools":
            tools = True
        elif tok == "responses":
            responses = True
        elif re.fullmatch(r"fp\d+(\.\d+)?", tok):
            sampling["frequency_penalty"] = float(tok[2:])
        else:
            raise ValueError(f"unknown configuration part {tok!r} in {name!r}")
    return Config(name, server_args, clients, temperature, stream, sampling, tools, responses)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    v = sorted(values)
    return {f"p{q}": v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))] for q in (50, 90, 99)}


def summarize(config: Config, answers: list[Answer], wall_s: float, metrics: dict) -> dict:
    tally = collections.Counter(a.outcome for a in answers)
    generated = [a for a in answers if a.status == 200]
    by_kind = {}
    for kind in KINDS:
        group = [a for a in generated if a.kind == kind]
        trunc = [a for a in group if a.outcome == "truncated"]
        in_string = [a.open_string_chars for a in trunc if a.open_string_chars is not None]
        by_kind[kind] = {"answered": len(group), "truncated": len(trunc),
                         "mean_truncated_chars": sum(a.content_chars for a in trunc) / len(trunc) if trunc else None,
                         "in_string": len(in_string), "looping": sum(a.looping for a in trunc),
                         "mean_open_string_chars": sum(in_string) / len(in_string) if in_string else None}
    tokens = sum(a.completion_tokens for a in answers)
    return {
        "config": asdict(config), "requests": len(answers), "wall_s": wall_s,
        "tally": {o: tally.get(o, 0) for o in OUTCOMES},
        "refused_keywords": dict(collections.Counter(a.keyword for a in answers if a.outcome == "refused")
                                 .most_common()),
        "latency_s": percentiles([a.latency_s for a in generated]),
        "ttft_s": percentiles([a.ttft_s for a in generated if a.ttft_s is not None]) if config.stream else None,
        "completion_tokens": tokens, "served_tok_s": tokens / wall_s if wall_s else 0.0,
        "truncation_by_kind": by_kind,
        "truncated_by_top_type": dict(collections.Counter(a.top for a in answers if a.outcome == "truncated")),
        "grammar_metrics": metrics, "compile": compile_figures(metrics),
        "end_violations": next((v for k, v in metrics.items() if END_VIOLATIONS in k), None),
        "failures": [asdict(a) for a in answers if a.outcome in FAILING],
        "answers": [{k: v for k, v in asdict(a).items() if k != "content"} for a in answers],
    }


def failed(summary: dict) -> bool:
    return any(summary["tally"][o] for o in FAILING) or bool(summary["end_violations"])


def run_config(config: Config, cases: list[Case], max_tokens: int, seed: int, url: str | None = None,
               log_dir: Path | None = None) -> tuple[dict, list[Answer]]:
    """Starts a server for `config` (unless `url`), sends every case, returns the summary and the answers."""
    server = None
    if url is None:
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="stress_schemas_"))
        log_dir.mkdir(parents=True, exist_ok=True)
        server = Server(config.server_args, log_dir / f"server-{config.name}.log")
        url = server.url
        print(f"[{config.name}] server ready in {server.ready_s:.1f}s at {url} (log {server.log_path})", flush=True)
    try:
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        before = read_metrics(url)
        answers, wall = asyncio.run(run_load(url, cases, models[0]["id"], config.clients, config.temperature,
                                             max_tokens, config.stream, seed, config.sampling, tools=config.tools,
                                             responses=config.responses))
        summary = summarize(config, answers, wall, grammar_metrics(before, read_metrics(url)))
        if server is not None:
            summary["server_ready_s"] = server.ready_s
            summary["server_log"] = str(server.log_path)
        return summary, answers
    finally:
        if server is not None:
            server.stop()


# ---------------------------------------------------------------- reports

def _f(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_report(summaries: list[dict], header: str = "") -> str:
    lines = [header] if header else []
    lines += ["| config | clients | T | stream | n | " + " | ".join(OUTCOMES) +
              " | latency p50/p90/p99 s | TTFT p50/p99 s | tok/s | compiles (timeouts) | compile p50/p99 s | "
              "end violations |", "|" + "---|" * (11 + len(OUTCOMES))]
    for s in summaries:
        c, lat, ttft, comp = s["config"], s["latency_s"], s["ttft_s"], s["compile"]
        lines.append(f"| {c['name']} | {c['clients']} | {c['temperature']:g} | {'yes' if c['stream'] else 'no'} | "
                     f"{s['requests']} | " + " | ".join(str(s["tally"][o]) for o in OUTCOMES) +
                     f" | {_f(lat['p50'])}/{_f(lat['p90'])}/{_f(lat['p99'])} | "
                     f"{_f(ttft['p50']) + '/' + _f(ttft['p99']) if ttft else '-'} | {s['served_tok_s']:.1f} | "
                     f"{_f(comp['compiles'], 0)} ({_f(comp['timeouts'], 0)}) | {_f(comp['p50_s'], 3)}/{_f(comp['p99_s'], 3)} | "
                     f"{_f(s['end_violations'], 0)} |")
    lines += ["", "Truncated answers (finish \"length\") per schema kind: truncated/answered (mean chars when cut); "
                  "of those, cut inside an open string (its mean chars so far), and ending in a loop (a piece "
                  "of text repeated)",
              "", "| config | " + " | ".join(KINDS) + " |", "|---|" + "---|" * len(KINDS)]
    for s in summaries:
        cells = [f"{k['truncated']}/{k['answered']} ({_f(k['mean_truncated_chars'], 0)}); "
                 f"in string {k['in_string']} ({_f(k['mean_open_string_chars'], 0)}); looping {k['looping']}"
                 for k in (s["truncation_by_kind"][kind] for kind in KINDS)]
        lines.append(f"| {s['config']['name']} | " + " | ".join(cells) + " |")
    lines += ["", "Refusals per keyword:"]
    for s in summaries:
        kw = ", ".join(f"{k} {n}" for k, n in s["refused_keywords"].items()) or "none"
        lines.append(f"- {s['config']['name']}: {kw}")
    lines += ["", "Grammar metrics (change over the run):"]
    for s in summaries:
        m = ", ".join(f"{k} {v:g}" for k, v in s["grammar_metrics"].items()) or "no /metrics"
        lines.append(f"- {s['config']['name']}: {m}")
    bad = [(s["config"]["name"], f) for s in summaries for f in s["failures"]]
    if bad:
        lines += ["", "Failures (invalid, error, refused_load):"]
        for name, f in bad:
            lines.append(f"- {name} {f['outcome']} `{f['id']}` status {f['status']} finish {f['finish']}: "
                         f"{f['detail']}; content {json.dumps(f['content'], ensure_ascii=False)}")
    return "\n".join(lines)


def plot(summaries: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"valid": "#2ca02c", "refused": "#7f7f7f", "refused_load": "#ff7f0e", "truncated": "#1f77b4",
              "invalid": "#d62728", "error": "#9467bd"}
    names = [s["config"]["name"] for s in summaries]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(names) + 2), 4.5))
    bottom = [0] * len(names)
    for o in OUTCOMES:
        vals = [s["tally"][o] for s in summaries]
        ax.bar(names, vals, bottom=bottom, label=o, color=colors[o])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("answers")
    ax.set_title("stress_schemas: answers per configuration")
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(summaries: list[dict], out: Path, meta: dict) -> None:
    """<out>.json, .md and .png (the suffix added to the whole name: `--out results/plain-t0.7` is
    not cut to plain-t0)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    at = lambda suffix: out.with_name(out.name + suffix)
    at(".json").write_text(json.dumps({"meta": meta, "configs": summaries}, indent=1,
                                                   ensure_ascii=False))
    header = f"# stress_schemas\n\n`{meta['command']}`\n\n{meta['schemas']} schemas, max_tokens {meta['max_tokens']}\n"
    at(".md").write_text(format_report(summaries, header) + "\n")
    try:
        plot(summaries, at(".png"))
    except ImportError:
        print("matplotlib is missing: no chart (pip install -e '.[dev]')", file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (only 127.0.0.1); default: start one per configuration")
    p.add_argument("--server-args", default="", help="flags for every started server, e.g. '--device cuda'")
    p.add_argument("--configs", default=None, help="comma-separated configurations, e.g. "
                   "plain-greedy,plain-t0.7,ngram-greedy-stream,ngram-t0.7-c128 (default: one from the flags)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--limit", type=int, default=None, help="the first N development schemas")
    p.add_argument("--no-conformance", action="store_true", help="leave out schemas/conformance/cases.jsonl")
    p.add_argument("--ids", default=None, help="only these schema ids (comma separated), e.g. to replay failures")
    p.add_argument("--seed", type=int, default=0, help="request i gets seed+i; also shuffles the order")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results prefix (.json, .md, .png)")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temporary folder)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stops the started server on the way out
    if args.url and not re.match(r"https?://(127\.0\.0\.1|localhost)(:\d+)?/?$", args.url):
        p.error("--url must be a server on 127.0.0.1")

    cases = load_cases(args.limit, not args.no_conformance)
    if args.ids:
        wanted = set(args.ids.split(","))
        cases = [c for c in cases if c.id in wanted]
        if missing := wanted.difference(c.id for c in cases):
            p.error(f"no schema with id {', '.join(sorted(missing))}")
    random.Random(args.seed).shuffle(cases)
    extra = shlex.split(args.server_args)
    names = args.configs.split(",") if args.configs else [
        ("greedy" if args.temperature == 0 else f"t{args.temperature:g}") + ("-stream" if args.stream else "")]
    configs = [parse_config(n.strip(), args.clients, args.temperature, args.stream, extra) for n in names]
    print(f"{len(cases)} schemas; kinds: {dict(collections.Counter(c.kind for c in cases))}", flush=True)
    summaries = []
    for config in configs:
        summary, _ = run_config(config, cases, args.max_tokens, args.seed, url=args.url, log_dir=args.log_dir)
        summaries.append(summary)
        print(format_report([summary]), flush=True)
        meta = {"command": "python benchmarks/stress_schemas.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv)),
                "schemas": len(cases), "max_tokens": args.max_tokens, "seed": args.seed,
                "host": os.uname().nodename, "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        write_results(summaries, args.out, meta)  # after every configuration: a long run keeps what it has
    print("\n" + format_report(summaries), flush=True)
    return 1 if any(failed(s) for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())

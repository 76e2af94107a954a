"""Serving benchmark: real HTTP clients against `constrained-spec serve`, beside the in-process engine
on the same requests.

    python benchmarks/bench_serving.py --device cuda                         # the H100 acceptance set
    python benchmarks/bench_serving.py --device cpu --clients 1,4 --rates 2 --max-tokens 16 --rounds 1

Each server (the split server, `serve`, with its default front-end count or N of them, `split-N`,
and the single-process one, `serve --single-process`) is
started as a subprocess on a free 127.0.0.1 port and driven by client processes (aiohttp, asyncio),
so the clients' own Python work does not limit what is measured (an httpx client spent ~3 ms of CPU
a request, aiohttp ~0.35 ms: with httpx, 64 clients whose answers end together queued for tens of
milliseconds in their own client process, and the server looked slow). Two modes:

* max concurrency C: C clients, each sending its next request when its last one ends (`--clients`);
  the in-process Engine runs the same requests with C in flight, so served / engine is one ratio
  from one run;
* request rate: Poisson arrivals at the given rates (`--rates`, requests/s), unbounded concurrency.

Workloads: `plain` (a story, `ignore_eos`, `--max-tokens` tokens), `json` (one schema), `schemas`
(the 30 schemas of schemas/handwritten, each with its own prompt), `shared-prefix` (one ~1,500-token
system prompt with the schema and worked examples, then a short user message, every request; JSON),
`multi-turn` (conversations of 4 turns whose prompts grow by the previous turns, a turn of every
conversation before the next turn of any), `distinct` (the JSON task after a ~250-token system prompt of
the request's own: no prefix to share, the prefix cache's worst case); greedy. The prefix cache is measured by running the same
server with and without it: a server name with `+nocache` adds `--disable-prefix-cache`
(`--servers split,split+nocache`); the report then has a cache on / off table. A few percent between
two servers run one after the other is within what a host drifts in a minute: `--interleave N` starts
every server at once (each with its own `--kv-cache-memory-gb`, 48 GiB shared out unless given) and
runs each configuration N times, the servers in turn (their order alternating), and the report
takes the median run and, for an A/B, the median of the N paired ratios. Every request is sent
non-streamed and streamed (`--stream`). Reported: TTFT, TPOT (time per output token after the
first), ITL (inter-token latency: time between streamed chunks), end-to-end latency (p50/p90/p99),
requests/s and output tokens/s. Non-streamed, TTFT is the end-to-end latency.

Writes benchmarks/results/bench_serving.{json,md,png} (no PNG without matplotlib).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import cpu_time  # noqa: E402
HANDWRITTEN = ROOT / "schemas" / "handwritten" / "handwritten.jsonl"
MODEL_ID = "bench"

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "email": {"type": "string"}, "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                   "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "skills", "active"], "additionalProperties": False,
}
TOPICS = ["a chef in Lyon", "a retired pilot", "a data engineer", "a marine biologist", "a jazz pianist",
          "a farmer in Kenya", "a chess coach", "a nurse in Oslo", "a game designer", "a beekeeper"]


# -- workloads ----------------------------------------------------------------------------------------

@dataclass
class Job:
    """One request: its chat message (after a system prompt and earlier turns, if any), and the
    constraint (a JSON schema or none)."""
    content: str
    schema: dict | None
    ignore_eos: bool
    history: list[dict] = field(default_factory=list)  # messages before the user's

    @property
    def messages(self) -> list[dict]:
        return self.history + [{"role": "user", "content": self.content}]

    def body(self, max_tokens: int, stream: bool) -> dict:
        b = {"model": MODEL_ID, "messages": self.messages, "max_tokens": max_tokens,
             "temperature": 0, "stream": stream}
        if stream:
            b["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            b["ignore_eos"] = True
        if self.schema is not None:
            b["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": self.schema}}
        return b


def shared_system_prompt() -> str:
    """~1,500 tokens (SmolLM2's tokenizer): instructions, the schema, and worked examples, the way
    structured-output applications put them in front of every request."""
    rules = ("You are the records assistant of a staffing agency. For every person the user describes, answer "
             "with exactly one JSON object that follows the schema below: no prose before or after it, no "
             "comments, no trailing commas. Use the person's full name if it is given, else invent a plausible "
             "one. Give the age in whole years. Make up a work email at example.com from the name. List at most "
             "four skills, most important first, each two or three words long. Set active to false only when the "
             "user says the person retired or left.")
    examples = []
    for i, topic in enumerate((TOPICS * 2)[:16]):
        name = f"{['Ana', 'Bo', 'Chen', 'Dara', 'Eli', 'Fay', 'Gus', 'Hana', 'Ivo', 'June'][i % 10]} " \
               f"{['Moreau', 'Lind', 'Okafor', 'Sato', 'Reyes'][i % 5]}"
        answer = {"name": name, "age": 24 + 3 * i, "email": name.lower().replace(" ", ".") + "@example.com",
                  "skills": ["planning", "team leadership", "customer care", "budgeting"][: 2 + i % 3],
                  "active": i % 4 != 3}
        examples.append(f"Example {i + 1}.\nUser: Describe {topic}, {24 + 3 * i} years old"
                        f"{', now retired' if i % 4 == 3 else ''}.\nAssistant: {json.dumps(answer)}")
    return (f"{rules}\n\nSchema:\n{json.dumps(PERSON_SCHEMA, indent=2)}\n\n" + "\n\n".join(examples)
            + "\n\nAnswer the next request the same way.")


_NOTE_WORDS = ("harbor", "ledger", "copper", "violet", "meadow", "signal", "orchard", "lantern", "granite", "ember",
               "quarry", "saddle", "thimble", "willow", "cobalt", "falcon", "juniper", "marble", "nectar", "pepper",
               "raven", "tundra", "velvet", "walnut", "zephyr", "basil", "canyon", "dune", "fjord", "glacier")


def distinct_context(k: int) -> str:
    """Request k's own ~250-token system prompt (seeded by k): two requests share nothing of it but,
    now and then, a leading digit."""
    rng = random.Random(k)
    return f"{k}: case notes. " + " ".join(rng.choice(_NOTE_WORDS) for _ in range(200))


MULTI_TURN_TURNS = 4
_TURN_ASKS = ["Describe {topic}.", "Now make them ten years older.", "Give them one more skill.",
              "Now they retired: update the record."]
_TURN_ANSWER = ('{"name": "Sam Rivera", "age": 41, "email": "sam.rivera@example.com", '
                '"skills": ["planning", "customer care"], "active": true}')


def make_jobs(workload: str, n: int, first: int = 0) -> list[Job]:
    """n requests of a workload; `first` numbers them (the warm-up's requests are not the measured ones)."""
    if workload == "shared-prefix":
        system = [{"role": "system", "content": shared_system_prompt()}]
        return [Job(f"Request {first + i}: describe {TOPICS[i % len(TOPICS)]}.", PERSON_SCHEMA, False, system)
                for i in range(n)]
    if workload == "multi-turn":
        conversations = max(1, math.ceil(n / MULTI_TURN_TURNS))
        jobs = []
        for turn in range(MULTI_TURN_TURNS):  # turn t of every conversation, then turn t + 1
            for c in range(conversations):
                history = [{"role": "system", "content": f"Conversation {first + c}. You keep one JSON record "
                                                         "of a person up to date and answer with the whole record."}]
                for t in range(turn):
                    history += [{"role": "user", "content": _TURN_ASKS[t].format(topic=TOPICS[c % len(TOPICS)])},
                                {"role": "assistant", "content": _TURN_ANSWER}]
                jobs.append(Job(_TURN_ASKS[turn].format(topic=TOPICS[c % len(TOPICS)]), PERSON_SCHEMA, False, history))
        return jobs[:n]
    if workload == "distinct":  # no prefix past the chat template's first tokens: what a cache cannot help
        return [Job(f"Give a JSON profile of {TOPICS[i % len(TOPICS)]} with name, age, email, skills and active.",
                    PERSON_SCHEMA, False, [{"role": "system", "content": distinct_context(first + i)}])
                for i in range(n)]
    if workload == "plain":
        return [Job(f"Write a short story about {TOPICS[i % len(TOPICS)]}.", None, True) for i in range(n)]
    if workload == "json":
        return [Job(f"Give a JSON profile of {TOPICS[i % len(TOPICS)]} with name, age, email, skills and active.",
                    PERSON_SCHEMA, False) for i in range(n)]
    if workload == "schemas":
        cases = [json.loads(line) for line in HANDWRITTEN.read_text().splitlines() if line.strip()]
        return [Job(cases[i % len(cases)]["prompt"] + " Answer in JSON.", cases[i % len(cases)]["schema"], False)
                for i in range(n)]
    raise SystemExit(f"unknown workload {workload!r} (plain, json, schemas, shared-prefix, multi-turn, distinct)")


# -- the clients (run in worker processes) -----------------------------------------------------------

def answer_is_valid(schema: dict | None, text: str, finish_reason: str | None) -> bool:
    """Every answer is checked: a schema-constrained answer that ended on "stop" must parse and
    validate (one cut by max_tokens cannot be complete, and is not counted invalid)."""
    if schema is None or finish_reason != "stop":
        return True
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return _validator(_schema_key(schema)).is_valid(value)


def _schema_of(body: dict) -> dict | None:
    return body.get("response_format", {}).get("json_schema", {}).get("schema")


def _schema_key(schema: dict) -> bytes:
    return orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)


def prepare_validators(bodies: list[dict]) -> None:
    """Builds the validators a client process will need before its clock starts: importing
    jsonschema and checking a schema take ~120 ms the first time, which landed inside the first
    schema-constrained run (8 requests at one client: 15 ms a request)."""
    for body in bodies:
        schema = _schema_of(body)
        if schema is not None:
            _validator(_schema_key(schema))


@functools.lru_cache(maxsize=1024)
def _validator(schema_json: bytes):
    """One validator per schema, built (and the schema checked) once: `jsonschema.validate` does
    both on every call, ~5 ms, which in a client's event loop delays its other requests' next sends."""
    import jsonschema
    schema = orjson.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema)


JSON_HEADERS = {"Content-Type": "application/json"}


async def _one(client, body: dict, stream: bool) -> dict:
    """Sends one request; returns its timings (seconds from its start) and output token count."""
    t0 = time.perf_counter()
    rec = {"ok": False, "ttft": None, "e2e": None, "itl": [], "tokens": 0, "error": None, "invalid": False,
           "prompt_tokens": 0, "cached_tokens": 0}
    schema = _schema_of(body)
    try:
        async with client.post("/v1/chat/completions", data=orjson.dumps(body), headers=JSON_HEADERS) as r:
            if not stream:
                raw = await r.read()
                rec["e2e"] = rec["ttft"] = time.perf_counter() - t0
                if r.status != 200:
                    rec["error"] = f"{r.status}: {raw[:200]!r}"
                    return rec
                data = orjson.loads(raw)
                _usage_into(rec, data["usage"])
                choice = data["choices"][0]
                rec["invalid"] = not answer_is_valid(schema, choice["message"]["content"], choice["finish_reason"])
                rec["ok"] = True
                return rec
            last, text, finish = None, [], None
            if r.status != 200:
                rec["error"] = f"{r.status}: {(await r.read())[:200]!r}"
                return rec
            async for raw_line in r.content:
                if not raw_line.startswith(b"data: ") or raw_line.startswith(b"data: [DONE]"):
                    continue
                chunk = orjson.loads(raw_line[6:])
                if "error" in chunk:
                    rec["error"] = str(chunk["error"])[:200]
                    return rec
                if chunk.get("usage"):
                    _usage_into(rec, chunk["usage"])
                for c in chunk.get("choices", ()):
                    text.append(c["delta"].get("content") or "")
                    finish = c.get("finish_reason") or finish
                if any(c["delta"].get("content") for c in chunk.get("choices", ())):
                    now = time.perf_counter()
                    if last is None:
                        rec["ttft"] = now - t0
                    else:
                        rec["itl"].append(now - last)
                    last = now
        rec["e2e"] = time.perf_counter() - t0
        rec["ok"] = rec["ttft"] is not None
        rec["invalid"] = rec["ok"] and not answer_is_valid(schema, "".join(text), finish)
    except Exception as e:  # noqa: BLE001 - reported per request
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


def _usage_into(rec: dict, usage: dict) -> None:
    rec["tokens"] = usage["completion_tokens"]
    rec["prompt_tokens"] = usage.get("prompt_tokens", 0)
    rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def _drive(url: str, bodies: list[dict], stream: bool, concurrency: int | None, rate: float | None,
                 start_at: float, seed: int, until: float | None = None) -> tuple[list[dict], float, float]:
    import aiohttp
    prepare_validators(bodies)
    async with aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=600.0),
                                     connector=aiohttp.TCPConnector(limit=0)) as client:
        while time.time() < start_at:  # the workers start together
            await asyncio.sleep(min(0.01, max(start_at - time.time(), 0)))
        t0 = time.perf_counter()
        if concurrency is not None:
            out: list[dict] = []

            async def user():
                while until is None or time.time() < until:
                    i = _take_next()
                    if i >= len(bodies):
                        return
                    out.append(await _one(client, bodies[i], stream))
            await asyncio.gather(*(user() for _ in range(concurrency)))
        else:
            rng = random.Random(seed)
            tasks = []
            for body in bodies:
                tasks.append(asyncio.ensure_future(_one(client, body, stream)))
                await asyncio.sleep(rng.expovariate(rate))
            out = list(await asyncio.gather(*tasks))
        return out, t0, time.perf_counter()


_next_request = None  # in a client process: the index of the next request to send, shared by all


def _init_client(counter) -> None:
    global _next_request
    _next_request = counter


def _take_next() -> int:
    with _next_request.get_lock():
        i = _next_request.value
        _next_request.value = i + 1
    return i


def client_pool(processes: int):
    """The client processes. In max-concurrency mode they draw requests from one queue (a shared
    counter), as the in-process engine's closed loop does: with a share fixed per process, a
    process whose answers came out shorter ran out first and its clients sat idle while the others
    finished, so a server's batch thinned out before the engine's did on the same requests."""
    ctx = mp.get_context("spawn")
    counter = ctx.Value("q", 0)
    pool = ctx.Pool(processes, initializer=_init_client, initargs=(counter,))
    pool.next_request = counter
    return pool


def _worker(args) -> tuple[list[dict], float, float, float]:
    """A client process: its share of the clients (or of the arrival rate), with its own event loop.
    Returns its records, its first start / last end on the wall clock (`time.time`) and its CPU
    seconds."""
    wall0 = time.time() - time.perf_counter()
    cpu0 = time.process_time()
    recs, t0, t1 = asyncio.run(_drive(*args))
    return recs, wall0 + t0, wall0 + t1, time.process_time() - cpu0


def run_clients(pool, workers: int, url: str, bodies: list[dict], stream: bool, concurrency: int | None,
                rate: float | None, until: float | None = None) -> dict:
    """Drives one configuration from `workers` client processes; returns its summary. `until` (wall
    clock, max-concurrency mode): clients send no new request after it."""
    workers = max(1, min(workers, concurrency or workers, len(bodies)))
    if concurrency is not None:  # one queue: every process gets all the bodies and the counter deals them
        shares = [bodies] * workers
        with pool.next_request.get_lock():
            pool.next_request.value = 0
    else:
        shares = [bodies[i::workers] for i in range(workers)]
    conc = None if concurrency is None else [concurrency // workers + (i < concurrency % workers)
                                             for i in range(workers)]
    start_at = time.time() + 0.5
    jobs = [(url, shares[i], stream, None if conc is None else conc[i], None if rate is None else rate / workers,
             start_at, i, until) for i in range(workers)]
    results = pool.map(_worker, jobs)
    recs = [r for rs, _, _, _ in results for r in rs]
    duration = max(t1 for _, _, t1, _ in results) - min(t0 for _, t0, _, _ in results)
    return {**summarize(recs, duration, concurrency), "client_cpu_s": sum(cpu for *_, cpu in results)}


# -- statistics ---------------------------------------------------------------------------------------

def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def q(p):
        return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]
    return {"mean": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def summarize(recs: list[dict], duration: float, concurrency: int | None = None) -> dict:
    """`clients_idle` (max-concurrency mode): the share of the clients' time spent outside a request
    (between an answer and the next request, or out of requests while others finish): time the
    server was not given work through no fault of its own."""
    ok = [r for r in recs if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1 and r["e2e"] > r["ttft"]]
    errors = [r["error"] for r in recs if not r["ok"]]
    prompt_tokens = sum(r.get("prompt_tokens", 0) for r in ok)
    return {"prompt_tokens": prompt_tokens,
            "cached_share": sum(r.get("cached_tokens", 0) for r in ok) / prompt_tokens if prompt_tokens else None,
            "requests": len(recs), "ok": len(ok), "errors": len(errors), "first_errors": errors[:3],
            "invalid": sum(1 for r in ok if r.get("invalid")),
            "duration_s": duration, "req_s": len(ok) / duration if duration else 0.0,
            "out_tok_s": tokens / duration if duration else 0.0, "out_tokens": tokens,
            "ttft": percentiles([r["ttft"] for r in ok]), "tpot": percentiles(tpot),
            "itl": percentiles([x for r in ok for x in r["itl"]]), "e2e": percentiles([r["e2e"] for r in ok]),
            "clients_idle": (max(0.0, 1 - sum(r["e2e"] for r in ok) / (concurrency * duration))
                             if concurrency and duration else None)}


# -- the engine's side of a run: its decode steps per second, mean decode batch and idle share ---------
# Served below the engine means one of two things: fewer requests in each decode step than clients
# (the intake between one answer and the next request is slow: front-end, IPC, scheduling), or slower
# steps at the same batch (the engine process shares its time with something). These say which.

ENGINE_COUNTERS = {"decode_steps": "constrained_spec_engine_decode_steps_total",
                   "extend_steps": "constrained_spec_engine_extend_steps_total",
                   "decode_requests": "constrained_spec_engine_decode_requests_total",
                   "idle_seconds": "constrained_spec_engine_idle_seconds_total",
                   "first_tokens": "constrained_spec_engine_first_tokens_total",
                   "queue_seconds": "constrained_spec_engine_queue_seconds_total",
                   "prefill_seconds": "constrained_spec_engine_prefill_seconds_total",
                   "device_wait_seconds": "constrained_spec_engine_device_wait_seconds_total"}


def server_engine_counters(url: str) -> dict:
    """The engine counters a server's /metrics shows now, with the wall time they were read at
    (empty when it shows none)."""
    import urllib.request
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return {}
    by_name = {v: k for k, v in ENGINE_COUNTERS.items()}
    out = {"at": time.perf_counter()}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in by_name:
            out[by_name[name]] = float(value)
    return out if len(out) > len(ENGINE_COUNTERS) else {}


def engine_side(before: dict, after: dict, duration: float) -> dict | None:
    """What the engine did during a run whose clients were busy `duration` seconds, from its counters
    read before and after (a wider window: client start-up, the last answers' way back). Outside the
    clients' time no request exists, so the window's extra time is idle time; the idle share is of
    the clients' time, and steps per second are per busy second, so neither depends on the window."""
    if not before or not after or not duration:
        return None
    window = after["at"] - before["at"]
    idle = after["idle_seconds"] - before["idle_seconds"]
    steps = after["decode_steps"] - before["decode_steps"]
    busy = max(window - idle, 1e-9)
    firsts = after["first_tokens"] - before["first_tokens"]

    def mean_ms(key: str) -> float | None:  # a per-request mean over the requests that got a first token
        return (after[key] - before[key]) / firsts * 1e3 if firsts else None
    return {"busy_decode_steps_s": steps / busy,
            "queue_ms": mean_ms("queue_seconds"), "prefill_ms": mean_ms("prefill_seconds"),
            "busy_extend_steps_s": (after["extend_steps"] - before["extend_steps"]) / busy,
            "mean_decode_batch": (after["decode_requests"] - before["decode_requests"]) / steps if steps else 0.0,
            "idle_share": min(1.0, max(0.0, idle - max(0.0, window - duration)) / duration),
            # the share of the loop's busy time spent waiting for steps' results from the device
            "device_wait_share": (after["device_wait_seconds"] - before["device_wait_seconds"]) / busy
            if "device_wait_seconds" in after and "device_wait_seconds" in before else None,
            "window_s": window}


def engine_stats_counters(engine) -> dict:
    st = engine.stats
    return {"at": time.perf_counter(), "decode_steps": st.decode_steps, "extend_steps": st.extend_steps,
            "decode_requests": st.decode_requests, "idle_seconds": st.idle_total(), "first_tokens": st.first_tokens,
            "queue_seconds": st.queue_seconds, "prefill_seconds": st.prefill_seconds,
            "device_wait_seconds": st.device_wait_seconds}


# -- the in-process engine on the same requests --------------------------------------------------------

def answer_limits(n: int, first: int, max_tokens: int, spread: float) -> list[int]:
    """Each of n requests' max_tokens: `max_tokens`, or with `spread` > 0 drawn uniformly from
    [max_tokens * (1 - spread), max_tokens], seeded by the requests' first number (so every server and
    the engine get the same). Random weights answer until max_tokens: without a spread, clients admitted
    together finish together and come back together, a lockstep real answers' varied lengths break."""
    if spread <= 0:
        return [max_tokens] * n
    rng = random.Random(first)
    low = max(1, round(max_tokens * (1 - spread)))
    return [rng.randint(low, max_tokens) for _ in range(n)]


def engine_closed_loop(engine, jobs: list[Job], limits: list[int], concurrency: int) -> dict:
    """The jobs through `Engine.add_request` with `concurrency` in flight (a new one as one ends),
    as the HTTP clients send them: the engine's throughput on the same requests. limits[i]: job i's
    max_tokens."""
    from constrained_spec import SamplingParams
    from constrained_spec.grammar import GrammarSpec

    prepared = []
    for job, max_tokens in zip(jobs, limits, strict=True):
        prompt = engine.chat_prompt(job.messages)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=job.ignore_eos)
        grammar = GrammarSpec.json_schema(job.schema) if job.schema is not None else None
        prepared.append((prompt, params, grammar))
    done = threading.Semaphore(0)
    recs: list[dict] = []

    def submit(i: int) -> None:
        t0 = time.perf_counter()
        rec = {"ok": True, "ttft": None, "e2e": None, "itl": [], "tokens": 0, "error": None}

        def on_output(out):
            if rec["ttft"] is None and out.new_token_ids:
                rec["ttft"] = time.perf_counter() - t0
            if out.finished:
                rec["e2e"] = time.perf_counter() - t0
                rec["tokens"] = out.completion_tokens
                rec["ok"] = out.finish_reason.value in ("stop", "length") and rec["ttft"] is not None
                rec["error"] = out.error
                recs.append(rec)
                done.release()
        prompt, params, grammar = prepared[i]
        # token ids only and the answer whole, as the engine process runs a non-streamed request for
        # the server (its front-ends detokenize)
        engine.add_request(prompt, params, grammar, on_output, detokenize=False, each_step=False)

    t0 = time.perf_counter()
    nxt = 0
    for _ in range(min(concurrency, len(prepared))):
        submit(nxt)
        nxt += 1
    for _ in range(len(prepared)):
        done.acquire()
        if nxt < len(prepared):
            submit(nxt)
            nxt += 1
    return summarize(recs, time.perf_counter() - t0, concurrency)


# -- servers ------------------------------------------------------------------------------------------

def server_flags(name: str) -> list[str]:
    """`serve` flags of a server layout: split (the default), split-N (N front-ends), single; a
    `+nocache` suffix turns the prefix cache off (the A/B arm)."""
    if name.endswith("+nocache"):
        return server_flags(name[:-len("+nocache")]) + ["--disable-prefix-cache"]
    if name == "split":
        return []
    if name == "single":
        return ["--single-process"]
    if name.startswith("split-") and name[6:].isdigit():
        return ["--frontends", name[6:]]
    raise SystemExit(f"unknown server {name!r} (split, split-N, single; each with an optional +nocache)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`constrained-spec serve` as a subprocess on a free port, until `stop()`."""

    def __init__(self, model: str, device: str, extra: list[str], log_path: Path, ready_timeout_s: float = 900):
        import httpx
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "constrained_spec.cli", "serve", "--model", model, "--device", device,
               "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", MODEL_ID,
               "--log-level", "warning", *extra]
        self.log_path = log_path
        self._log = open(log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); log {log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > ready_timeout_s:
                self.stop()
                raise TimeoutError(f"server not ready in {ready_timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)
        from constrained_spec.server.runner import wait_for_frontends
        wait_for_frontends(self.url)  # the whole server: front-ends past the first join as they start
        self.ready_s = time.perf_counter() - t0

    def log_tail(self, n: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


# -- reporting ----------------------------------------------------------------------------------------

def _spread_note(spread: float) -> str:
    return f" (each request's limit drawn from the top {spread:.0%} of that, the same for every server)" if spread else ""


def _ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.0f}" if x >= 0.1 else f"{1000 * x:.1f}"


def _tok(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def report(payload: dict) -> str:
    runs, engine = payload["runs"], payload["engine"]

    def rounds(server, workload, stream, mode, value) -> list[dict]:
        return [r for r in runs
                if (r["server"], r["workload"], r["stream"], r["mode"], r["value"]) == (server, workload, stream, mode, value)]

    def find(server, workload, stream, mode, value):
        """The run of a configuration (with --interleave, the one of median tok/s)."""
        found = sorted(rounds(server, workload, stream, mode, value), key=lambda r: r["out_tok_s"])
        return found[(len(found) - 1) // 2] if found else None

    def eng(workload, clients):
        for r in engine:
            if (r["workload"], r["clients"]) == (workload, clients):
                return r
        return None

    servers = payload["servers"]
    lines = [f"# Serving benchmark", "",
             f"Model {payload['model_name']} on {payload['device']} ({payload['machine'].get('gpu') or payload['machine'].get('cpu', '')}), "
             f"greedy, up to {payload['max_tokens']} output tokens a request"
             f"{_spread_note(payload.get('max_tokens_spread', 0))} (`plain` ignores EOS), "
             f"{payload['rounds']} requests per client per configuration; command: `{payload['command']}`.", "",
             "## Max concurrency: served vs the in-process engine on the same requests", "",
             "tok/s is output tokens per second over the run; served / engine compares each server with the "
             "in-process engine at the same concurrency; TTFT / ITL / E2E in ms.", ""]
    head = ["workload", "stream", "clients", "engine tok/s"]
    for s in servers:
        head += [f"{s} tok/s", f"{s} / engine", f"{s} TTFT p50", f"{s} TTFT p99", f"{s} TPOT p50",
                 f"{s} ITL p99", f"{s} E2E p99", f"{s} errors / invalid"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in payload["workloads"]:
        for stream in payload["streams"]:
            for c in payload["clients"]:
                e = eng(w, c)
                row = [w, "yes" if stream else "no", str(c), _tok(e and e["out_tok_s"])]
                for s in servers:
                    r = find(s, w, stream, "clients", c)
                    if r is None:
                        row += ["-"] * 8
                        continue
                    row += [_tok(r["out_tok_s"]), _ratio(r["out_tok_s"], e and e["out_tok_s"]), _ms(r["ttft"]["p50"]),
                            _ms(r["ttft"]["p99"]), _ms(r["tpot"]["p50"]), _ms(r["itl"]["p99"]), _ms(r["e2e"]["p99"]),
                            f"{r['errors']} / {r['invalid']}"]
                lines.append("| " + " | ".join(row) + " |")
    sides = [(w, st, c, s) for w in payload["workloads"] for st in payload["streams"] for c in payload["clients"]
             for s in ["engine"] + servers]
    if any(((eng(w, c) if s == "engine" else find(s, w, st, "clients", c)) or {}).get("engine_side")
           for w, st, c, s in sides):
        lines += ["", "## The engine's side of each run", "",
                  "Decode and prefill (extend) steps per second the engine loop was busy, the mean number of "
                  "requests in a decode step, and the share of the clients' time the loop sat idle: a server below "
                  "the engine with fewer requests a step, or idle time, is slow to take the next request in (its "
                  "arrivals also spread over more prefills); one with fewer busy steps a second slows the engine "
                  "itself. Clients idle: the share of the clients' time outside a request (between an answer and "
                  "the next request, or out of work while the last requests finish). Queue and prefill: a request's "
                  "mean time in the engine from arrival to admission, and from admission to its first token (the "
                  "engine's part of TTFT; the rest of the clients' TTFT is the front-end's and the transport's).", "",
                  "| workload | stream | clients | " + " | ".join(
                      f"{s} steps/s | {s} batch | {s} prefills/s | {s} idle | {s} clients idle | {s} queue ms | "
                      f"{s} prefill ms" for s in ["engine"] + servers) + " |",
                  "|" + "---|" * (3 + 7 * (1 + len(servers)))]
        for w in payload["workloads"]:
            for st in payload["streams"]:
                for c in payload["clients"]:
                    row = [w, "yes" if st else "no", str(c)]
                    for s in ["engine"] + servers:
                        r = eng(w, c) if s == "engine" else find(s, w, st, "clients", c)
                        side = (r or {}).get("engine_side")
                        idle = (r or {}).get("clients_idle")
                        row += (["-"] * 4 if not side else
                                [f"{side['busy_decode_steps_s']:,.0f}", f"{side['mean_decode_batch']:.1f}",
                                 f"{side['busy_extend_steps_s']:,.0f}", f"{side['idle_share']:.0%}"])
                        row.append("-" if idle is None else f"{idle:.0%}")
                        row += ["-" if not side or side.get(k) is None else f"{side[k]:.2f}"
                                for k in ("queue_ms", "prefill_ms")]
                    lines.append("| " + " | ".join(row) + " |")
    lines += _cpu_table(payload, find, eng)
    if True in payload["streams"] and False in payload["streams"]:
        lines += ["", "## Streamed / non-streamed output tok/s", "",
                  "| workload | clients | " + " | ".join(servers) + " |", "|" + "---|" * (2 + len(servers))]
        for w in payload["workloads"]:
            for c in payload["clients"]:
                cells = []
                for s in servers:
                    a, b = find(s, w, True, "clients", c), find(s, w, False, "clients", c)
                    cells.append(_ratio(a and a["out_tok_s"], b and b["out_tok_s"]))
                lines.append(f"| {w} | {c} | " + " | ".join(cells) + " |")
    pairs = [(s, s + "+nocache") for s in servers if s + "+nocache" in servers]
    if pairs:
        lines += ["", "## Prefix cache on / off", "",
                  "Each server against itself with `--disable-prefix-cache` (`+nocache`), same requests: TTFT p50 "
                  "off / on (how many times lower with the cache), output tok/s on / off, the share of prompt "
                  "tokens the cache served, the engine loop thread's CPU time per step (decode or prefill) on / "
                  "off, and the share of its busy time it waited for steps' results from the device on / off. "
                  "Host work the cache adds to a step shows in the CPU time; it slows the steps where the loop "
                  "hardly waits for the device (the thread's CPU time counts that wait too: CUDA spins).", "",
                  "| server | workload | stream | clients | TTFT p50 on | TTFT p50 off | TTFT off / on | tok/s on "
                  "| tok/s off | tok/s on / off | cached share | loop CPU us/step on | loop CPU us/step off "
                  "| device wait on | device wait off |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for on, off in pairs:
            for w in payload["workloads"]:
                for stream in payload["streams"]:
                    for c in payload["clients"]:
                        a, b = find(on, w, stream, "clients", c), find(off, w, stream, "clients", c)
                        if a is None or b is None:
                            continue
                        share = a.get("cached_share")
                        paired = _paired_ratios(rounds(on, w, stream, "clients", c), rounds(off, w, stream, "clients", c))
                        ratio = _ratio(a["out_tok_s"], b["out_tok_s"]) if len(paired) < 2 else (
                            f"{statistics.median(paired):.2f} (rounds: {', '.join(f'{x:.2f}' for x in paired)})")
                        lines.append(f"| {on} | {w} | {'yes' if stream else 'no'} | {c} | {_ms(a['ttft']['p50'])} "
                                     f"| {_ms(b['ttft']['p50'])} | {_ratio(b['ttft']['p50'], a['ttft']['p50'])} "
                                     f"| {_tok(a['out_tok_s'])} | {_tok(b['out_tok_s'])} | {ratio} "
                                     f"| {'-' if share is None else f'{share:.2f}'} "
                                     f"| {_us(_loop_cpu_per_step(a))} | {_us(_loop_cpu_per_step(b))} "
                                     f"| {_share(a)} | {_share(b)} |")
    if payload["rates"]:
        lines += ["", f"## Request rate (Poisson arrivals; {payload['rate_workload']}, not streamed)", "",
                  "| server | rate req/s | served req/s | tok/s | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 | errors / invalid |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for s in servers:
            for rate in payload["rates"]:
                r = find(s, payload["rate_workload"], False, "rate", rate)
                if r is not None:
                    lines.append(f"| {s} | {rate:g} | {r['req_s']:.1f} | {_tok(r['out_tok_s'])} | {_ms(r['ttft']['p50'])} "
                                 f"| {_ms(r['ttft']['p99'])} | {_ms(r['e2e']['p50'])} | {_ms(r['e2e']['p99'])} "
                                 f"| {r['errors']} / {r['invalid']} |")
    return "\n".join(lines) + "\n"


def _loop_cpu_per_step(run: dict) -> float | None:
    """The engine loop thread's CPU seconds per engine step (decode or extend) over a run: its CPU
    seconds per second of the clients' time over the steps it ran per second of that time."""
    side, busy = run.get("engine_side"), run.get("cores_busy")
    if not side or not busy or "engine loop" not in busy:
        return None
    steps_s = (side["busy_decode_steps_s"] + side["busy_extend_steps_s"]) * (1.0 - side["idle_share"])
    return busy["engine loop"] / steps_s if steps_s > 0 else None


def _share(run: dict) -> str:
    """The engine loop's device-wait share of a run, as a percentage."""
    share = (run.get("engine_side") or {}).get("device_wait_share")
    return "-" if share is None else f"{share:.0%}"


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:,.0f}"


def _paired_ratios(on: list[dict], off: list[dict]) -> list[float]:
    """tok/s on / off of each round both arms ran (`--interleave`)."""
    off_by_round = {r.get("repeat", 0): r["out_tok_s"] for r in off}
    return [r["out_tok_s"] / off_by_round[r.get("repeat", 0)] for r in sorted(on, key=lambda r: r.get("repeat", 0))
            if off_by_round.get(r.get("repeat", 0))]


def _cpu_table(payload: dict, find, eng) -> list[str]:
    """Cores busy by role in each max-concurrency run (`cpu_time.py`)."""
    rows = []
    for w in payload["workloads"]:
        for st in payload["streams"]:
            for c in payload["clients"]:
                for s in ["engine"] + payload["servers"]:
                    r = eng(w, c) if s == "engine" else find(s, w, st, "clients", c)
                    busy = (r or {}).get("cores_busy")
                    if busy and (s != "engine" or st == payload["streams"][0]):  # the engine has no stream arm
                        rows.append([w, "-" if s == "engine" else "yes" if st else "no", str(c), s]
                                    + [f"{busy.get(role, 0.0):.1f}" for role in cpu_time.ROLES])
    if not rows:
        return []
    cores = payload["machine"].get("cpu_count") or os.cpu_count()
    return ["", "## CPU cores busy", "",
            f"CPU seconds per second of each run (its clients' first request to their last answer), by role ({cores} cores on the host): the engine loop "
            "thread (on the CPU, with the torch threads it runs the model on), the grammar mask threads, the rest of the engine process (the single-process server's "
            "HTTP work included), the front-end processes, the client processes, and the whole host (every "
            "process, the kernel's work for them included). A host figure near its core count: the run "
            "was short of CPU.", "",
            "| workload | stream | clients | server | " + " | ".join(cpu_time.ROLES) + " |",
            "|" + "---|" * (4 + len(cpu_time.ROLES))] + ["| " + " | ".join(row) + " |" for row in rows]


def plot(payload: dict, path: Path) -> int | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    if not payload["rates"]:
        return _plot_concurrency(payload, path, plt)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    drawn = 0
    for s in payload["servers"]:
        rs = [r for r in payload["runs"] if r["server"] == s and r["mode"] == "rate"
              and r["workload"] == payload["rate_workload"]]
        rs.sort(key=lambda r: r["value"])
        drawn += len(rs)
        xs = [r["value"] for r in rs]
        ax1.plot(xs, [r["out_tok_s"] for r in rs], marker="o", label=s)
        ax2.plot(xs, [1000 * (r["e2e"]["p99"] or 0) for r in rs], marker="o", label=f"{s} E2E p99")
        ax2.plot(xs, [1000 * (r["ttft"]["p99"] or 0) for r in rs], marker="x", linestyle="--", label=f"{s} TTFT p99")
    ax1.set_xlabel("request rate (req/s)")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("throughput")
    ax2.set_xlabel("request rate (req/s)")
    ax2.set_ylabel("ms")
    ax2.set_title("p99 latency")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"bench_serving: {payload['rate_workload']} on {payload['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return drawn


def _median_client_run(payload: dict, server: str, workload: str, stream: bool, clients: int) -> dict | None:
    """The run of median tok/s of a configuration (one per round with --interleave)."""
    found = sorted((r for r in payload["runs"] if (r["server"], r["workload"], r["stream"], r["mode"], r["value"])
                    == (server, workload, stream, "clients", clients)), key=lambda r: r["out_tok_s"])
    return found[(len(found) - 1) // 2] if found else None


def _plot_concurrency(payload: dict, path: Path, plt) -> int:
    """Without request rates: output tok/s (the servers, and the engine) and TTFT against the number
    of clients, per workload; with one number of clients (an A/B such as the prefix cache's), bars per
    workload and server. Non-streamed runs where there are any, else streamed. Returns the number of
    values drawn."""
    clients = payload["clients"]
    stream = not any(not r["stream"] for r in payload["runs"] if r["mode"] == "clients")
    how = "streamed" if stream else "non-streamed"
    ttft = "p50" if stream else "p99"  # non-streamed, TTFT is the whole answer
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    drawn = 0
    if len(clients) == 1:
        c, workloads = clients[0], payload["workloads"]
        engine = {r["workload"]: r for r in payload["engine"] if r["clients"] == c}
        servers = payload["servers"] + (["engine"] if engine else [])
        width = 0.8 / len(servers)
        for k, srv in enumerate(servers):
            runs = [engine.get(w) if srv == "engine" else _median_client_run(payload, srv, w, stream, c)
                    for w in workloads]
            xs = [i + (k - (len(servers) - 1) / 2) * width for i in range(len(workloads))]
            tok = [r["out_tok_s"] if r else 0 for r in runs]
            ax1.bar(xs, tok, width, label=srv)
            if srv != "engine":  # the in-process engine's runs time no TTFT over HTTP
                ax2.bar(xs, [1000 * (r["ttft"][ttft] or 0) if r else 0 for r in runs], width, label=srv)
            drawn += sum(r is not None for r in runs)
        for ax in (ax1, ax2):
            ax.set_xticks(range(len(workloads)), workloads)
            ax.set_xlabel(f"workload ({c} clients)")
    else:
        for w in payload["workloads"]:
            eng = {r["clients"]: r for r in payload["engine"] if r["workload"] == w}
            ax1.plot(clients, [eng[c]["out_tok_s"] if c in eng else None for c in clients], marker="s",
                     linestyle=":", label=f"{w}: engine")
            for srv in payload["servers"]:
                runs = [_median_client_run(payload, srv, w, stream, c) for c in clients]
                ax1.plot(clients, [r["out_tok_s"] if r else None for r in runs], marker="o", label=f"{w}: {srv}")
                ax2.plot(clients, [1000 * (r["ttft"][ttft] or 0) if r else None for r in runs], marker="o",
                         label=f"{w}: {srv}")
                drawn += sum(r is not None for r in runs)
        for ax in (ax1, ax2):
            ax.set_xlabel("concurrent clients")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title(f"throughput ({how})")
    ax2.set_ylabel("ms")
    ax2.set_title(f"TTFT {ttft} ({how})")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"bench_serving on {payload['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return drawn


# -- main ---------------------------------------------------------------------------------------------

def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct, $SMOLLM2_GGUF if set)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workloads", default="plain,json",
                    help="comma list of plain, json, schemas, shared-prefix, multi-turn, distinct")
    ap.add_argument("--clients", default="1,64,128", help="max-concurrency levels")
    ap.add_argument("--stream", default="both", choices=["no", "yes", "both"])
    ap.add_argument("--rates", default="32,64,128,256", help="Poisson request rates (req/s); empty: none")
    ap.add_argument("--rate-workload", default="json")
    ap.add_argument("--rate-seconds", type=float, default=3.0, help="requests per rate: rate x this (at least 16)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-tokens-spread", type=float, default=0.0, metavar="F",
                    help="each request's max_tokens drawn from [max-tokens x (1 - F), max-tokens] (seeded, the "
                         "same for every server): answers of varied lengths, as real weights give, with random ones")
    ap.add_argument("--rounds", type=int, default=3, help="requests per client in max-concurrency mode "
                                                          "(at least 32 requests a configuration: a shorter run at "
                                                          "one client is over in a second, where one answer counts)")
    ap.add_argument("--servers", default="split,single",
                    help="split (`serve`), split-N (`serve --frontends N`), single (`serve --single-process`)")
    ap.add_argument("--no-engine", action="store_true", help="skip the in-process engine runs")
    ap.add_argument("--server-args", default="", help="more `serve` flags for both servers")
    ap.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 4)),
                    help="client processes (default: a quarter of the cores, 1 to 8)")
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default="bench_serving", help="results file name (.json, .md, .png)")
    ap.add_argument("--interleave", type=int, default=1,
                    help="N > 1: all servers up at once, each max-concurrency configuration run N times, "
                         "the servers in turn (paired A/B rounds)")
    args = ap.parse_args(argv)
    if not 0 <= args.max_tokens_spread < 1:
        ap.error("--max-tokens-spread must lie in [0, 1)")

    from constrained_spec.models import resolve_model_path
    model = resolve_model_path(args.model)
    workloads = [w for w in args.workloads.split(",") if w]
    clients = _ints(args.clients)
    streams = {"no": [False], "yes": [True], "both": [False, True]}[args.stream]
    rates = [float(r) for r in args.rates.split(",") if r]
    servers = [s for s in args.servers.split(",") if s]
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    from common import machine

    def n_requests(c: int) -> int:
        return max(32, args.rounds * c)

    payload = {"model": model, "device": args.device, "machine": machine(), "max_tokens": args.max_tokens,
               "max_tokens_spread": args.max_tokens_spread,
               "rounds": args.rounds, "workloads": workloads, "clients": clients, "streams": streams,
               "rates": rates, "rate_workload": args.rate_workload, "servers": servers, "interleave": args.interleave,
               "command": "python benchmarks/bench_serving.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "runs": [], "engine": [], "server_ready_s": {}}

    pool = client_pool(args.client_procs)

    def start(name: str) -> Server:
        extra = args.server_args.split() + server_flags(name)
        if args.interleave > 1 and args.device != "cpu" and "--kv-cache-memory-gb" not in extra:
            extra += ["--kv-cache-memory-gb", str(max(2, 48 // len(servers)))]  # all of them on one GPU
        server = Server(model, args.device, extra, Path(tempfile.gettempdir()) / f"bench_serving_{name}.log")
        payload["server_ready_s"][name] = server.ready_s
        print(f"[{name}] ready in {server.ready_s:.1f} s at {server.url}", flush=True)
        for w in sorted(set(workloads) | ({args.rate_workload} if rates else set())):
            warm = [j.body(16, False) for j in make_jobs(w, max(clients), first=10**9)]
            run_clients(pool, args.client_procs, server.url, warm, False, max(clients), None)
        return server

    def run_config(name: str, server: Server, w: str, stream: bool, c: int, rep: int) -> None:
        # requests of their own per configuration and round (a workload of distinct prompts or
        # conversations must not find an earlier round's in the cache); the servers of a round share them
        first = 10**5 * (configs.index((w, stream, c)) * args.interleave + rep)
        limits = answer_limits(n_requests(c), first, args.max_tokens, args.max_tokens_spread)
        bodies = [j.body(m, stream) for j, m in zip(make_jobs(w, n_requests(c), first=first), limits)]
        before = server_engine_counters(server.url)
        cpu0 = cpu_time.snapshot(server.proc.pid)
        r = run_clients(pool, args.client_procs, server.url, bodies, stream, c, None)
        r["cores_busy"] = cpu_time.cores_busy(cpu0, cpu_time.snapshot(server.proc.pid),
                                              r["client_cpu_s"], r["duration_s"])
        r["engine_side"] = engine_side(before, server_engine_counters(server.url), r["duration_s"])
        payload["runs"].append({"server": name, "workload": w, "stream": stream, "mode": "clients",
                                "value": c, "repeat": rep, **r})
        print(f"[{name}] {w} stream={stream} c={c}{f' round {rep}' if args.interleave > 1 else ''}: "
              f"{r['out_tok_s']:,.0f} tok/s, TTFT p99 {_ms(r['ttft']['p99'])} ms, invalid {r['invalid']}, "
              f"errors {r['errors']} {r['first_errors']}", flush=True)

    def run_rates(name: str, server: Server) -> None:
        for rate in rates:
            n = max(16, int(rate * args.rate_seconds))
            limits = answer_limits(n, 0, args.max_tokens, args.max_tokens_spread)
            bodies = [j.body(m, False) for j, m in zip(make_jobs(args.rate_workload, n), limits)]
            r = run_clients(pool, args.client_procs, server.url, bodies, False, None, rate)
            payload["runs"].append({"server": name, "workload": args.rate_workload, "stream": False,
                                    "mode": "rate", "value": rate, **r})
            print(f"[{name}] rate {rate:g}: {r['req_s']:.1f} req/s, {r['out_tok_s']:,.0f} tok/s, "
                  f"E2E p99 {_ms(r['e2e']['p99'])} ms, errors {r['errors']}", flush=True)

    configs = [(w, stream, c) for w in workloads for stream in streams for c in clients]
    try:
        if args.interleave > 1:
            up: dict[str, Server] = {}
            try:
                for name in servers:
                    up[name] = start(name)
                for w, stream, c in configs:
                    for rep in range(args.interleave):
                        for name in (servers if rep % 2 == 0 else servers[::-1]):
                            run_config(name, up[name], w, stream, c, rep)
                for name in servers:
                    run_rates(name, up[name])
            finally:
                for server in up.values():
                    server.stop()
        else:
            for name in servers:
                server = start(name)
                try:
                    for w, stream, c in configs:
                        run_config(name, server, w, stream, c, 0)
                    run_rates(name, server)
                finally:
                    server.stop()
    finally:
        pool.close()
        pool.join()

    # the in-process engine last: the servers' engines had the GPU to themselves
    if not args.no_engine:
        from constrained_spec.cli import build_parser, engine_config_from_args
        from constrained_spec.engine import Engine
        t0 = time.perf_counter()  # the servers' engine options, parsed as `serve` parses them
        serve_args = build_parser().parse_args(["serve", "--model", model, "--device", args.device,
                                                *args.server_args.split()])
        engine = Engine(engine_config_from_args(serve_args))
        print(f"engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
        payload["model_name"] = engine.model_name
        try:
            for w in workloads:
                engine_closed_loop(engine, make_jobs(w, max(clients), first=10**9), [16] * max(clients),
                                   max(clients))  # warm-up
                for c in clients:
                    before = engine_stats_counters(engine)
                    cpu0 = cpu_time.snapshot(os.getpid())
                    first = 10**5 * configs.index((w, streams[0], c)) * args.interleave  # the servers' first round's
                    limits = answer_limits(n_requests(c), first, args.max_tokens, args.max_tokens_spread)
                    r = engine_closed_loop(engine, make_jobs(w, n_requests(c), first=first), limits, c)
                    r["cores_busy"] = cpu_time.cores_busy(cpu0, cpu_time.snapshot(os.getpid()), 0.0, r["duration_s"])
                    r["engine_side"] = engine_side(before, engine_stats_counters(engine), r["duration_s"])
                    payload["engine"].append({"workload": w, "clients": c, **r})
                    print(f"[engine] {w} c={c}: {r['out_tok_s']:,.0f} tok/s, {r['req_s']:.1f} req/s", flush=True)
        finally:
            engine.shutdown()

    payload.setdefault("model_name", os.path.basename(model))
    md = report(payload)
    (results_dir / f"{args.name}.json").write_text(json.dumps(payload, indent=2))
    (results_dir / f"{args.name}.md").write_text(md)
    plot(payload, results_dir / f"{args.name}.png")
    print(md)
    failed = sum(r["errors"] + r["invalid"] for r in payload["runs"]) + sum(r["errors"] for r in payload["engine"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

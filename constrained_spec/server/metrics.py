"""Prometheus metrics for /metrics. Each app gets its own registry (several apps may share one engine
in one process, as the tests do). The engine's part is a snapshot of plain values
(`engine_snapshot`), taken in the engine's process, so the front-end process renders it alike.
With several front-end processes (`frontends.py`), their counters live in prometheus_client's
multiprocess files and any front-end's /metrics renders all of them."""
from __future__ import annotations

import time

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

PREFIX = "constrained_spec"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


def engine_snapshot(engine) -> dict:
    """The engine's live state in plain values (read at scrape time; the engine process sends it to
    its front-ends the same way): requests, KV slots, grammar compile and mask counters, and the
    speculative-decoding statistics."""
    sched = engine.scheduler
    pool = engine.runner.pool
    stats = engine.stats
    snap = {"running": len(sched.running), "waiting": len(sched.waiting) + engine.num_compiling(),
            "kv_capacity": pool.capacity, "kv_free": pool.num_free,
            "grammar": engine.grammar.stats,
            "steps": stats.steps, "decode_steps": stats.decode_steps, "extend_steps": stats.extend_steps,
            "decode_requests": stats.decode_requests,
            "idle_seconds": stats.idle_total(), "grammar_mask_seconds": stats.grammar_mask_seconds,
            "first_tokens": stats.first_tokens, "queue_seconds": stats.queue_seconds,
            "prefill_seconds": stats.prefill_seconds, "device_wait_seconds": stats.device_wait_seconds,
            "grammar_end_violations": stats.grammar_end_violations,
            "grammar_accept_seconds": stats.grammar_accept_seconds, "spec": None,
            "prefix_cache": None if engine.runner.prefix_cache is None else engine.runner.prefix_cache.snapshot()}
    st = getattr(engine.spec, "stats", None) if engine.spec is not None else None
    if st is not None:
        snap["spec"] = spec_snapshot(st)
    return snap


def spec_snapshot(st) -> dict:
    """A drafter's `SpecStats` in plain values (what crosses the process boundary)."""
    return {"steps": st.steps, "verified_requests": st.verified_requests,
            "accepted_tokens": st.accepted_tokens, "forced_draft_tokens": st.forced_draft_tokens,
            "failed_steps": st.failed_steps,
            "mean_accepted": float(st.mean_accepted), "phase_seconds": dict(st.phase_seconds()),
            "histogram": list(st.histogram)}


class _EngineCollector:
    """Renders the engine snapshot taken for this scrape (`ServerMetrics.render(snapshot)`)."""

    def __init__(self, server_state):
        self.server_state = server_state
        self.snapshot: dict | None = None

    def collect(self):
        snap = self.snapshot
        if snap is None:
            return
        g = GaugeMetricFamily(f"{PREFIX}_requests_running", "Requests in the running batch")
        g.add_metric([], snap["running"])
        yield g
        g = GaugeMetricFamily(f"{PREFIX}_requests_waiting", "Requests queued (waiting for KV or a grammar compile)")
        g.add_metric([], snap["waiting"])
        yield g
        cap, free = snap["kv_capacity"], snap["kv_free"]
        g = GaugeMetricFamily(f"{PREFIX}_kv_slots_total", "KV-cache token slots")
        g.add_metric([], cap)
        yield g
        g = GaugeMetricFamily(f"{PREFIX}_kv_slots_used", "KV-cache token slots in use")
        g.add_metric([], cap - free)
        yield g
        g = GaugeMetricFamily(f"{PREFIX}_kv_usage_ratio", "Fraction of KV-cache slots in use (0..1)")
        g.add_metric([], (cap - free) / cap if cap else 0.0)
        yield g
        gstats = snap["grammar"]
        if isinstance(gstats, dict):
            c = CounterMetricFamily(f"{PREFIX}_grammar_compile_seconds", "Time spent compiling grammars")
            c.add_metric([], float(gstats.get("compile_seconds_total", 0.0)))
            yield c
            c = CounterMetricFamily(f"{PREFIX}_grammar_compiles", "Grammars compiled (cache misses)")
            c.add_metric([], float(gstats.get("compile_count", 0)))
            yield c
            c = CounterMetricFamily(f"{PREFIX}_grammar_compiles_by_backend",
                                    "Grammars compiled, by the backend that enforces them (--grammar-backend)",
                                    labels=["backend"])
            for backend in ("xgrammar", "llguidance"):
                c.add_metric([backend], float(gstats.get(f"served_by_{backend}", 0)))
            yield c
            c = CounterMetricFamily(f"{PREFIX}_grammar_llguidance_fallbacks",
                                    "JSON schemas llguidance refused that auto handed to the normalizer + xgrammar")
            c.add_metric([], float(gstats.get("llguidance_fallbacks", 0)))
            yield c
            c = CounterMetricFamily(f"{PREFIX}_grammar_dead_branches_pruned",
                                    "Grammars compiled without alternatives that can never end (dead branches)")
            c.add_metric([], float(gstats.get("dead_branches_pruned", 0)))
            yield c
            c = CounterMetricFamily(f"{PREFIX}_grammar_cache_hits", "Grammar compile-cache hits")
            c.add_metric([], float(gstats.get("cache_hits", 0)))
            yield c
            yield from _compile_metrics(gstats)
        for name, key, doc in _ENGINE_COUNTERS:
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            c.add_metric([], float(snap[key]))
            yield c
        yield from _spec_metrics(snap["spec"])
        yield from _prefix_cache_metrics(snap.get("prefix_cache"))
        stored = snap.get("stored_responses")
        if stored is not None:
            for name, key, doc in (("stored_responses", "responses",
                                    "Responses stored for GET /v1/responses/{id} and previous_response_id"),
                                   ("stored_responses_bytes", "bytes", "Bytes of the stored responses' JSON")):
                g = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
                g.add_metric([], float(stored[key]))
                yield g


# (metric name, engine snapshot key, help): counters read from the engine snapshot as they are
_ENGINE_COUNTERS = [
    ("engine_steps", "steps", "Engine steps (prefill and decode)"),
    ("engine_decode_steps", "decode_steps", "Engine decode steps"),
    ("engine_extend_steps", "extend_steps", "Engine prefill (extend) steps"),
    ("engine_decode_requests", "decode_requests",
     "Requests summed over decode steps (/ decode steps: the mean decode batch)"),
    ("engine_idle_seconds", "idle_seconds", "Time the engine loop waited with no work"),
    ("engine_device_wait_seconds", "device_wait_seconds",
     "Time the engine loop waited for steps' results from the device (near none: the host paces the steps)"),
    ("engine_first_tokens", "first_tokens", "Requests that got their first token"),
    ("engine_queue_seconds", "queue_seconds",
     "Time those requests waited in the engine before admission, summed (/ engine_first_tokens: the mean)"),
    ("engine_prefill_seconds", "prefill_seconds",
     "Time those requests took from admission to their first token, summed (/ engine_first_tokens: the mean)"),
    ("grammar_mask_seconds", "grammar_mask_seconds", "Time spent filling grammar bitmasks"),
    ("grammar_end_violations", "grammar_end_violations",
     "Requests that ended where their grammar could not end (an engine bug; answered as errors)"),
    ("grammar_accept_seconds", "grammar_accept_seconds",
     "Time spent accepting decode steps' tokens into grammar matchers"),
]


def _prefix_cache_metrics(pc: dict | None):
    """Prefix caching (engine/prefix_cache.py): prompt tokens served from the cache, the hit rate,
    evictions, the tree's size, and whether finished requests are all cached or only a sample
    (`PrefixCache.release`). Absent with --disable-prefix-cache."""
    if pc is None:
        return
    for name, key, doc in (("prefix_cache_hit_tokens", "hit_tokens", "Prompt tokens whose K/V came from the prefix cache"),
                           ("prefix_cache_lookup_tokens", "lookup_tokens",
                            "Prompt tokens of admitted requests (the hit rate's denominator)"),
                           ("prefix_cache_evicted_tokens", "evicted_tokens",
                            "Cached tokens evicted to make room in the KV pool"),
                           ("prefix_cache_unfiled_requests", "unfiled_requests",
                            "Finished requests whose context was freed, not cached, while the cache missed")):
        c = CounterMetricFamily(f"{PREFIX}_{name}", doc)
        c.add_metric([], float(pc[key]))
        yield c
    for name, key, doc in (("prefix_cache_hit_rate", "hit_rate", "Cached share of admitted prompt tokens (0..1)"),
                           ("prefix_cache_tokens", "tree_tokens", "Tokens (KV slots) held by the prefix cache"),
                           ("prefix_cache_evictable_tokens", "evictable_tokens",
                            "Of those, tokens no running request uses (free for eviction)"),
                           ("prefix_cache_filing", "filing",
                            "1 while every finished request is cached; 0 while the cache misses and only a "
                            "sample is")):
        g = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
        g.add_metric([], float(pc[key]))
        yield g


def _compile_metrics(gstats: dict):
    """The compile queue: depth, waits, compile times and timeouts (GrammarBackend.stats)."""
    for name, key, doc in (("grammar_compile_queue_depth", "queue_depth", "Grammars waiting for a compile thread"),
                           ("grammar_compiles_running", "compiling", "Grammars being compiled now"),
                           ("grammar_cache_bytes", "cache_bytes",
                            "Memory of the compiled grammars cached (xgrammar's measure, llguidance's estimate) "
                            "and of the texts they hold")):
        g = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
        g.add_metric([], float(gstats.get(key, 0)))
        yield g
    for name, key, doc in (("grammar_compile_timeouts", "compile_timeouts",
                            "Compiles that ran past the compile timeout (their requests got a 400)"),
                           ("grammar_compile_queue_timeouts", "queue_timeouts",
                            "Requests whose grammar waited in the compile queue past twice the compile timeout "
                            "(they got a 503)"),
                           ("grammar_disk_cache_hits", "disk_hits", "Compiled grammars loaded from the disk cache")):
        c = CounterMetricFamily(f"{PREFIX}_{name}", doc)
        c.add_metric([], float(gstats.get(key, 0)))
        yield c
    for name, key, doc in (("grammar_compile_duration_seconds", "compile_latency", "Compile time per grammar"),
                           ("grammar_compile_queue_wait_seconds", "queue_wait",
                            "Time a grammar waited for a compile thread")):
        snap = gstats.get(key)
        if not snap:
            continue
        h = HistogramMetricFamily(f"{PREFIX}_{name}", doc, sum_value=snap["sum"],
                                  buckets=[("+Inf" if le == float("inf") else repr(le), n) for le, n in snap["buckets"]])
        yield h
        g = GaugeMetricFamily(f"{PREFIX}_{name}_recent", doc + " (recent samples)", labels=["quantile"])
        g.add_metric(["0.5"], snap["p50"])
        g.add_metric(["0.99"], snap["p99"])
        yield g


# (metric name, snapshot key, help)
_SPEC_COUNTERS = (("verify_steps", "steps", "Speculative verify steps (batches)"),
                  ("verified_requests", "verified_requests", "Request-steps verified (one per request per step)"),
                  ("accepted_tokens", "accepted_tokens", "Draft tokens accepted (bonus tokens excluded)"),
                  ("forced_draft_tokens", "forced_draft_tokens", "Grammar-forced tokens put into drafts"),
                  ("failed_steps", "failed_steps", "Speculative steps that raised (their requests failed; "
                   "after a few the engine decodes plainly)"))


def _spec_metrics(st: dict | None):
    """Speculative-decoding acceptance, global: counters plus the accepted-length histogram."""
    if st is None:
        return
    for name, key, doc in _SPEC_COUNTERS:
        c = CounterMetricFamily(f"{PREFIX}_spec_{name}", doc)
        c.add_metric([], float(st[key]))
        yield c
    g = GaugeMetricFamily(f"{PREFIX}_spec_mean_accepted_length", "Tokens emitted per request per verify step")
    g.add_metric([], float(st["mean_accepted"]))
    yield g
    c = CounterMetricFamily(f"{PREFIX}_spec_host_seconds", "Host time of speculative steps by phase (draft and "
                            "mask: drafting and grammar-masking the trees)", labels=["phase"])
    for phase, seconds in st["phase_seconds"].items():
        c.add_metric([phase], seconds)
    yield c
    g = GaugeMetricFamily(f"{PREFIX}_spec_accepted_length_count", "Request-steps by number of accepted drafts",
                          labels=["accepted"])
    last = max((i for i, n in enumerate(st["histogram"]) if n), default=0)
    for i in range(last + 1):
        g.add_metric([str(i)], float(st["histogram"][i]))
    yield g


class ServerMetrics:
    def __init__(self, engine, server_state):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_http_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens",
                                     "Prompt tokens of finished engine requests: each choice of an n > 1 "
                                     "request counts its prompt (usage counts it once)", registry=r)
        self.completion_tokens = Counter(f"{PREFIX}_completion_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.finished = Counter(f"{PREFIX}_requests_finished", "Engine requests finished, by finish reason",
                                ["reason"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_request_latency_seconds", "Time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # livesum: with several front-end processes, /metrics sums the live ones
        self.in_flight = Gauge(f"{PREFIX}_http_requests_in_flight", "Generation requests the server has admitted",
                               multiprocess_mode="livesum", registry=r)
        self.collector = _EngineCollector(server_state)
        self.shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR") is not None
        if self.shared:  # the front-ends' own metrics from every process's files, the engine's from the snapshot
            self.registry = CollectorRegistry(auto_describe=False)
            multiprocess.MultiProcessCollector(self.registry)
        self.registry.register(self.collector)
        self.engine = engine
        self._listening = False

    # engine thread -> metrics
    def on_engine_event(self, event: str, req) -> None:
        try:
            if event == "first_token" and req.first_token_time is not None:
                self.ttft.observe(max(req.first_token_time - req.arrival, 0.0))
            elif event == "finish":
                n_out = len(req.output_ids)
                self.prompt_tokens.inc(len(req.prompt_ids))
                self.completion_tokens.inc(n_out)
                reason = getattr(req.finish_reason, "value", str(req.finish_reason))
                self.finished.labels(reason=reason).inc()
                now = time.monotonic()
                self.e2e.observe(max(now - req.arrival, 0.0))
                if req.first_token_time is not None and n_out > 1:
                    self.tpot.observe(max((now - req.first_token_time) / (n_out - 1), 0.0))
        except Exception:  # never let metrics break the engine loop
            pass

    def attach(self) -> None:
        listeners = getattr(getattr(self.engine, "stats", None), "listeners", None)
        if listeners is not None and not self._listening:
            listeners.append(self.on_engine_event)
            self._listening = True

    def detach(self) -> None:
        listeners = getattr(getattr(self.engine, "stats", None), "listeners", None)
        if listeners is not None and self._listening:
            try:
                listeners.remove(self.on_engine_event)
            except ValueError:
                pass
            self._listening = False

    def render(self, snapshot: dict | None) -> bytes:
        """The metrics text, the engine's part from `snapshot` (`engine_snapshot`; None: left out)."""
        self.collector.snapshot = snapshot
        try:
            return generate_latest(self.registry)
        finally:
            self.collector.snapshot = None

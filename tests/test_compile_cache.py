"""Grammar compilation under load and its caches (CPU, SmolLM2 tokenizer, no model except the
/metrics test): the compile timeout counts compile time only, an overrunning compile blocks no one,
the cache keys on the normalized schema, and compiled grammars survive a restart on disk."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from constrained_spec.grammar import GrammarBackend, GrammarBusy, GrammarError, GrammarSpec
from constrained_spec.grammar import backend as backend_mod
from constrained_spec.grammar import xgrammar_backend
from server_fixtures import server, server_engine  # noqa: F401 (fixtures)

VOCAB = 49152
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def tok(tokenizer):
    return tokenizer


class SlowBackend(GrammarBackend):
    """Each compile of a grammar in `slow` takes that long first (xgrammar's compile cannot be
    slowed on purpose reliably)."""

    def __init__(self, *a, slow=None, **kw):
        self.slow = slow or {}
        super().__init__(*a, **kw)

    def _build(self, spec, prepared=None, key=None):
        time.sleep(self.slow.get(spec.value, 0.0))
        return super()._build(spec, prepared, key)


def regex(i) -> GrammarSpec:
    return GrammarSpec.regex(f"r{i}-[a-z]+")


def accepts(backend, tok, compiled, text) -> bool:
    m = backend.matcher(compiled)
    return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.can_terminate()


def test_timeout_counts_compile_time_only(tok):
    # one worker; three compiles of 0.6 s each: the third waits 1.2 s in the queue, past its 1 s timeout
    specs = [regex(i) for i in range(3)]
    b = SlowBackend(tok, VOCAB, default_backend="xgrammar", compile_workers=1, compile_timeout_s=1.0, slow={s.value: 0.6 for s in specs})
    try:
        futures = [b.compile_async(s) for s in specs]
        assert b.stats["queue_depth"] >= 1
        for s, f in zip(specs, futures):
            assert f.result(timeout=30).spec == s
        st = b.stats
        assert st["compile_timeouts"] == 0 and st["compile_count"] == 3
        assert st["queue_wait"]["max"] > 1.0  # queueing shows as latency
        assert st["queue_wait"]["count"] == 3 and st["compile_latency"]["count"] == 3
        assert st["queue_depth"] == 0 and st["inflight"] == 0
    finally:
        b.close()


def test_overrunning_compile_blocks_no_one(tok):
    slow, fast = regex("slow"), regex("fast")
    b = SlowBackend(tok, VOCAB, default_backend="xgrammar", compile_workers=1, compile_timeout_s=0.3, slow={slow.value: 2.0})
    try:
        t0 = time.monotonic()
        f_slow = b.compile_async(slow)
        f_fast = b.compile_async(fast)  # queued behind the slow one on the only worker
        with pytest.raises(GrammarError, match="compile exceeded 0.3s"):
            f_slow.result(timeout=30)
        assert f_fast.result(timeout=30).spec == fast
        assert time.monotonic() - t0 < 1.5  # a spare thread took it; the slow one still runs
        st = b.stats
        assert st["compile_timeouts"] == 1 and st["spare_threads_started"] == 1
        # a request joining the overrun compile is told at once; its result is cached when it ends
        with pytest.raises(GrammarError, match="exceeded"):
            b.compile(slow)
        deadline = time.monotonic() + 30
        while b.stats["inflight"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert b.compile(slow).spec == slow
        assert b.stats["compile_count"] == 2
        assert b.queue._threads == 2  # the replaced thread retired (one worker, one kept for fast compiles)
    finally:
        b.close()


def test_a_new_schema_does_not_wait_behind_slow_compiles(tok):
    """llguidance's compiles (fast) go before xgrammar's (slow), which hold at most `workers` of the
    workers + 1 threads: a new schema waited 20 s to 7 minutes behind xgrammar compiles of wide
    objects (QA, 2 cores). A second slow compile waits for the lane."""
    slow = [regex(f"slow{i}") for i in range(2)]
    b = SlowBackend(tok, VOCAB, default_backend="auto", compile_workers=1, compile_timeout_s=30,
                    slow={s.value: 1.5 for s in slow})
    try:
        t0 = time.monotonic()
        f_slow = [b.compile_async(s.with_backend("xgrammar")) for s in slow]
        time.sleep(0.1)  # the first holds the slow lane
        fast = b.compile(GrammarSpec.json_schema(PERSON))  # llguidance, on the thread kept for it
        assert fast.backend == "llguidance" and not f_slow[0].done()
        assert b.stats["queue_depth"] == 1  # the second slow compile waits for the lane
        for f in f_slow:
            f.result(timeout=30)
        assert time.monotonic() - t0 >= 3.0  # one after the other
    finally:
        b.close()


def test_overrunning_compiles_never_take_the_fast_lanes_thread(tok):
    """Slow compiles that overrun keep their threads (neither backend can stop one) and spares
    take their places, up to 2 * workers + 1 threads; then every thread held an overrun and a new
    schema's llguidance compile (~1 ms) waited for them, minutes (QA: five 200,000-string enums)."""
    slow = [regex(f"slow{i}") for i in range(4)]
    b = SlowBackend(tok, VOCAB, default_backend="auto", compile_workers=1, compile_timeout_s=0.2,
                    slow={s.value: 3.0 for s in slow})
    try:
        b.compile(GrammarSpec.json_schema({"type": "integer"}), timeout_s=30)  # llguidance's set-up, once
        futures = []
        for s in slow:  # each arrives once the one before has overrun (each arrival wakes a thread)
            futures.append(b.compile_async(s.with_backend("xgrammar")))
            time.sleep(0.3)
        assert b.queue._threads == 3 and b.stats["compile_timeouts"] >= 2
        t0 = time.monotonic()
        fast = b.compile(GrammarSpec.json_schema(PERSON), timeout_s=30)
        assert fast.backend == "llguidance" and time.monotonic() - t0 < 1.0
        for f in futures[:2]:
            with pytest.raises(GrammarError, match="exceeded"):
                f.result(timeout=60)
        for f in futures[2:]:  # queued behind the overruns past twice the timeout
            with pytest.raises(GrammarBusy, match="waited"):
                f.result(timeout=60)
        # the overruns end after this test: a process that exits while one is in xgrammar's native
        # compile aborts ("terminate called without an active exception")
        assert b.queue.close(wait_s=30)
    finally:
        b.close()


def test_a_grammar_stuck_behind_overrunning_compiles_is_busy_after_twice_the_timeout():
    """Once overrunning compiles hold every thread slow jobs may take, a slow job queued behind them
    waited until one ended (xgrammar's compiles of huge enums: minutes), its client without an
    answer. Past twice the compile timeout in the queue its request gets GrammarBusy (the server's
    503 with Retry-After, not a 400: the grammar is not at fault); the job leaves the queue once no
    request waits for it (timed out or cancelled), and stays while one waits without a timeout."""
    from constrained_spec.grammar.compile_queue import CompiledGrammar, CompileQueue
    release = threading.Event()

    def blocked(spec):
        def build():
            release.wait(30)
            return CompiledGrammar(spec, "xgrammar", None, 0.0)
        return build

    q = CompileQueue(workers=1, timeout_s=0.3)
    try:
        overruns = [q.submit(("overrun", i), regex(i), blocked(regex(i)), slow=True) for i in range(2)]
        deadline = time.monotonic() + 10
        while q.stats["compile_timeouts"] < 2 or q.stats["compiling"] < 2:  # spares all taken
            assert time.monotonic() < deadline
            time.sleep(0.02)
        stuck, kept = regex("stuck"), regex("kept")
        t0 = time.monotonic()
        first = q.submit("stuck", stuck, blocked(stuck), slow=True)
        gone = q.submit("gone", regex("gone"), blocked(regex("gone")), slow=True)
        assert gone.cancel()  # its caller went away (the engine cancels an aborted request's)
        time.sleep(0.2)
        second = q.submit("stuck", stuck, blocked(stuck), slow=True)  # joins the queued job
        background = q.submit("kept", kept, blocked(kept), timeout_s=0, slow=True)
        with pytest.raises(GrammarBusy, match="waited 0.6s") as e:
            first.result(timeout=10)
        assert time.monotonic() - t0 >= 0.6 and not isinstance(e.value, GrammarError)
        assert not second.done() and "stuck" in q._jobs  # its second request still waits
        with pytest.raises(GrammarBusy):
            second.result(timeout=10)
        st = q.stats
        assert "stuck" not in q._jobs and "gone" not in q._jobs
        assert st["queue_depth"] == 1 and st["queue_timeouts"] == 2
        fast = regex("fast")  # the fast lane's thread is free meanwhile
        assert q.submit("fast", fast, lambda: CompiledGrammar(fast, "llguidance", None, 0.0)).result(timeout=5)
        release.set()
        assert background.result(timeout=10).spec == kept
        for f in overruns:
            with pytest.raises(GrammarError, match="exceeded"):
                f.result(timeout=10)
    finally:
        release.set()
        q.close()


def test_a_queue_deadline_holds_no_compiled_grammar():
    """A request's queue deadline outlives its job's start (by up to twice the timeout); it held
    the job, its compiled grammar and schema text, that long: 60 s of every distinct grammar."""
    import tracemalloc
    from constrained_spec.grammar.compile_queue import CompiledGrammar, CompileQueue
    q = CompileQueue(workers=1, cache_bytes=1 << 20)  # none of these is kept: each counts 2 MiB
    try:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(40):
            spec = GrammarSpec.regex(f"{i}" + "x" * 500_000)
            q.submit(i, spec, lambda spec=spec: CompiledGrammar(spec, "xgrammar", None, 0.0, memory_bytes=2 << 20)
                     ).result(timeout=10)
        del spec
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert q.stats["cache_size"] == 0 and held < 2 << 20, held  # 40 x 0.5 MB were held
    finally:
        q.close()


def test_autos_fallback_compiles_in_the_slow_lane(tok):
    """A schema llguidance refuses falls back to xgrammar under auto on the slow lane, its request
    still waiting on the same compile; fast compiles pass it meanwhile."""
    refused = GrammarSpec.json_schema({"type": "integer", "minimum": 2**53 + 1, "maximum": 2**53 + 9})

    class SlowFallback(GrammarBackend):
        def _build_xgrammar(self, spec, prepared, key):
            if spec == refused:
                time.sleep(1.5)
            return super()._build_xgrammar(spec, prepared, key)

    b = SlowFallback(tok, VOCAB, default_backend="auto", compile_workers=1)
    try:
        f = b.compile_async(refused)
        time.sleep(0.2)
        assert b.compile(GrammarSpec.json_schema(PERSON)).backend == "llguidance"
        assert not f.done()  # passed the fallback's 1.5 s compile
        got = f.result(timeout=30)
        assert got.backend == "xgrammar" and got.spec == refused
        assert b.stats["llguidance_fallbacks"] == 1 and b.queue._slow_lane_busy() == 0
    finally:
        b.close()


def test_full_queue_is_busy_not_a_grammar_error(tok):
    specs = [regex(i) for i in range(3)]
    b = SlowBackend(tok, VOCAB, default_backend="xgrammar", compile_workers=1, max_queue=1, slow={s.value: 0.5 for s in specs})
    try:
        b.compile_async(specs[0])
        time.sleep(0.1)  # the worker has it
        b.compile_async(specs[1])
        with pytest.raises(GrammarBusy) as e:
            b.compile_async(specs[2])
        assert not isinstance(e.value, GrammarError)  # the server answers 503, not 400
    finally:
        b.close()


def test_normalized_schema_shares_a_compile(tok, monkeypatch):
    b = GrammarBackend(tok, VOCAB, default_backend="xgrammar")
    try:
        a = b.compile(GrammarSpec.json_schema(PERSON))
        annotated = {"required": ["name", "age"], "title": "Person", "description": "someone",
                     "properties": {"name": {"description": "full name", "type": "string"},
                                    "age": {"type": "integer", "examples": [3]}},
                     "type": "object"}
        c = b.compile(GrammarSpec.json_schema(annotated))
        assert c.grammar is a.grammar and c.spec.value != a.spec.value
        assert b.stats["compile_count"] == 1 and b.stats["cache_hits"] == 1
        assert accepts(b, tok, c, '{"name": "Ann", "age": 3}')
        # property order is kept: xgrammar emits properties in declaration order
        swapped = {**PERSON, "properties": dict(reversed(list(PERSON["properties"].items())))}
        b.compile(GrammarSpec.json_schema(swapped))
        assert b.stats["compile_count"] == 2
        # a repeat of the same text does not normalize it again
        calls = []
        real = xgrammar_backend.prepare_schema
        monkeypatch.setattr(xgrammar_backend, "prepare_schema", lambda *a: calls.append(1) or real(*a))
        assert b.compile(GrammarSpec.json_schema(annotated)).grammar is a.grammar
        assert calls == []
    finally:
        b.close()


def test_canonical_schema_keeps_meaningful_order():
    s = {"type": "object", "properties": {"b": {"type": "string", "enum": ["y", "x"]}, "a": {"const": {"z": 1, "y": 2}}}}
    c = backend_mod.canonical_schema({"type": "object", **{k: v for k, v in s.items() if k != "type"}})
    assert list(c) == ["properties", "type"]
    assert list(c["properties"]) == ["b", "a"]
    assert list(c["properties"]["b"]) == ["enum", "type"] and c["properties"]["b"]["enum"] == ["y", "x"]
    assert list(c["properties"]["a"]["const"]) == ["z", "y"]


def _dev_schemas(n):
    import json
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = []
    with open(os.path.join(root, "schemas", "jsonschemabench-dev.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            out.append((GrammarSpec.json_schema(row["schema"]), row.get("valid") or []))
            if len(out) == n:
                return out
    return out


def _wait_writes(b, n):
    deadline = time.monotonic() + 30
    while b.stats["disk_writes"] < n:  # saved after the future resolves
        assert time.monotonic() < deadline, b.stats
        time.sleep(0.02)


def test_disk_cache_warm_restart(tok, tmp_path):
    specs = _dev_schemas(3)
    cold = GrammarBackend(tok, VOCAB, default_backend="xgrammar", cache_dir=str(tmp_path), persist_min_s=0)
    try:
        for s, _ in specs:
            cold.compile(s)
        _wait_writes(cold, len(specs))
        assert cold.stats["compile_count"] == len(specs)
    finally:
        cold.close()
    (folder,) = os.listdir(tmp_path)  # one fingerprint
    assert len([n for n in os.listdir(tmp_path / folder) if n.endswith(".json.z")]) == len(specs)
    warm = GrammarBackend(tok, VOCAB, default_backend="xgrammar", cache_dir=str(tmp_path), persist_min_s=0)
    try:
        for s, valid in specs:
            c = warm.compile(s)
            assert c.from_disk
            for v in valid[:2]:
                import json
                assert accepts(warm, tok, c, json.dumps(v)), v
        st = warm.stats
        assert st["compile_count"] == 0 and st["disk_hits"] == len(specs)
    finally:
        warm.close()
    # other compile options are another fingerprint: nothing shared
    other = GrammarBackend(tok, VOCAB, default_backend="xgrammar", cache_dir=str(tmp_path), persist_min_s=0, max_whitespace_cnt=4)
    try:
        assert not other.compile(specs[0][0]).from_disk
        assert len(os.listdir(tmp_path)) == 2
    finally:
        other.close()


def test_a_grammar_too_large_to_save_is_not_serialized(tok, tmp_path, monkeypatch):
    """Serializing a large compiled grammar held ~13 times its JSON, itself up to 64 times its
    memory size: past MAX_SAVED_MEMORY a grammar is not written out at all."""
    from constrained_spec.grammar import xgrammar_backend
    b = GrammarBackend(tok, VOCAB, default_backend="xgrammar", cache_dir=str(tmp_path), persist_min_s=0)
    try:
        small = b.compile(regex("small"))
        _wait_writes(b, 1)
        assert small.memory_bytes > 0
        monkeypatch.setattr(xgrammar_backend, "MAX_SAVED_MEMORY", small.memory_bytes - 1)
        b.compile(regex("large"))
        time.sleep(0.5)  # its save would be written by now
        assert b.stats["disk_writes"] == 1 and b.stats["disk_saving"] == 0 and b.stats["disk_errors"] == 0
    finally:
        b.close()


def test_saves_run_on_a_low_priority_thread_of_their_own(tok, tmp_path, monkeypatch):
    """A save (seconds of serializing and compressing for a large grammar) holds no compile worker,
    and runs at the lowest CPU priority, behind the engine's threads."""
    saving = threading.Event()
    save = xgrammar_backend.XGrammarCompiler._persist

    def slow_save(self, key, compiled):
        saving.set()
        time.sleep(1.0)
        save(self, key, compiled)
    monkeypatch.setattr(xgrammar_backend.XGrammarCompiler, "_persist", slow_save)
    b = GrammarBackend(tok, VOCAB, default_backend="xgrammar", cache_dir=str(tmp_path), persist_min_s=0,
                       compile_workers=1)
    try:
        b.compile(regex("first"))
        assert saving.wait(5)
        b.compile(regex("second"))  # the worker is free while the first is saved
        assert b.stats["disk_saving"] >= 1  # the first save still sleeps
        saver = b.queue._saver_thread
        if sys.platform.startswith("linux"):
            assert os.getpriority(os.PRIO_PROCESS, saver.native_id) == 19
        _wait_writes(b, 2)
    finally:
        b.close()


def test_damaged_cache_files_are_recompiled(tok, tmp_path):
    import zlib
    spec_a, spec_b = GrammarSpec.json_schema(PERSON), regex("disk")
    b = GrammarBackend(tok, VOCAB, default_backend="xgrammar", cache_dir=str(tmp_path), persist_min_s=0)
    try:
        b.compile(spec_a), b.compile(spec_b)
        _wait_writes(b, 2)
        disk = b.xgrammar.disk
        file_a = os.path.join(disk.dir, b.xgrammar.disk_name(b._front[spec_a.key][0]))
        file_b = os.path.join(disk.dir, b.xgrammar.disk_name(b._front[spec_b.key][0]))
    finally:
        b.close()
    with open(file_a, "wb") as f:  # not zlib: caught by the checksum
        f.write(b"\x00garbage")
    with open(file_b, "wb") as f:  # intact zlib, text xgrammar refuses
        f.write(zlib.compress(b'{"not": "a compiled grammar"}'))
    b = GrammarBackend(tok, VOCAB, default_backend="xgrammar", cache_dir=str(tmp_path), persist_min_s=0)
    try:
        a = b.compile(spec_a)
        assert not a.from_disk and accepts(b, tok, a, '{"name": "A", "age": 1}')
        assert not b.compile(spec_b).from_disk
        _wait_writes(b, 2)
        st = b.stats
        assert st["compile_count"] == 2 and st["disk_errors"] == 1
    finally:
        b.close()
    b = GrammarBackend(tok, VOCAB, default_backend="xgrammar", cache_dir=str(tmp_path), persist_min_s=0)
    try:
        assert b.compile(spec_a).from_disk and b.compile(spec_b).from_disk  # rewritten whole
    finally:
        b.close()


def test_the_disk_cache_s_bound_is_the_engine_s_flag(tmp_path, tiny_llama_dir):
    """--grammar-disk-cache-mb reaches the disk cache (its 1 GiB was fixed: QA 1130b soak)."""
    from constrained_spec.engine import Engine
    eng = Engine(model=tiny_llama_dir, device="cpu", dtype="float32", grammar_cache_dir=str(tmp_path),
                 grammar_disk_cache_mb=3)
    try:
        assert eng.grammar.xgrammar.disk.max_bytes == 3 << 20
    finally:
        eng.shutdown()


def test_disk_cache_is_bounded(tmp_path):
    from constrained_spec.grammar.disk_cache import DiskCache
    d = DiskCache(str(tmp_path), "fp", max_files=3)
    for i in range(5):
        d.put(d.name(i), "x" * 100)
        os.utime(os.path.join(d.dir, d.name(i)), (i, i))  # distinct ages
    assert sorted(os.listdir(d.dir)) == sorted(d.name(i) for i in (2, 3, 4))
    assert d.get(d.name(4)) == "x" * 100 and d.get(d.name(0)) is None
    # a write a crash cut short is removed once old (QA 1130b soak: it was never evicted); one in progress stays
    for name, age in ((".tmp-crashed", 7200), (".tmp-writing", 5)):
        with open(os.path.join(d.dir, name), "w") as f:
            f.write("partial")
        os.utime(os.path.join(d.dir, name), (time.time() - age, time.time() - age))
    d.put(d.name(5), "y")
    assert ".tmp-crashed" not in os.listdir(d.dir) and ".tmp-writing" in os.listdir(d.dir)


def options(i: int, n: int = 300) -> GrammarSpec:
    return GrammarSpec.choice([f"grammar {i} option {j}" for j in range(n)])


def test_memory_cache_is_bounded_by_bytes(tok):
    """Each cached grammar counts its memory (xgrammar's memory_size_bytes, llguidance's estimate):
    bounded by count alone, 150 20,000-string enums (~9 MB each under xgrammar) grew the engine by
    1.4 GB. Past the byte bound the least recently used go first; a grammar larger than the whole
    bound is not kept, and pushes none out."""
    b = GrammarBackend(tok, VOCAB, default_backend="xgrammar")
    assert b.compile(options(0)).memory_bytes > 10_000  # ~50 KB
    size = b.stats["cache_bytes"]  # and its texts
    b.close()
    bound = int(3.5 * size)
    b = GrammarBackend(tok, VOCAB, default_backend="xgrammar", cache_bytes=bound)
    try:
        def compiled_again(i: int) -> bool:
            before = b.stats["compile_count"]
            b.compile(options(i))
            return b.stats["compile_count"] > before

        for i in range(6):
            b.compile(options(i))
            assert b.stats["cache_bytes"] <= bound
        assert b.stats["cache_size"] == 3  # 3, 4, 5
        assert not compiled_again(3)  # now the most recently used
        b.compile(options(6))  # 4 goes
        assert b.stats["cache_size"] == 3 and b.stats["cache_bytes"] <= bound
        assert not compiled_again(3) and not compiled_again(6)
        assert compiled_again(4)  # and pushes 5 out
        big = options("big", 2000)
        assert b.compile(big).memory_bytes > bound
        assert b.stats["cache_size"] == 3 and compiled_again("big")
        assert not compiled_again(4) and not compiled_again(6)
    finally:
        b.close()
    b = GrammarBackend(tok, VOCAB, default_backend="llguidance")
    try:
        compiled = b.compile(options(0))
        assert compiled.memory_bytes > 64_000 + 16 * len(options(0).value)
        # its schema text and grammar text count too
        assert b.stats["cache_bytes"] > compiled.memory_bytes + len(options(0).value) + len(compiled.prepared)
    finally:
        b.close()


def test_caches_keyed_by_schema_text_are_bounded_by_its_memory(tok, monkeypatch):
    """The front caches (raw schema -> normalized key; auto's count of uses) were bounded by count
    alone, 2,048 entries each keyed by the whole schema text, and the compile cache counted only the
    compiled grammars' memory, not the texts its entries hold: 2,048 distinct 0.5 MB schemas held
    1-2 GB. Here 80 distinct 250 KB schemas (a long description: xgrammar's grammar of it is small)
    go through auto and xgrammar: they held 22 MB; the texts kept stay within the two 2 MiB bounds."""
    import gc
    import tracemalloc
    monkeypatch.setattr(backend_mod, "FRONT_CACHE_BYTES", 2 << 20)
    b = GrammarBackend(tok, VOCAB, default_backend="auto", cache_bytes=2 << 20)
    try:
        warm = GrammarSpec.json_schema({"type": "integer"})
        b.compile(warm)
        b.compile(warm.with_backend("xgrammar"))  # both backends set up before measuring
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(80):
            spec = GrammarSpec.json_schema({"type": "string", "description": f"{i}" + "x" * 250_000, "enum": [f"v{i}"]})
            b.compile(spec)  # auto: counted, compiled by llguidance
            b.compile(spec.with_backend("xgrammar"))  # normalized through the front cache
        del spec
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert held < 6 << 20, held
        assert b._front.bytes <= 2 << 20 and b.stats["cache_bytes"] <= 2 << 20 and len(b._auto_seen) == 81
    finally:
        b.close()


def test_compile_metrics_in_prometheus_text(server, server_engine):  # noqa: F811
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json={
            "model": "smollm2", "messages": [{"role": "user", "content": "a person"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
                **PERSON, "properties": {**PERSON["properties"], "metrics_probe": {"type": "boolean"}}}}}})
        assert r.status_code == 200, r.text
        text = c.get("/metrics").text
    for name in ("constrained_spec_grammar_compile_queue_depth 0.0",
                 "constrained_spec_grammar_compiles_running",
                 "constrained_spec_grammar_cache_bytes",
                 "constrained_spec_grammar_compile_timeouts_total",
                 'constrained_spec_grammar_compile_duration_seconds_bucket{le="+Inf"}',
                 'constrained_spec_grammar_compile_queue_wait_seconds_bucket{le="+Inf"}',
                 'constrained_spec_grammar_compile_duration_seconds_recent{quantile="0.99"}'):
        assert name in text, name
    count = [ln for ln in text.splitlines() if ln.startswith("constrained_spec_grammar_compile_duration_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1
    assert server_engine.grammar.xgrammar.disk is None or str(server_engine.grammar.xgrammar.disk.dir).startswith(
        os.environ["CONSTRAINED_SPEC_GRAMMAR_CACHE_DIR"])


EXIT_WHILE_COMPILING = """
import json, sys, threading, time
from constrained_spec.grammar import GrammarBackend, GrammarSpec
from constrained_spec.models import load_tokenizer
tok = load_tokenizer()
backend = GrammarBackend(tok, len(tok), default_backend="xgrammar", cache_dir=None)
rows = [json.loads(line) for line in open(sys.argv[1])]
def compile_all():
    for row in rows:
        try:
            backend.compile(GrammarSpec.json_schema(row["schema"]))
        except Exception:
            pass
threading.Thread(target=compile_all, daemon=True).start()
time.sleep(1.5)
"""


def test_exit_while_compiling_does_not_abort(tmp_path):
    """A program that exits with compiles in flight and its backend open exits cleanly: without the
    queue's wait at exit, CPython 3.11 unwinds the worker inside xgrammar's native compile and the
    process aborts ("terminate called without an active exception"; 4 runs in 6 before the fix)."""
    schemas = Path(__file__).resolve().parent.parent / "schemas" / "jsonschemabench-dev.jsonl"
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", EXIT_WHILE_COMPILING, str(schemas)], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]


def test_warm_up_builds_llguidance_only_where_it_may_serve(tok):
    """A server warms its backend before it says ready, so its first grammar request does not pay for
    llguidance's tokenizer (~1 s); a server pinned to xgrammar never builds it."""
    for default, built in (("auto", True), ("llguidance", True), ("xgrammar", False)):
        b = GrammarBackend(tok, VOCAB, default_backend=default, cache_dir=None)
        b.warm_up()
        assert (b._llguidance is not None) is built, default
        t0 = time.perf_counter()
        b.compile(GrammarSpec.json_schema(PERSON))
        assert time.perf_counter() - t0 < 0.5 or default == "xgrammar"
        b.close()


def test_the_environment_s_none_turns_the_disk_cache_off(monkeypatch, tmp_path):
    """CONSTRAINED_SPEC_GRAMMAR_CACHE_DIR=none was taken as a folder named `none` in the working
    directory; the environment reads as the option does."""
    from constrained_spec.grammar.disk_cache import ENV_DIR, resolve_dir
    for off in ("none", "off", "None"):
        monkeypatch.setenv(ENV_DIR, off)
        assert resolve_dir(None) is None, off
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    assert resolve_dir(None) == str(tmp_path) and resolve_dir("none") is None

"""xgrammar-backed grammar compilation, matching and bitmask handling.

Thread-safety (xgrammar 0.2.8):
* ``GrammarCompiler`` may be called from several threads (compile_async runs compiles on a
  small thread pool).  Compiled grammars are immutable and shared between requests.
* a ``GrammarMatcher`` (hence a RequestMatcher) is NOT thread-safe: one request's matcher must be
  used by one thread at a time (the scheduler's grammar worker).
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
import xgrammar as xgr

from .disk_cache import DiskCache, fingerprint
from .errors import GrammarBusy, GrammarError
from .schema import prepare_schema
from .spec import GrammarSpec

log = logging.getLogger("constrained_spec.grammar")

@dataclass
class CompiledGrammar:
    spec: GrammarSpec
    xgr_compiled: Any  # xgrammar.CompiledGrammar
    compile_seconds: float
    prepared: Optional[str] = None  # the rewritten JSON schema handed to xgrammar (json kinds)
    memory_bytes: int = 0
    from_disk: bool = False  # loaded from the disk cache (compile_seconds is then the load's)


def _memory(cg) -> int:
    try:
        return int(cg.memory_size_bytes)
    except Exception:  # noqa: BLE001
        return 0


def _ebnf_string(s: str) -> str:
    out = []
    for ch in s:
        o = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif o < 0x20 or o == 0x7F:
            out.append("\\x%02x" % o if o != 10 else "\\n")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


class RequestMatcher:
    """Per-request grammar state (one xgrammar GrammarMatcher). Not thread-safe."""

    __slots__ = ("_m", "compiled", "vocab_size", "_bitmask_width", "ffi_handle", "_specials")

    def __init__(self, compiled: CompiledGrammar, vocab_size: int, specials: frozenset = frozenset()):
        self.compiled = compiled
        self.vocab_size = vocab_size
        self._specials = specials  # never legal: refused here, without xgrammar's warning per call
        self._bitmask_width = math.ceil(vocab_size / 32)
        self._m = xgr.GrammarMatcher(compiled.xgr_compiled)  # xgrammar 0.2.8: rollback is unbounded
        self.ffi_handle = _ffi_handle(self._m)

    @property
    def xgr_matcher(self) -> xgr.GrammarMatcher:
        return self._m

    def accept_token(self, tok: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""
        if tok < 0 or tok >= self.vocab_size or tok in self._specials:
            return False
        return self._m.accept_token(int(tok))

    def accept_tokens(self, toks: Sequence[int]) -> int:
        """Accept a prefix of toks; returns how many were accepted (stops at the first illegal)."""
        n = 0
        for t in toks:
            if not self.accept_token(t):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        if n > 0:
            self._m.rollback(int(n))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, int(row))

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def can_terminate(self) -> bool:
        """True when a stop token (EOS) is legal now, or the grammar already ended."""
        return self._m.is_terminated() or self._m.is_completed()

    def reset(self) -> None:
        self._m.reset()

    def fork(self) -> "RequestMatcher":
        new = RequestMatcher.__new__(RequestMatcher)
        new.compiled, new.vocab_size, new._bitmask_width, new._specials = (
            self.compiled, self.vocab_size, self._bitmask_width, self._specials)
        new._m = self._m.fork()
        new.ffi_handle = _ffi_handle(new._m)
        return new

    def jump_forward_string(self) -> str:
        """The text the grammar forces next ("" for none). After a token that ends inside a UTF-8
        character the forced text starts with the character's remaining bytes, which are no
        string: nothing is forced then (the next sample, masked, completes the character)."""
        if self._m.is_terminated():
            return ""
        try:
            return self._m.find_jump_forward_string()
        except UnicodeDecodeError:
            return ""

    def jump_forward_tokens(self, tokenizer) -> List[int]:
        """Tokens of the string the grammar forces from here, each legal in sequence.

        Does not advance this matcher. The tokens are the tokenizer's encoding of the forced
        string, truncated at the first token the grammar refuses (checked on a fork)."""
        s = self.jump_forward_string()
        if not s:
            return []
        ids = tokenizer.encode(s, add_special_tokens=False)
        fork = self._m.fork()
        out = []
        for t in ids:
            if not fork.accept_token(int(t)):
                break
            out.append(int(t))
        return out

    def traverse_draft_tree(self, retrieve_next_token, retrieve_next_sibling, draft_tokens,
                            bitmask: torch.Tensor, time_threshold: float = -1.0) -> bool:
        """Fill bitmask row i for every node i of a draft tree (xgrammar's native traversal).

        Node 0 is the last verified token (already accepted into this matcher); row i holds the
        tokens legal after the path root..i. Nodes whose token the grammar forbids are not
        descended into (their rows and their subtree's rows are left as they were: the caller
        should prune them: see `legal_draft_nodes`). The matcher state is unchanged afterwards.
        Returns False if time_threshold (seconds, >0) was exceeded."""
        rnt = _as_i64(retrieve_next_token)
        rns = _as_i64(retrieve_next_sibling)
        dt = _as_i64(draft_tokens)
        return self._m.traverse_draft_tree(rnt, rns, dt, bitmask, time_threshold)

    def __repr__(self) -> str:
        return f"RequestMatcher(kind={self.compiled.spec.kind}, terminated={self.is_terminated()})"


def _ffi_handle(matcher: xgr.GrammarMatcher) -> int:
    """The matcher's TVM FFI object address, for `native_fill` (0 where xgrammar's layout has none).
    The Python object keeps it alive."""
    try:
        return matcher._handle.__chandle__()
    except AttributeError:
        return 0


# A chain fill whose chain the grammar refuses (a bug: guided chains are legal by construction)
# raises this; the matchers are left where the walk stopped, and the engine fails the running requests.
REFUSED_DRAFT = "a draft chain token was refused by its grammar"


def _as_i64(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.int64 or x.device.type != "cpu":
            x = x.to("cpu", torch.int64)
        return x.contiguous()
    return torch.tensor(list(x), dtype=torch.int64)


def legal_draft_nodes(bitmask: torch.Tensor, retrieve_next_token, retrieve_next_sibling,
                      draft_tokens) -> List[bool]:
    """After traverse_draft_tree: legal[i] is True when the path root..i is grammar-legal."""
    rnt = [int(v) for v in retrieve_next_token]
    rns = [int(v) for v in retrieve_next_sibling]
    dt = [int(v) for v in draft_tokens]
    legal = [False] * len(dt)
    legal[0] = True
    stack = [0]
    bm = bitmask
    while stack:
        i = stack.pop()
        c = rnt[i]
        while c != -1:
            t = dt[c]
            if (int(bm[i, t >> 5]) >> (t & 31)) & 1:
                legal[c] = True
                stack.append(c)
            c = rns[c]
    return legal


def special_token_ids(tokenizer) -> set:
    """The tokenizer's special and control tokens (`<|endoftext|>`, `<|im_start|>`, ...)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def tokenizer_info_without_specials(tokenizer, vocab_size: int,
                                    stop_token_ids: Optional[List[int]] = None) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, in which no special token is text.

    xgrammar reads the vocabulary's strings and treats only empty ones as special: from a GGUF
    tokenizer `<|endoftext|>` is the text "<|endoftext|>", legal anywhere a string may hold it, and
    the engine would end a request on it (an EOS) in the middle of a JSON string. Emptying their
    strings makes every special token illegal inside every grammar; the stop tokens stay legal
    where the grammar may end."""
    kw = {} if stop_token_ids is None else {"stop_token_ids": stop_token_ids}
    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, **kw)
    specials = special_token_ids(tokenizer)
    if not specials:
        return base
    encoded = [""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size and i not in specials:
            encoded[i] = token
    return xgr.TokenizerInfo(encoded, base.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=list(base.stop_token_ids), add_prefix_space=base.add_prefix_space)


def default_compile_workers() -> int:
    """Half the cores this process may run on, 2 to 16: the rest is the step's (its thread, the
    grammar mask threads, the tokenizer)."""
    return max(2, min(16, available_cores() // 2))


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 2


def canonical_schema(schema: Any, ordered: bool = False) -> Any:
    """The schema with sorted keys, except where order means something to xgrammar: a `properties`
    map (properties are emitted in declaration order) and enum/const values (emitted as written)."""
    if isinstance(schema, list):
        return [canonical_schema(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    if ordered:
        return {k: canonical_schema(v) for k, v in schema.items()}
    return {k: schema[k] if k in ("enum", "const") else canonical_schema(schema[k], k == "properties")
            for k in sorted(schema)}


class Latency:
    """Seconds observed: Prometheus buckets for /metrics, recent samples for exact percentiles."""

    BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

    def __init__(self, recent: int = 4096):
        self.counts = [0] * (len(self.BUCKETS) + 1)  # the last is +Inf
        self.sum = 0.0
        self.recent: deque = deque(maxlen=recent)

    def observe(self, s: float) -> None:
        self.counts[bisect.bisect_left(self.BUCKETS, s)] += 1
        self.sum += s
        self.recent.append(s)

    def snapshot(self) -> dict:
        r = sorted(self.recent)
        q = (lambda p: r[min(len(r) - 1, int(p * len(r)))] if r else 0.0)
        return {"buckets": list(zip(self.BUCKETS + (math.inf,), itertools.accumulate(self.counts))),
                "sum": self.sum, "count": sum(self.counts), "p50": q(0.5), "p99": q(0.99),
                "max": r[-1] if r else 0.0}


class _Job:
    """One compile, shared by every request whose grammar normalizes to `key`."""
    __slots__ = ("key", "spec", "prepared", "done", "queued", "started", "overran", "waiters")

    def __init__(self, key, spec: GrammarSpec, prepared: Optional[str]):
        self.key, self.spec, self.prepared = key, spec, prepared
        self.done: Future = Future()
        self.queued = time.monotonic()
        self.started: Optional[float] = None
        self.overran = False
        self.waiters: list = []  # (Future, timeout_s) of the requests waiting on it


class GrammarBackend:
    """One per (tokenizer, model vocab). Owns the xgrammar compiler, its workers and the caches.

    Compiles are queued (FIFO) to `compile_workers` threads. The timeout counts a grammar's own
    compile time, from the moment a worker starts it: time in the queue is latency, never a
    refusal. xgrammar cannot cancel a compile, so one that overruns keeps its thread (and its
    result is cached when it ends) while a spare thread takes its place in the pool."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: Optional[int] = None,
                 compile_timeout_s: float = 30.0, cache_size: int = 512,
                 compile_workers: Optional[int] = None, any_whitespace: bool = True,
                 max_whitespace_cnt: Optional[int] = None,
                 stop_token_ids: Optional[List[int]] = None, cache_dir: Optional[str] = None,
                 max_queue: int = 4096, persist_min_s: float = 0.05):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.bitmask_width = math.ceil(self.vocab_size / 32)
        self.compile_timeout_s = float(compile_timeout_s)
        self.any_whitespace = any_whitespace
        self.max_whitespace_cnt = max_whitespace_cnt
        self.tokenizer_info = tokenizer_info_without_specials(tokenizer, self.vocab_size, stop_token_ids)
        self._special_ids = frozenset(self.tokenizer_info.special_token_ids)
        self.compile_workers = max(1, compile_workers or default_compile_workers())
        # xgrammar's own threads per compile: the workers together use about half the cores
        max_threads = max_threads or max(1, min(8, available_cores() // (2 * self.compile_workers)))
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads,
                                            cache_enabled=False)
        self.disk = None
        if cache_dir:
            try:
                fp = fingerprint(self.tokenizer_info, self.vocab_size, any_whitespace=any_whitespace,
                                 max_whitespace_cnt=max_whitespace_cnt)
                self.disk = DiskCache(cache_dir, fp)
            except Exception as e:  # noqa: BLE001 (an unusable folder only loses the cache)
                log.warning("grammar cache disabled: %s: %s", cache_dir, e)
        self._cache: "OrderedDict[tuple, Any]" = OrderedDict()  # key -> CompiledGrammar|GrammarError
        self._cache_size = cache_size
        # raw spec key -> normalized key (or the schema's GrammarError): repeats skip prepare_schema
        self._front: "OrderedDict[tuple, Any]" = OrderedDict()
        self._jobs: dict = {}  # key -> _Job, queued or compiling
        self._queue: deque = deque()
        self._max_queue = max_queue
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # workers wait here for a job
        self._tick = threading.Condition(self._lock)  # the watchdog waits here for a deadline
        self._running: set = set()  # jobs a worker is compiling
        self._closed = False
        self._threads = 0
        self._saving = 0  # compiled grammars being written to disk
        self.persist_min_s = persist_min_s
        self._stats = {"compile_count": 0, "cache_hits": 0, "cache_misses": 0,
                       "compile_seconds_total": 0.0, "compile_seconds_max": 0.0,
                       "compile_errors": 0, "compile_timeouts": 0, "schema_refusals": 0,
                       "disk_hits": 0, "disk_errors": 0, "disk_writes": 0, "spare_threads_started": 0}
        self._compile_latency = Latency()
        self._queue_wait = Latency()
        self.refusals_by_keyword: dict = {}
        for _ in range(self.compile_workers):
            self._spawn()
        threading.Thread(target=self._watchdog, name="grammar-compile-watchdog", daemon=True).start()

    # ---------------------------------------------------------------- compile
    @property
    def stats(self) -> dict:
        with self._lock:
            d = dict(self._stats)
            d["cache_size"] = len(self._cache)
            d["inflight"] = len(self._jobs)
            d["queue_depth"] = len(self._queue)
            d["compiling"] = len(self._running)
            d["disk_saving"] = self._saving
            d["compile_workers"] = self.compile_workers
            d["compile_latency"] = self._compile_latency.snapshot()
            d["queue_wait"] = self._queue_wait.snapshot()
            d["refusals_by_keyword"] = dict(self.refusals_by_keyword)
        return d

    def _normalize(self, spec: GrammarSpec):
        """(key, prepared): the compile key and the schema text handed to xgrammar. Schemas that
        differ only in annotations or key order share a key."""
        if spec.kind != "json_schema":
            return spec.key, None
        try:
            prepared = prepare_schema(json.loads(spec.value), spec.strict)
        except GrammarError as e:
            with self._lock:
                self._stats["schema_refusals"] += 1
                k = e.keyword or "other"
                self.refusals_by_keyword[k] = self.refusals_by_keyword.get(k, 0) + 1
            raise
        prepared = json.dumps(canonical_schema(prepared), separators=(",", ":"), ensure_ascii=False)
        return ("json_schema", prepared, spec.strict), prepared

    def _xgr_compile(self, spec: GrammarSpec, prepared: Optional[str]):
        try:
            if spec.kind == "json_schema":
                return self.compiler.compile_json_schema(
                    prepared, any_whitespace=self.any_whitespace, strict_mode=spec.strict,
                    max_whitespace_cnt=self.max_whitespace_cnt)
            if spec.kind == "json_object":
                return self.compiler.compile_json_schema(
                    '{"type":"object"}', any_whitespace=self.any_whitespace, strict_mode=False,
                    max_whitespace_cnt=self.max_whitespace_cnt)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.value)
            if spec.kind == "ebnf":
                return self.compiler.compile_grammar(spec.value)
            if spec.kind == "choice":
                opts = json.loads(spec.value)
                return self.compiler.compile_grammar("root ::= " + " | ".join(_ebnf_string(o) for o in opts))
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with a C++ trace
            msg = str(e).strip().splitlines()
            msg = msg[-1] if msg else repr(e)
            msg = msg.split(": ", 1)[-1] if "/project/cpp/" in msg else msg
            with self._lock:
                self._stats["compile_errors"] += 1
            raise GrammarError(f"{spec.kind} failed to compile: {msg}") from None
        raise GrammarError(f"unknown grammar kind '{spec.kind}'")

    def _build(self, spec: GrammarSpec, prepared: Optional[str] = None, key=None) -> CompiledGrammar:
        """Loads the compiled grammar from disk, or compiles it (GrammarError if xgrammar fails)."""
        name = self.disk.name(key) if self.disk is not None and key is not None else None
        if name is not None:
            text = self.disk.get(name)
            if text is not None:
                t0 = time.perf_counter()
                try:
                    cg = xgr.CompiledGrammar.deserialize_json(text, self.tokenizer_info)
                except Exception as e:  # noqa: BLE001 (a file from a crash or another build)
                    log.warning("grammar cache: cannot load %s (%s); compiling", name, e)
                    self.disk.drop(name)
                    with self._lock:
                        self._stats["disk_errors"] += 1
                else:
                    with self._lock:
                        self._stats["disk_hits"] += 1
                    return CompiledGrammar(spec, cg, time.perf_counter() - t0, prepared, _memory(cg), True)
        t0 = time.perf_counter()
        cg = self._xgr_compile(spec, prepared)
        dt = time.perf_counter() - t0
        with self._lock:
            self._stats["compile_count"] += 1
            self._stats["compile_seconds_total"] += dt
            self._stats["compile_seconds_max"] = max(self._stats["compile_seconds_max"], dt)
            self._compile_latency.observe(dt)
        return CompiledGrammar(spec, cg, dt, prepared, _memory(cg))

    def _persist(self, key, compiled: CompiledGrammar) -> None:
        """Saves a compile worth saving. A saved grammar loads at about 60 MB/s of xgrammar's JSON
        (read, zlib and deserialize_json on the dev VM: 112 MB in 1.8 s for a 4.2 s compile,
        167 MB in 3.7 s for a 4.8 s one): one whose text would load slower than half its compile
        is not kept, nor one that compiled faster than persist_min_s (the median dev schema:
        11 ms to compile, 17 ms to load). With persist_min_s 0 every compile is saved."""
        try:
            text = compiled.xgr_compiled.serialize_json()
            if self.persist_min_s and len(text) > compiled.compile_seconds * 30e6:
                return
            self.disk.put(self.disk.name(key), text)
        except Exception as e:  # noqa: BLE001
            log.warning("grammar cache: cannot save a compiled grammar: %s", e)
            with self._lock:
                self._stats["disk_errors"] += 1
            return
        with self._lock:
            self._stats["disk_writes"] += 1

    def _spawn(self) -> None:
        self._threads += 1
        threading.Thread(target=self._worker, name="grammar-compile", daemon=True).start()

    def _worker(self) -> None:
        while True:
            with self._work:
                while not self._queue and not self._closed:
                    self._work.wait()
                if self._closed:
                    self._threads -= 1
                    return
                job = self._queue.popleft()
                job.started = time.monotonic()
                self._queue_wait.observe(job.started - job.queued)
                self._running.add(job)
                self._tick.notify()
            try:
                value = self._build(job.spec, job.prepared, job.key)
            except GrammarError as e:
                value = e
            except Exception as e:  # noqa: BLE001 (a bug here must not kill the worker)
                log.exception("grammar compile failed")
                value = GrammarError(f"{job.spec.kind} failed to compile: {e}")
            with self._lock:
                self._store(job.key, value)
                del self._jobs[job.key]
                self._running.discard(job)
                # the thread of an overrun was replaced by a spare: one of them goes
                retire = job.overran and self._threads > self.compile_workers
                if retire:
                    self._threads -= 1
            if isinstance(value, GrammarError):
                job.done.set_exception(value)
            else:
                job.done.set_result(value)
                if self.disk is not None and not value.from_disk and value.compile_seconds >= self.persist_min_s:
                    with self._lock:
                        self._saving += 1
                    self._persist(job.key, value)
                    with self._lock:
                        self._saving -= 1
            if retire:
                return

    def _store(self, key, value) -> None:  # under the lock
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _overran(self, job: _Job) -> None:
        with self._lock:
            if job.overran or job.done.done():
                return
            job.overran = True
            self._stats["compile_timeouts"] += 1
            if self._threads < 2 * self.compile_workers and not self._closed:
                self._stats["spare_threads_started"] += 1
                self._spawn()
        log.warning("grammar compile still running after its %gs timeout (%s)", self.compile_timeout_s,
                    job.spec.kind)

    def compile_async(self, spec: GrammarSpec, timeout_s: Optional[float] = None) -> Future:
        """Future[CompiledGrammar]: fails with GrammarError when the grammar is refused, fails to
        compile, or its compile runs longer than timeout_s. Raises GrammarBusy when the queue is full."""
        timeout_s = self.compile_timeout_s if timeout_s is None else timeout_s
        out: Future = Future()
        with self._lock:
            key = self._front.get(spec.key)
            if key is not None:
                self._front.move_to_end(spec.key)
        if key is None:
            try:
                key, prepared = self._normalize(spec)
            except GrammarError as e:
                key = e
            with self._lock:
                self._front[spec.key] = key
                while len(self._front) > 4 * self._cache_size:
                    self._front.popitem(last=False)
        else:
            prepared = key[1] if spec.kind == "json_schema" and not isinstance(key, GrammarError) else None
        if isinstance(key, GrammarError):
            out.set_exception(key)
            return out
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self._stats["cache_hits"] += 1
            else:
                job = self._jobs.get(key)
                if job is None:
                    if len(self._queue) >= self._max_queue:
                        raise GrammarBusy(f"{len(self._queue)} grammars are waiting to compile; retry later")
                    self._stats["cache_misses"] += 1
                    job = self._jobs[key] = _Job(key, spec, prepared)
                    self._queue.append(job)
                    self._work.notify()
        if hit is not None:
            if isinstance(hit, GrammarError):
                out.set_exception(hit)
            else:
                out.set_result(hit if hit.spec == spec else dataclasses.replace(hit, spec=spec))
            return out

        def relay(f: Future) -> None:
            exc = f.exception()
            value = None if exc is not None else f.result()
            if value is not None and value.spec != spec:
                value = dataclasses.replace(value, spec=spec)
            try:
                if exc is not None:
                    out.set_exception(exc)
                else:
                    out.set_result(value)
            except InvalidStateError:  # timed out first
                pass

        if timeout_s and timeout_s > 0:
            with self._lock:
                job.waiters.append((out, timeout_s))
                if job.started is not None:
                    self._tick.notify()
        job.done.add_done_callback(relay)
        return out

    def _watchdog(self) -> None:
        """Fails the requests whose grammar has compiled longer than their timeout."""
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return
                    now, expired, wake = time.monotonic(), [], None
                    for job in self._running:
                        job.waiters = [w for w in job.waiters if not w[0].done()]
                        for out, timeout_s in job.waiters:
                            deadline = job.started + timeout_s
                            if deadline <= now:
                                expired.append((job, out, timeout_s))
                            else:
                                wake = deadline if wake is None else min(wake, deadline)
                    if expired:
                        break
                    self._tick.wait(None if wake is None else wake - now)
            for job, out, timeout_s in expired:
                self._overran(job)
                try:
                    out.set_exception(GrammarError(f"compile exceeded {timeout_s:g}s: this grammar is too "
                                                   "large or complex to compile in time"))
                except InvalidStateError:  # the compile ended meanwhile
                    pass

    def compile(self, spec: GrammarSpec, timeout_s: Optional[float] = None) -> CompiledGrammar:
        """Synchronous compile (cached); raises GrammarError (refusal, compile error, timeout)."""
        return self.compile_async(spec, timeout_s).result()

    def validate(self, spec: GrammarSpec) -> None:
        """Cheap up-front check (no compilation): raises GrammarError for refused schemas."""
        if spec.kind == "json_schema":
            prepare_schema(json.loads(spec.value), spec.strict)

    # ---------------------------------------------------------------- matching
    def matcher(self, compiled: CompiledGrammar) -> RequestMatcher:
        return RequestMatcher(compiled, self.vocab_size, self._special_ids)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        pin = torch.cuda.is_available()
        return torch.full((rows, self.bitmask_width), -1, dtype=torch.int32, pin_memory=pin)

    @staticmethod
    def reset_bitmask(bitmask: torch.Tensor) -> None:
        bitmask.fill_(-1)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      indices: Optional[List[int]] = None) -> None:
        """Mask logits in place (-inf where the bit is 0). logits [N, V] on CPU or CUDA.

        Columns beyond the bitmask's coverage (V > 32*width) are set to -inf, as they are not
        tokens the grammar can produce."""
        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        v = logits.shape[-1]
        covered = min(v, bitmask.shape[-1] * 32, self.vocab_size)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=covered, indices=indices)
        if v > covered:
            if indices is None:
                logits[..., covered:] = float("-inf")
            else:
                idx = torch.as_tensor(indices, device=logits.device, dtype=torch.long)
                logits[idx, covered:] = float("-inf")

    def close(self) -> None:
        """Stops the workers once their compiles end; queued compiles fail."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
            for job in queued:
                del self._jobs[job.key]
            self._work.notify_all()
            self._tick.notify_all()
        for job in queued:
            job.done.set_exception(GrammarError("the grammar backend was closed"))

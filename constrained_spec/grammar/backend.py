"""The grammar backends behind one front: which one compiles a request's grammar, its compile
queue and caches, its matchers and the bitmask buffers.

Two backends (docs/constraints.md has the decision table):
* xgrammar (`xgrammar_backend.py`): JSON schemas through our normalizer, which refuses what it cannot
  make xgrammar enforce exactly; precomputed masks, so the cheapest fill per step, but compiles of
  10 ms to seconds;
* llguidance (`llguidance_backend.py`): JSON Schema enforced by llguidance itself (it refuses what it
  cannot enforce), ~1 ms compiles, masks computed per step.
A request names one (`GrammarSpec.backend`) or leaves it to the server's default; "auto" takes
llguidance and falls back to the normalizer and xgrammar where llguidance refuses, so a schema is
refused (naming the keyword) only when neither enforces it. EBNF is xgrammar's (its GBNF dialect is
the API's).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import List, Optional

import numpy as np
import torch
import xgrammar as xgr

from ..cpus import available_cores
from . import llguidance_backend, xgrammar_backend
from .compile_queue import CompiledGrammar, CompileQueue, Latency, SlowLane  # noqa: F401 (re-exported)
from .bounded_lru import BoundedLRU
from .compile_queue import text_bytes
from .dead_branches import productivity
from .errors import GrammarBusy, GrammarError
from .llguidance_backend import LLGuidanceCompiler, LLGuidanceMatcher
from .matcher import REFUSED_DRAFT, RequestMatcher, legal_draft_nodes  # noqa: F401 (re-exported)
from .schema import prepare_schema
from .schema_refs import has_ref_cycle
from .spec import BACKENDS, GrammarSpec
from .xgrammar_backend import (XGrammarCompiler, XGrammarMatcher, canonical_schema,  # noqa: F401
                               special_token_ids, tokenizer_info_without_specials)

log = logging.getLogger("constrained_spec.grammar")

XGRAMMAR, LLGUIDANCE, AUTO = "xgrammar", "llguidance", "auto"
# The most raw and normalized schema text the front cache holds: bounded by count alone (2,048
# entries), distinct 0.5 MB schemas held 1-2 GB.
FRONT_CACHE_BYTES = 64 << 20


def default_compile_workers() -> int:
    """Half the cores this process may run on, 2 to 16: the rest is the step's (its thread, the
    grammar mask threads, the tokenizer)."""
    return max(2, min(16, available_cores() // 2))


class GrammarBackend:
    """One per (tokenizer, model vocab): both backends' compilers, the compile queue they share, and
    the choice between them."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: Optional[int] = None,
                 compile_timeout_s: float = 30.0, cache_size: int = 512, cache_bytes: int = 512 << 20,
                 compile_workers: Optional[int] = None, any_whitespace: bool = True,
                 max_whitespace_cnt: Optional[int] = None,
                 stop_token_ids: Optional[List[int]] = None, cache_dir: Optional[str] = None,
                 max_queue: int = 4096, persist_min_s: float = 0.05, default_backend: str = AUTO,
                 disk_cache_bytes: int = 1 << 30):
        if default_backend not in BACKENDS:
            raise ValueError(f"grammar backend must be one of {', '.join(BACKENDS)}, not {default_backend!r}")
        self.default_backend = default_backend
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.bitmask_width = math.ceil(self.vocab_size / 32)
        self.compile_timeout_s = float(compile_timeout_s)
        self.tokenizer_info = tokenizer_info_without_specials(tokenizer, self.vocab_size, stop_token_ids)
        self.stop_token_ids = frozenset(self.tokenizer_info.stop_token_ids)
        self._special_ids = frozenset(self.tokenizer_info.special_token_ids)
        # their texts (`<|im_end|>`, `<filename>`), which llguidance lets the model write as the token
        self._special_texts = _special_texts(tokenizer, self._special_ids | self.stop_token_ids)
        self.compile_workers = max(1, compile_workers or default_compile_workers())
        # xgrammar's own threads per compile: the workers together use about half the cores
        max_threads = max_threads or max(1, min(8, available_cores() // (2 * self.compile_workers)))
        self.xgrammar = XGrammarCompiler(self.tokenizer_info, self.vocab_size, max_threads, any_whitespace,
                                         max_whitespace_cnt, cache_dir, persist_min_s, disk_cache_bytes)
        self._llguidance: Optional[LLGuidanceCompiler] = None  # built on first use (~0.3-1.5 s)
        self._llguidance_error: Optional[GrammarError] = None  # why it cannot serve this tokenizer
        self._llg_lock = threading.Lock()
        self._max_whitespace_cnt = max_whitespace_cnt
        self.queue = CompileQueue(self.compile_workers, self.compile_timeout_s, cache_size, max_queue, cache_bytes)
        self._lock = threading.Lock()
        # raw spec key -> (normalized xgrammar key, prepared text) or the schema's GrammarError: repeats
        # skip prepare_schema. Bounded by count and by the texts held
        self._front = BoundedLRU(4 * cache_size, FRONT_CACHE_BYTES, text_bytes)
        self._front_size = 4 * cache_size
        self._stats = {"schema_refusals": 0, "served_by_xgrammar": 0, "served_by_llguidance": 0,
                       "llguidance_fallbacks": 0, "auto_served_by_xgrammar": 0, "dead_branches_pruned": 0}
        # auto: how often each grammar came, by a digest of its text (`_digest`): a count needs no text
        self._auto_seen: "OrderedDict[bytes, int]" = OrderedDict()
        self._background: set = set()  # xgrammar keys compiling in the background (auto)
        # auto: grammars whose llguidance matcher failed in a request (`runtime_failure`), by digest
        self._llguidance_failed: "OrderedDict[bytes, None]" = OrderedDict()
        self.refusals_by_keyword: dict = {}

    # -- the backends ----------------------------------------------------------------------------
    @property
    def llguidance(self) -> LLGuidanceCompiler:
        if self._llguidance is None:
            with self._llg_lock:
                if self._llguidance_error is not None:  # every request under auto would ask again
                    raise self._llguidance_error
                if self._llguidance is None:
                    try:
                        self._llguidance = LLGuidanceCompiler(
                            self.tokenizer, self.vocab_size, self.stop_token_ids,
                            self._special_ids | special_token_ids(self.tokenizer), self._max_whitespace_cnt)
                    except GrammarError as e:
                        log.warning("llguidance cannot serve this model (xgrammar serves every grammar): %s", e)
                        self._llguidance_error = e
                        raise
        return self._llguidance

    def warm_up(self) -> None:
        """Builds now what the first grammar would otherwise wait for: llguidance's tokenizer (~1 s
        for a 49k vocabulary), when llguidance may serve. A server calls it before it says ready."""
        if self.default_backend != "xgrammar":
            try:
                self.llguidance
            except GrammarError:
                pass  # logged; xgrammar serves

    def backend_for(self, spec: GrammarSpec) -> str:
        """The backend asked for: the spec's, else the server's default (possibly "auto")."""
        return spec.backend or self.default_backend

    # -- compile ---------------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        d = self.queue.stats
        d.update(self.xgrammar.disk_stats)
        with self._lock:
            d.update(self._stats)
            d["refusals_by_keyword"] = dict(self.refusals_by_keyword)
        return d

    def compile_async(self, spec: GrammarSpec, timeout_s: Optional[float] = None, check_only: bool = False) -> Future:
        """Future[CompiledGrammar]: fails with GrammarError when the grammar is refused, fails to
        compile, or its compile runs longer than timeout_s. Raises GrammarBusy when the queue is full.
        `check_only`: the server's up-front compile (a refusal answers 400 before the request is
        queued), not a use of the grammar: `auto` counts only the request's own compile."""
        choice = self.backend_for(spec)
        if choice == XGRAMMAR or (choice == AUTO and (spec.kind == "ebnf" or self._failed_under_llguidance(spec))):
            try:
                key, prepared = self._normalize(spec)
            except GrammarError as e:
                out: Future = Future()
                out.set_exception(e)
                return out
            return self.queue.submit(key, spec, lambda: self._build(spec, prepared, key),
                                     self.xgrammar.persist_call(key), timeout_s, slow=True)
        if choice == AUTO and not check_only:
            ready = self._xgrammar_if_compiled(spec)
            if ready is not None:
                return ready
        key = (choice,) + spec.key[:3]
        return self.queue.submit(key, spec, lambda: self._build(spec, None, key), None, timeout_s)

    def runtime_failure(self, compiled: CompiledGrammar) -> None:
        """A request's llguidance matcher failed on a token its own mask allowed: one of
        llguidance's lazily built limits, reached later than `_probe_llguidance` looks. Under auto
        the grammar's next requests go to xgrammar, as they would had the probe caught it."""
        if compiled.backend != LLGUIDANCE or self.backend_for(compiled.spec) != AUTO:
            return
        with self._lock:
            self._llguidance_failed[_digest(compiled.spec)] = None
            while len(self._llguidance_failed) > self._front_size:
                self._llguidance_failed.popitem(last=False)

    def _failed_under_llguidance(self, spec: GrammarSpec) -> bool:
        if not self._llguidance_failed:  # the common case: no digest to compute
            return False
        with self._lock:
            return _digest(spec) in self._llguidance_failed

    def _xgrammar_if_compiled(self, spec: GrammarSpec) -> Optional[Future]:
        """Under auto, a grammar seen before is also compiled by xgrammar, in the background (never
        in a request's way); once that is done its requests take xgrammar's grammar: its masks cost
        a fraction of llguidance's at large batches (H100, benchmarks/results/gpu_backends.md:
        JSON / plain 0.95 under xgrammar and 0.54 under llguidance at batch 64). A grammar seen once
        (most of a many-schema workload) costs nothing here; one the normalizer refuses stays
        llguidance's. None: llguidance's path as usual."""
        digest = _digest(spec)
        with self._lock:
            seen = self._auto_seen.pop(digest, 0) + 1
            self._auto_seen[digest] = seen
            while len(self._auto_seen) > self._front_size:
                self._auto_seen.popitem(last=False)
        if seen < 2:
            return None
        try:
            key, prepared = self._normalize(spec, count=False)
        except GrammarError:
            return None
        hit = self.queue.cached(key, spec)
        if hit is not None:
            with self._lock:
                self._stats["auto_served_by_xgrammar"] += 1
            out: Future = Future()
            out.set_result(hit)
            return out
        with self._lock:
            if key in self._background or len(self._background) >= max(1, self.compile_workers // 2):
                return None  # compiling already, or enough background compiles hold workers
            self._background.add(key)
        try:
            done = self.queue.submit(key, spec, lambda: self._build(spec, prepared, key),
                                     self.xgrammar.persist_call(key), timeout_s=0, slow=True)
        except GrammarBusy:
            with self._lock:
                self._background.discard(key)
            return None
        done.add_done_callback(lambda _f, key=key: self._background_done(key))
        return None

    def _background_done(self, key) -> None:
        with self._lock:
            self._background.discard(key)

    def compile(self, spec: GrammarSpec, timeout_s: Optional[float] = None) -> CompiledGrammar:
        """Synchronous compile (cached); raises GrammarError (refusal, compile error, timeout)."""
        return self.compile_async(spec, timeout_s).result()

    def validate(self, spec: GrammarSpec) -> None:
        """Cheap up-front check for the xgrammar path (no compilation): raises GrammarError for
        schemas the normalizer refuses."""
        if spec.kind == "json_schema" and self.backend_for(spec) == XGRAMMAR:
            prepare_schema(json.loads(spec.value), spec.strict)

    def _normalize(self, spec: GrammarSpec, count: bool = True):
        """The xgrammar key and prepared schema, through the front cache; GrammarError (counted by
        keyword, if `count`) where the normalizer refuses."""
        with self._lock:
            hit = self._front.get(spec.key)
        if hit is None:
            try:
                hit = self.xgrammar.normalize(spec)
            except GrammarError as e:
                hit = e
            with self._lock:
                self._front.put(spec.key, hit)  # replaces another thread's, normalized meanwhile
        if isinstance(hit, GrammarError):
            if count and spec.kind == "json_schema":  # /metrics counts schema refusals by keyword
                self._count_refusal(hit)
            raise hit
        return hit

    def _count_refusal(self, e: GrammarError) -> None:
        with self._lock:
            self._stats["schema_refusals"] += 1
            k = e.keyword or "other"
            self.refusals_by_keyword[k] = self.refusals_by_keyword.get(k, 0) + 1

    def _build(self, spec: GrammarSpec, prepared: Optional[str] = None, key=None) -> CompiledGrammar:
        """On a compile worker: the grammar compiled by the backend `key` names (GrammarError if it
        refuses or fails); "auto" tries llguidance, then the normalizer and xgrammar (in the
        queue's slow lane: `SlowLane`)."""
        backend = key[0]
        if backend == XGRAMMAR:
            return self._build_xgrammar_checked(spec, prepared, key)
        # llguidance refuses by itself a regex, or a schema without recursion, that accepts nothing,
        # and masks out their dead branches (its lexer sees a pattern or a class match nothing)
        if spec.kind == "ebnf" or _recursive_schema(spec):
            pruned = self._refuse_if_unproductive(spec)
            if pruned is not None:
                raise self._served_pruned(spec, pruned)
        special = self._special_text_in(spec)
        if special is not None:
            raise self._served_past_llguidance(spec, special)
        try:
            compiled = self._build_llguidance(spec)
        except GrammarError as refusal:
            raise self._not_llguidance(spec, backend, refusal)
        failed = self._probe_llguidance(compiled)  # raises the refusal of a grammar that accepts no string
        if failed:
            refusal = GrammarError(f"llguidance cannot serve this {spec.kind} grammar: {failed}")
            raise self._not_llguidance(spec, backend, refusal)
        return compiled

    def _not_llguidance(self, spec: GrammarSpec, backend: str, refusal: GrammarError) -> Exception:
        """What to raise where llguidance refused the grammar or cannot serve it: under llguidance
        the refusal; under auto `SlowLane`, to the normalizer and xgrammar (the normalizer's refusal
        names the keyword)."""
        if backend == LLGUIDANCE:
            if spec.kind == "json_schema":
                self._count_refusal(refusal)
            return refusal
        with self._lock:
            self._stats["llguidance_fallbacks"] += 1
        xkey, prepared = self._normalize(spec)
        return SlowLane(lambda: self._build_xgrammar_checked(spec, prepared, xkey))

    def _served_pruned(self, spec: GrammarSpec, pruned) -> SlowLane:
        """Under llguidance or auto, a grammar with dead branches (`_refuse_if_unproductive`) is
        served by xgrammar's grammar of it without them, in the slow lane (an xgrammar compile).

        Why not llguidance's: it builds its own grammar from the spec (its JSON-schema converter;
        for EBNF its GBNF-to-Lark conversion, which makes some rules lexemes), whose rules we cannot
        reach to prune, and its masks, like xgrammar's, let a request into a branch it can never
        leave (finish "length", the output never valid). xgrammar's pruned grammar accepts the same
        strings as the spec: the dead branches held none, and a schema checked here is one the
        normalizer accepted, which it only does where xgrammar enforces it exactly (EBNF is
        xgrammar's dialect). So the answer a demanding user wants, a complete and valid output for
        a grammar that has one, is served, where a 400 would refuse a grammar that the other
        backends serve; what changes is the compile's cost (xgrammar's, once per grammar, cached
        in memory under the request's key; saved to disk only where xgrammar's own key compiles it,
        as auto's second use of a grammar does) and the metrics' backend (served_by_xgrammar, and
        dead_branches_pruned in the stats). A regex or a schema without recursion
        never comes here: llguidance masks out their dead branches by itself (a pattern or class
        that matches nothing is an empty lexeme to it)."""
        xkey, prepared = self._normalize(spec)
        return SlowLane(lambda: self._refuse_if_empty(self._build_xgrammar(spec, prepared, xkey, pruned)))

    def _special_text_in(self, spec: GrammarSpec) -> Optional[str]:
        """The text of a special token that the grammar may spell, or None: its text with escapes
        read (`\\x7c`, `\\u007c`, `\\|`) and the punctuation of regexes, EBNF and JSON dropped
        (groups, classes, quotes, `|`, blanks) holds the token's text without its `|`s, as
        `<[|]im_start[|]>`, `(<)(reponame)(>)` and `"<" "filename" ">"` do. A grammar that only
        matches such a text through a wider class (`<[a-z_]+>`) is not found here, nor needs to be:
        llguidance offers the special token only where the grammar forces its whole text (it tokenizes
        forced text with the tokenizer, which reads it as the token)."""
        value = _SPELLING_PUNCTUATION.sub("", _ESCAPE.sub(_unescape, spec.value))
        return next((t for t, bare in self._special_texts if bare in value), None)

    def _served_past_llguidance(self, spec: GrammarSpec, special: str) -> SlowLane:
        """A grammar whose text holds a special token's text (a choice `<|endoftext|>`, a JSON
        const `x<filename>y`) is served by xgrammar, under llguidance too: llguidance's masks let
        the model write that text as the special token itself, the one token a model would pick
        for it, which no matcher takes as text (the request failed in mid-answer). xgrammar spells
        it in ordinary tokens."""
        log.info("grammar holds %r, a special token's text: served by xgrammar", special)
        with self._lock:
            self._stats["llguidance_fallbacks"] += 1
        xkey, prepared = self._normalize(spec)
        return SlowLane(lambda: self._build_xgrammar_checked(spec, prepared, xkey))

    def _build_xgrammar_checked(self, spec: GrammarSpec, prepared: Optional[str], key) -> CompiledGrammar:
        # the normalizer or xgrammar refuses a schema's other contradictions (min > max, an empty
        # enum, ...): what is left to check is recursion and a pattern that matches nothing
        if spec.kind != "json_schema" or '"pattern' in prepared or _recursive_schema(spec):
            pruned = self._refuse_if_unproductive(spec, prepared)  # before the compile it would spare
            if pruned is not None:
                return self._refuse_if_empty(self._build_xgrammar(spec, prepared, key, pruned))
        return self._refuse_if_empty(self._build_xgrammar(spec, prepared, key))

    def _probe_llguidance(self, compiled: CompiledGrammar) -> Optional[str]:
        """Why llguidance cannot serve the grammar, or None. Its parser builds rows and lexer
        lazily: a grammar past their limits (a row of over 2,000 items, as a wide choice or anyOf
        makes; a lexer of too many expressions, as `a{1000000}` or an enum of 60,000 strings)
        compiled, then failed at a request's first or second token, an error in mid-answer. One
        token accepted and the next mask computed on a matcher of its own find that here, where
        auto falls back to xgrammar (a later failure: `runtime_failure`). The same matcher's start says whether the
        grammar accepts any string (`_refuse_if_empty`'s check, which raises its refusal here): a
        matcher costs ~0.4 ms to build, most of what each check cost when each built its own."""
        m = self.fresh_matcher(compiled)
        ends = m.can_terminate()
        first = self._first_token(m)
        if first is None:  # nothing to accept
            failed = m.error()  # "NoExtensionBias" is llguidance's word for an empty mask, which is ours to read;
            if failed and "NoExtensionBias" not in failed:  # another (a limit of its parser) says nothing of the language
                return failed
            if ends:
                return None
            raise self._empty_refusal(compiled.spec)
        if m.error() is None:
            m.accept_token(first)
        if m.error() is None and not m.is_terminated():
            self._first_token(m)  # the second mask: a huge enum's lexer overflows past its opening quote
        return m.error() or None

    def _refuse_if_unproductive(self, spec: GrammarSpec, prepared: Optional[str] = None) -> Optional["xgr.Grammar"]:
        """GrammarError if the grammar accepts no finite string (`root ::= "a" root`; a schema whose
        required property is a `$ref` to the schema itself): its masks always allow a token, so
        `_refuse_if_empty` lets it through, and its requests wrote until max_tokens, their output
        never complete. Checked on xgrammar's grammar of the spec (`productivity`; 2.4 ms for
        the median dev schema checked, 57 ms for the largest) before either backend compiles it. A
        JSON schema is checked as the normalizer rewrites it (`prepared`, else normalized here);
        one the normalizer refuses, which only llguidance serves, is not checked.

        Returns xgrammar's grammar of the spec without its dead branches where the root can end but
        reaches alternatives that cannot (`root ::= "a" | d`, `d ::= "b" d`; an anyOf branch that
        requires itself, or needs a pattern that matches nothing), which is what its requests are
        to be served (`_build_xgrammar`, `_served_pruned`); else None: the spec compiles as it is."""
        if prepared is None and spec.kind == "json_schema":
            try:
                _, prepared = self._normalize(spec, count=False)
            except GrammarError:
                return None
        grammar = self.xgrammar.grammar(spec, prepared)
        dead, pruned = productivity(grammar) if grammar is not None else ([], None)
        if not dead:
            return pruned
        if spec.kind == "json_schema":
            recursion = ("each value would have to contain another without end: a required property or array "
                         "item leads through '$ref' back to a schema that requires it again")
            # a schema that does not recurse can only be refused here for a pattern
            why = (recursion + " (or a pattern matches no string)" if _recursive_schema(spec)
                   else "a 'pattern' in it matches no string where the value needs one")
        elif spec.kind == "ebnf":
            named = [r for r in dead if re.search(r"(?m)^\s*" + re.escape(r) + r"\s*::=", spec.value)] or dead[:1]
            why = (f"rule {named[0]} never ends: each of its alternatives needs it again" if len(named) == 1 else
                   f"rules {', '.join(named[:5])} never end: each of their alternatives needs one of them again")
            why += ", or a character class that matches nothing"
        else:
            why = "a character class in it matches no character"
        error = GrammarError(f"the {spec.kind} grammar accepts no finite string: {why}")
        if spec.kind == "json_schema":
            self._count_refusal(error)
        raise error

    def _refuse_if_empty(self, compiled: CompiledGrammar) -> CompiledGrammar:
        """The compiled grammar, or GrammarError if it accepts no string at all (`{"$ref": "#"}`, a
        reference to itself and nothing else): its first mask would allow no token but a stop token
        its matcher refuses (llguidance) or none (xgrammar), and the request would fail in the engine
        instead of being refused up front. xgrammar's; llguidance's is `_probe_llguidance`'s, on the
        matcher it builds (`LLGuidanceCompiler.new_matcher`: a mask filled on the template or a copy
        of it can make later copies refuse valid text)."""
        m = self.fresh_matcher(compiled)
        if m.can_terminate() or self._first_token(m) is not None:
            return compiled
        raise self._empty_refusal(compiled.spec)

    def _first_token(self, m: RequestMatcher) -> Optional[int]:
        """The first token but a stop token that the matcher's mask allows, or None."""
        bitmask = torch.zeros((1, self.bitmask_width), dtype=torch.int32)
        m.fill_bitmask(bitmask, 0)
        return next((int(t) for t in self.allowed_tokens(bitmask[0]) if t not in self.stop_token_ids), None)

    def _empty_refusal(self, spec: GrammarSpec) -> GrammarError:
        error = GrammarError(f"the {spec.kind} grammar accepts no string"
                             + (": no JSON value satisfies the schema (a $ref cycle with nothing else, or "
                                "contradictory keywords)" if spec.kind == "json_schema" else ""))
        if spec.kind == "json_schema":
            self._count_refusal(error)
        return error

    def fresh_matcher(self, compiled: CompiledGrammar) -> RequestMatcher:
        """A matcher at the grammar's start that shares no state with the requests' matchers, for
        what only checks a grammar or an output (the empty-language probe, the mask audit's
        replays): an llguidance one is built from the grammar text (~0.4 ms), not copied from the
        template (`LLGuidanceCompiler.new_matcher` says why)."""
        if compiled.backend != LLGUIDANCE:
            return self.matcher(compiled)
        return self._llguidance_matcher(compiled, self.llguidance.new_matcher(compiled.prepared))

    def _build_xgrammar(self, spec: GrammarSpec, prepared: Optional[str], key, pruned=None) -> CompiledGrammar:
        """`pruned`: the spec's grammar without its dead branches (`_refuse_if_unproductive`), to
        compile (or load) instead of the spec's."""
        if pruned is not None:
            with self._lock:
                self._stats["dead_branches_pruned"] += 1
        loaded = self.xgrammar.load(spec, prepared, key, pruned is not None)
        if loaded is not None:
            return loaded
        t0 = time.perf_counter()
        try:
            cg = self.xgrammar.compile(spec, prepared, pruned)
        except GrammarError:
            self.queue.count_error()
            raise
        dt = time.perf_counter() - t0
        self.queue.observe_compile(dt)
        with self._lock:
            self._stats["served_by_xgrammar"] += 1
        return self.xgrammar.wrap(spec, cg, dt, prepared, pruned is not None)

    def _build_llguidance(self, spec: GrammarSpec) -> CompiledGrammar:
        compiler = self.llguidance  # its tokenizer is built on first use: not part of the compile
        t0 = time.perf_counter()
        template, text = compiler.compile(spec)
        dt = time.perf_counter() - t0
        self.queue.observe_compile(dt)
        with self._lock:
            self._stats["served_by_llguidance"] += 1
        return CompiledGrammar(spec, LLGUIDANCE, template, dt, prepared=text,
                               memory_bytes=llguidance_backend.memory_estimate(text))

    # -- matching --------------------------------------------------------------------------------
    def matcher(self, compiled: CompiledGrammar) -> RequestMatcher:
        if compiled.backend == LLGUIDANCE:
            return self._llguidance_matcher(compiled, compiled.grammar.deep_copy())
        return XGrammarMatcher(compiled, self.vocab_size, self._special_ids)

    def _llguidance_matcher(self, compiled: CompiledGrammar, ll_matcher) -> LLGuidanceMatcher:
        llg = self.llguidance
        return LLGuidanceMatcher(compiled, ll_matcher, self.vocab_size, llg.stop_token_ids, llg.special_ids)

    @staticmethod
    def allowed_tokens(row: torch.Tensor) -> np.ndarray:
        """The token ids one bitmask row allows (bit t of the row: token t)."""
        return np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little"))

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

    def close(self, wait_s: float | None = None) -> bool:
        """Stops the workers once their compiles end; queued compiles fail. Waits up to `wait_s` (the
        compile timeout by default) for the running ones; returns whether they all ended."""
        return self.queue.close(wait_s)


def _special_texts(tokenizer, ids) -> tuple[tuple[str, str], ...]:
    """(text, text without spelling punctuation) of the special tokens `ids` that text could spell
    (not blank, two characters or more)."""
    texts = tokenizer.convert_ids_to_tokens(sorted(ids))
    return tuple((t, _SPELLING_PUNCTUATION.sub("", t)) for t in texts if isinstance(t, str) and len(t.strip()) >= 2)


# what `_special_text_in` drops from a grammar's text (and a special token's) before comparing them
_SPELLING_PUNCTUATION = re.compile(r"""[()\[\]|"'\s^$?*+\\]""")
_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4}))")


def _unescape(m: "re.Match") -> str:
    return chr(int(m.group(1) or m.group(2), 16))


def _digest(spec: GrammarSpec) -> bytes:
    """16 bytes for the grammar's text: among 2^32 grammars two share one with odds of about 2^-65,
    and that would only count one's uses for the other's."""
    h = hashlib.blake2b(f"{spec.kind}\0{spec.key[2]}\0".encode(), digest_size=16)
    h.update(spec.value.encode("utf-8", "surrogatepass"))  # json.loads takes lone surrogates
    return h.digest()


def may_accept_nothing(spec: GrammarSpec) -> bool:
    """Whether a JSON schema may accept no value though its compile need not say so: a `$ref`
    cycle, a `pattern`, or keywords that may contradict each other (bounds, `enum`, `false`),
    which inside an anyOf (tools' calls) llguidance drops as a dead branch instead of refusing.
    Only these pay a compile check of their own (tools' parameters, in the server)."""
    return spec.kind == "json_schema" and ('"pattern"' in spec.value or _MAY_CONTRADICT.search(spec.value) is not None
                                           or _recursive_schema(spec))


# keywords whose values may leave a schema no instance (minimum over maximum, an empty enum, false)
_MAY_CONTRADICT = re.compile(r'"(?:min|max|exclusiveM)\w*"|"(?:enum|const|not|multipleOf)"|\bfalse\b')


def _recursive_schema(spec: GrammarSpec) -> bool:
    return spec.kind == "json_schema" and '"$ref"' in spec.value and has_ref_cycle(spec.schema())


__all__ = ["GrammarBackend", "CompiledGrammar", "RequestMatcher", "XGrammarMatcher", "LLGuidanceMatcher",
           "legal_draft_nodes", "REFUSED_DRAFT", "llguidance_backend", "xgrammar_backend", "may_accept_nothing"]

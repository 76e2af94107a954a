"""xgrammar-backed grammar compilation, matching and bitmask handling.

Thread-safety (xgrammar 0.2.8):
* ``GrammarCompiler`` may be called from several threads (compile_async runs compiles on a
  small thread pool).  Compiled grammars are immutable and shared between requests.
* a ``GrammarMatcher`` (hence a RequestMatcher) is NOT thread-safe: one request's matcher must be
  used by one thread at a time (the scheduler's grammar worker).
"""
from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

import torch
import xgrammar as xgr

from .errors import GrammarError
from .schema import prepare_schema
from .spec import GrammarSpec

try:  # xgrammar's bindings behind BatchGrammarMatcher (see `batch_accept`, `batch_fill_call`)
    import tvm_ffi
    from xgrammar.base import _core as _xgr_core
    _BATCH_ACCEPT = _xgr_core.BatchGrammarMatcher.batch_accept_token
    _BATCH_ROLLBACK = _xgr_core.BatchGrammarMatcher.batch_rollback
    _FFI_ARRAY = tvm_ffi.Array
except (ImportError, AttributeError):  # another xgrammar layout: the public wrappers do it
    _BATCH_ACCEPT = _BATCH_ROLLBACK = _FFI_ARRAY = None


@dataclass
class CompiledGrammar:
    spec: GrammarSpec
    xgr_compiled: Any  # xgrammar.CompiledGrammar
    compile_seconds: float
    prepared: Optional[str] = None  # the rewritten JSON schema handed to xgrammar (json kinds)
    memory_bytes: int = 0


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

    __slots__ = ("_m", "compiled", "vocab_size", "_bitmask_width", "ffi_handle")

    def __init__(self, compiled: CompiledGrammar, vocab_size: int):
        self.compiled = compiled
        self.vocab_size = vocab_size
        self._bitmask_width = math.ceil(vocab_size / 32)
        self._m = xgr.GrammarMatcher(compiled.xgr_compiled)  # xgrammar 0.2.8: rollback is unbounded
        self.ffi_handle = _ffi_handle(self._m)

    @property
    def xgr_matcher(self) -> xgr.GrammarMatcher:
        return self._m

    def accept_token(self, tok: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""
        if tok < 0 or tok >= self.vocab_size:
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
        new.compiled, new.vocab_size, new._bitmask_width = (
            self.compiled, self.vocab_size, self._bitmask_width)
        new._m = self._m.fork()
        new.ffi_handle = _ffi_handle(new._m)
        return new

    def jump_forward_string(self) -> str:
        if self._m.is_terminated():
            return ""
        return self._m.find_jump_forward_string()

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


def batch_accept(matchers: Sequence[RequestMatcher], tokens: Sequence[int]) -> List[int]:
    """Accepts tokens[i] into matchers[i] in one xgrammar call; returns the positions whose token
    the grammar refused (those matchers are unchanged, as with `accept_token`; a token outside the
    vocabulary is refused too, with a warning from xgrammar).

    The public `BatchGrammarMatcher.batch_accept_token` converts its result element by element
    through the FFI (about 0.5 us each, 60 us at batch 128); this calls the same binding and asks
    the result once whether it holds a refusal."""
    if _BATCH_ACCEPT is None:
        ok = xgr.BatchGrammarMatcher.batch_accept_token([m.xgr_matcher for m in matchers], list(tokens))
        return [i for i, a in enumerate(ok) if not a]
    ok = _BATCH_ACCEPT([m._m._handle for m in matchers], tokens, False)
    if 0 not in ok:  # one FFI call (the elements are 0 or 1)
        return []
    return [i for i, a in enumerate(ok) if not a]


def batch_fill_call(batch_matcher: xgr.BatchGrammarMatcher, matchers: Sequence[RequestMatcher],
                    bitmask: torch.Tensor, rows: Sequence[int]) -> Callable[[], None]:
    """The fill of bitmask[rows[i]] for matchers[i] (`BatchGrammarMatcher.batch_fill_next_token_bitmask`)
    as a call prepared for later: the matcher list is converted for the binding here, so that the
    call itself drops the GIL after a few microseconds (the engine wakes its step thread right
    before it; the woken thread then finds the GIL free)."""
    if _FFI_ARRAY is not None:
        try:
            fill = batch_matcher._handle.batch_fill_next_token_bitmask
            handles = _FFI_ARRAY([m._m._handle for m in matchers])
            indices = _FFI_ARRAY(list(rows))
        except AttributeError:
            pass
        else:
            return lambda: fill(handles, bitmask, indices, False)
    xgr_matchers = [m.xgr_matcher for m in matchers]
    rows = list(rows)
    return lambda: batch_matcher.batch_fill_next_token_bitmask(xgr_matchers, bitmask, rows)


def chain_fill_call(batch_matcher: xgr.BatchGrammarMatcher, matchers: Sequence[RequestMatcher],
                    chains: Sequence[Sequence[int]], bitmask: torch.Tensor, first_rows: Sequence[int],
                    stop_ids: frozenset) -> Callable[[], None]:
    """The bitmask rows of draft chains, as a call prepared for later: matchers[i] (which has
    accepted the chain's root) fills row first_rows[i] + d after accepting chains[i][1:d + 1], for
    every d < len(chains[i]), and is rolled back at the end. Depth by depth, one fill and one
    accept call for all the chains, so the call holds the GIL only while it enters them. Every
    chain token must be one the matcher accepts (grammar-guided drafts are); a matcher ends only
    on one of `stop_ids` (the grammar's stop tokens), so only a chain's last token may be one, and
    the row after it is left alone (xgrammar fills no row for an ended matcher)."""
    depth = max((len(c) for c in chains), default=0)
    fill_at, accept_at = [], []  # per depth: (matchers, rows), (matchers, tokens)
    for d in range(depth):
        live = [i for i, c in enumerate(chains) if len(c) > d]
        accept_at.append(([matchers[i] for i in live], [int(chains[i][d]) for i in live]) if d else None)
        filled = [i for i in live if not (d == len(chains[i]) - 1 and d and int(chains[i][d]) in stop_ids)]
        fill_at.append(([matchers[i] for i in filled], [first_rows[i] + d for i in filled]))
    back = [len(c) - 1 for c in chains]
    if _FFI_ARRAY is not None:
        fill = batch_matcher._handle.batch_fill_next_token_bitmask
        arr = _FFI_ARRAY
        fills = [(arr([m._m._handle for m in ms]), arr(rows)) for ms, rows in fill_at]
        accepts = [None if a is None else (arr([m._m._handle for m in a[0]]), a[1]) for a in accept_at]
        everyone = arr([m._m._handle for m in matchers])

        def run() -> None:
            for d in range(depth):
                if accepts[d] is not None and 0 in _BATCH_ACCEPT(*accepts[d], False):
                    raise RuntimeError(REFUSED_DRAFT)
                handles, rows = fills[d]
                if len(rows):
                    fill(handles, bitmask, rows, False)
            _BATCH_ROLLBACK(everyone, back)
        return run

    def run_public() -> None:
        for d in range(depth):
            if accept_at[d] is not None:
                ok = xgr.BatchGrammarMatcher.batch_accept_token([m.xgr_matcher for m in accept_at[d][0]],
                                                                accept_at[d][1])
                if not all(ok):
                    raise RuntimeError(REFUSED_DRAFT)
            if fill_at[d][1]:
                batch_matcher.batch_fill_next_token_bitmask([m.xgr_matcher for m in fill_at[d][0]], bitmask,
                                                            fill_at[d][1])
        xgr.BatchGrammarMatcher.batch_rollback([m.xgr_matcher for m in matchers], back)
    return run_public


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


class GrammarBackend:
    """One per (tokenizer, model vocab). Owns the xgrammar compiler and the compile cache."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 2,
                 compile_timeout_s: float = 30.0, cache_size: int = 512,
                 compile_workers: int = 2, any_whitespace: bool = True,
                 max_whitespace_cnt: Optional[int] = None,
                 stop_token_ids: Optional[List[int]] = None):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.bitmask_width = math.ceil(self.vocab_size / 32)
        self.compile_timeout_s = float(compile_timeout_s)
        self.any_whitespace = any_whitespace
        self.max_whitespace_cnt = max_whitespace_cnt
        self.tokenizer_info = tokenizer_info_without_specials(tokenizer, self.vocab_size, stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads,
                                            cache_enabled=False)
        self._cache: "OrderedDict[tuple, Any]" = OrderedDict()  # key -> CompiledGrammar|GrammarError
        self._cache_size = cache_size
        self._inflight: dict = {}  # key -> Future from the pool
        self._timed_out: set = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=compile_workers,
                                        thread_name_prefix="grammar-compile")
        self._stats = {"compile_count": 0, "cache_hits": 0, "cache_misses": 0,
                       "compile_seconds_total": 0.0, "compile_seconds_max": 0.0,
                       "compile_errors": 0, "compile_timeouts": 0, "schema_refusals": 0}
        self.refusals_by_keyword: dict = {}

    # ---------------------------------------------------------------- compile
    @property
    def stats(self) -> dict:
        with self._lock:
            d = dict(self._stats)
            d["cache_size"] = len(self._cache)
            d["inflight"] = len(self._inflight)
            d["refusals_by_keyword"] = dict(self.refusals_by_keyword)
        return d

    def _build(self, spec: GrammarSpec) -> CompiledGrammar:
        t0 = time.perf_counter()
        prepared = None
        try:
            if spec.kind == "json_schema":
                try:
                    prepared = json.dumps(prepare_schema(json.loads(spec.value), spec.strict),
                                          ensure_ascii=False)
                except GrammarError as e:
                    with self._lock:
                        self._stats["schema_refusals"] += 1
                        k = e.keyword or "other"
                        self.refusals_by_keyword[k] = self.refusals_by_keyword.get(k, 0) + 1
                    raise
                cg = self.compiler.compile_json_schema(
                    prepared, any_whitespace=self.any_whitespace, strict_mode=spec.strict,
                    max_whitespace_cnt=self.max_whitespace_cnt)
            elif spec.kind == "json_object":
                cg = self.compiler.compile_json_schema(
                    '{"type":"object"}', any_whitespace=self.any_whitespace, strict_mode=False,
                    max_whitespace_cnt=self.max_whitespace_cnt)
            elif spec.kind == "regex":
                cg = self.compiler.compile_regex(spec.value)
            elif spec.kind == "ebnf":
                cg = self.compiler.compile_grammar(spec.value)
            elif spec.kind == "choice":
                opts = json.loads(spec.value)
                cg = self.compiler.compile_grammar(
                    "root ::= " + " | ".join(_ebnf_string(o) for o in opts))
            else:
                raise GrammarError(f"unknown grammar kind '{spec.kind}'")
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with a C++ trace
            msg = str(e).strip().splitlines()
            msg = msg[-1] if msg else repr(e)
            msg = msg.split(": ", 1)[-1] if "/project/cpp/" in msg else msg
            with self._lock:
                self._stats["compile_errors"] += 1
            raise GrammarError(f"{spec.kind} failed to compile: {msg}") from None
        dt = time.perf_counter() - t0
        with self._lock:
            self._stats["compile_count"] += 1
            self._stats["compile_seconds_total"] += dt
            self._stats["compile_seconds_max"] = max(self._stats["compile_seconds_max"], dt)
        try:
            mem = int(cg.memory_size_bytes)
        except Exception:  # noqa: BLE001
            mem = 0
        return CompiledGrammar(spec, cg, dt, prepared, mem)

    def _store(self, key, value) -> None:
        with self._lock:
            self._cache[key] = value
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def _run(self, spec: GrammarSpec):
        try:
            value = self._build(spec)
        except GrammarError as e:
            value = e
        self._store(spec.key, value)
        with self._lock:
            self._inflight.pop(spec.key, None)
            self._timed_out.discard(spec.key)
        if isinstance(value, GrammarError):
            raise value
        return value

    def compile_async(self, spec: GrammarSpec, timeout_s: Optional[float] = None) -> Future:
        """Future[CompiledGrammar]; fails with GrammarError on refusal, error or timeout."""
        timeout_s = self.compile_timeout_s if timeout_s is None else timeout_s
        key = spec.key
        outer: Future = Future()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self._stats["cache_hits"] += 1
            else:
                if key in self._timed_out:
                    outer.set_exception(GrammarError(
                        f"compile exceeded {timeout_s:g}s (a previous compile of this grammar "
                        "is still running)"))
                    return outer
                inner = self._inflight.get(key)
                if inner is None:
                    self._stats["cache_misses"] += 1
                    inner = self._inflight[key] = self._pool.submit(self._run, spec)
        if hit is not None:
            if isinstance(hit, GrammarError):
                outer.set_exception(hit)
            else:
                outer.set_result(hit)
            return outer

        def relay(f: Future):
            if outer.done():
                return
            exc = f.exception()
            try:
                if exc is not None:
                    outer.set_exception(exc)
                else:
                    outer.set_result(f.result())
            except Exception:  # noqa: BLE001 (already timed out)
                pass

        def on_timeout():
            if outer.done() or inner.done():
                return
            with self._lock:
                self._timed_out.add(key)
                self._stats["compile_timeouts"] += 1
            try:
                outer.set_exception(GrammarError(f"compile exceeded {timeout_s:g}s"))
            except Exception:  # noqa: BLE001
                pass

        if timeout_s and timeout_s > 0:
            timer = threading.Timer(timeout_s, on_timeout)
            timer.daemon = True
            timer.start()
            outer.add_done_callback(lambda _f: timer.cancel())
        inner.add_done_callback(relay)
        return outer

    def compile(self, spec: GrammarSpec, timeout_s: Optional[float] = None) -> CompiledGrammar:
        """Synchronous compile (cached); raises GrammarError (refusal, compile error, timeout)."""
        return self.compile_async(spec, timeout_s).result()

    def validate(self, spec: GrammarSpec) -> None:
        """Cheap up-front check (no compilation): raises GrammarError for refused schemas."""
        if spec.kind == "json_schema":
            prepare_schema(json.loads(spec.value), spec.strict)

    # ---------------------------------------------------------------- matching
    def matcher(self, compiled: CompiledGrammar) -> RequestMatcher:
        return RequestMatcher(compiled, self.vocab_size)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        pin = torch.cuda.is_available()
        return torch.full((rows, self.bitmask_width), -1, dtype=torch.int32, pin_memory=pin)

    @staticmethod
    def reset_bitmask(bitmask: torch.Tensor) -> None:
        bitmask.fill_(-1)

    def fill_bitmasks(self, matchers: Sequence[RequestMatcher], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        """Fill bitmask[rows[i]] for matchers[i] (a plain loop; cheap per call)."""
        for m, r in zip(matchers, rows):
            m._m.fill_next_token_bitmask(bitmask, int(r))

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
        self._pool.shutdown(wait=False, cancel_futures=True)

"""xgrammar: JSON schemas through our normalizer (`schema.prepare_schema`), regex, EBNF and choice.

xgrammar precomputes each grammar's token masks at compile time (10 ms to seconds), so its per-step
fill is cheap, and compiled grammars worth it are kept on disk (`disk_cache.py`). Its JSON-schema
converter ignores or approximates many keywords: the normalizer rewrites a schema into the subset
it enforces exactly, or refuses it naming the keyword.

Thread-safety (xgrammar 0.2.8): `GrammarCompiler` may be called from several threads, and compiled
grammars are immutable and shared; a `GrammarMatcher` (hence an XGrammarMatcher) is not thread-safe.
"""
from __future__ import annotations

import json
import logging
import math
import time
from typing import Any, List, Optional

import torch
import xgrammar as xgr

from .compile_queue import CompiledGrammar
from .dead_branches import PRUNED
from .disk_cache import DiskCache, fingerprint
from .errors import GrammarError
from .matcher import RequestMatcher, as_i64
from . import regex_dialect
from .schema import prepare_schema
from .spec import GrammarSpec

log = logging.getLogger("constrained_spec.grammar")

NAME = "xgrammar"


def xgrammar_message(err: Exception) -> str:
    """xgrammar's error (RuntimeError/ValueError with a C++ trace) as its last line, without the trace's source location."""
    lines = str(err).strip().splitlines()
    msg = lines[-1] if lines else repr(err)
    return msg.split(": ", 1)[-1] if "/project/cpp/" in msg else msg


def check_syntax(kind: str, text: str) -> None:
    """GrammarError if xgrammar's parser refuses a regex or an EBNF grammar: the syntax the docs
    give for both backends is xgrammar's, and llguidance's parsers take more (`a**`, a rule defined
    twice, an empty rule), which then meant something else there."""
    try:
        (xgr.Grammar.from_regex if kind == "regex" else xgr.Grammar.from_ebnf)(text)
    except Exception as e:  # noqa: BLE001
        raise GrammarError(f"{kind} failed to compile: {xgrammar_message(e)}") from None


# xgrammar 0.2.8 writes a JSON string's `\\u` escape as any four hex digits, so a UTF-16 surrogate
# could stand alone (`"\\ud83d"`, the first half of an emoji, then anything): JSON's grammar takes
# it, but Python decodes it to a string no UTF-8 encoder takes and Rust's serde_json refuses it. A
# high surrogate is taken only followed by a low one (llguidance, as configured, takes no `\\u` escape).
_HEX = "[A-Fa-f0-9]"
_ESCAPE_RULE = 'basic_escape ::= (([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'
_SURROGATE_FREE_ESCAPE_RULE = (
    f'basic_escape ::= (([\\"\\\\/bfnrt]) | ("u" [0-9A-Ca-cEFef] {_HEX} {_HEX} {_HEX})'
    f' | ("u" [Dd] [0-7] {_HEX} {_HEX}) | ("u" [Dd] [89ABab] {_HEX} {_HEX} "\\\\u" [Dd] [C-Fc-f] {_HEX} {_HEX}))')


def surrogate_free_escapes(grammar: "xgr.Grammar") -> "xgr.Grammar":
    """The grammar with its strings' escape rule replaced by one without lone surrogates (its text
    reads back as the same grammar: measured on the 369 dev schemas the normalizer serves)."""
    text = str(grammar)
    if _ESCAPE_RULE not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_ESCAPE_RULE, _SURROGATE_FREE_ESCAPE_RULE))


class XGrammarMatcher(RequestMatcher):
    """Per-request grammar state (one xgrammar GrammarMatcher). Not thread-safe."""

    backend = NAME
    __slots__ = ("_m", "compiled", "vocab_size", "ffi_handle", "_specials")

    def __init__(self, compiled: CompiledGrammar, vocab_size: int, specials: frozenset = frozenset()):
        self.compiled = compiled
        self.vocab_size = vocab_size
        self._specials = specials  # never legal: refused here, without xgrammar's warning per call
        self._m = xgr.GrammarMatcher(compiled.grammar)  # xgrammar 0.2.8: rollback is unbounded
        self.ffi_handle = _ffi_handle(self._m)

    @property
    def xgr_matcher(self) -> xgr.GrammarMatcher:
        return self._m

    def accept_token(self, tok: int) -> bool:
        if self.never_accepts(tok):
            return False
        return self._m.accept_token(int(tok))

    def never_accepts(self, tok: int) -> bool:
        return tok < 0 or tok >= self.vocab_size or tok in self._specials

    def rollback(self, n: int) -> None:
        if n > 0:
            self._m.rollback(int(n))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, int(row))

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def can_terminate(self) -> bool:
        return self._m.is_terminated() or self._m.is_completed()

    def reset(self) -> None:
        self._m.reset()

    def fork(self) -> "XGrammarMatcher":
        new = XGrammarMatcher.__new__(XGrammarMatcher)
        new.compiled, new.vocab_size, new._specials = self.compiled, self.vocab_size, self._specials
        new._m = self._m.fork()
        new.ffi_handle = _ffi_handle(new._m)
        return new

    def jump_forward_string(self) -> str:
        """After a token that ends inside a UTF-8 character xgrammar's forced text starts with the
        character's remaining bytes, which are no string: nothing is forced then (the next sample,
        masked, completes the character)."""
        if self._m.is_terminated():
            return ""
        try:
            return self._m.find_jump_forward_string()
        except UnicodeDecodeError:
            return ""

    def traverse_draft_tree(self, retrieve_next_token, retrieve_next_sibling, draft_tokens,
                            bitmask: torch.Tensor, time_threshold: float = -1.0) -> bool:
        """xgrammar's native traversal."""
        return self._m.traverse_draft_tree(as_i64(retrieve_next_token), as_i64(retrieve_next_sibling),
                                           as_i64(draft_tokens), bitmask, time_threshold)


def _ffi_handle(matcher: xgr.GrammarMatcher) -> int:
    """The matcher's TVM FFI object address, for `native_fill` (0 where xgrammar's layout has none).
    The Python object keeps it alive."""
    try:
        return matcher._handle.__chandle__()
    except AttributeError:
        return 0


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


# compiled grammars saved to disk at most this large in memory (`_persist`)
MAX_SAVED_MEMORY = 4 << 20


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


class XGrammarCompiler:
    """xgrammar's compiler for one vocabulary, and the disk cache of its compiled grammars."""

    name = NAME

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, vocab_size: int, max_threads: int,
                 any_whitespace: bool = True, max_whitespace_cnt: Optional[int] = None,
                 cache_dir: Optional[str] = None, persist_min_s: float = 0.05, disk_cache_bytes: int = 1 << 30):
        self.tokenizer_info = tokenizer_info
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        self.max_whitespace_cnt = max_whitespace_cnt
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self.persist_min_s = persist_min_s
        self.disk = None
        self.disk_stats = {"disk_hits": 0, "disk_errors": 0, "disk_writes": 0}
        if cache_dir:
            try:
                fp = fingerprint(tokenizer_info, vocab_size, any_whitespace=any_whitespace,
                                 max_whitespace_cnt=max_whitespace_cnt)
                self.disk = DiskCache(cache_dir, fp, max_bytes=disk_cache_bytes)
            except Exception as e:  # noqa: BLE001 (an unusable folder only loses the cache)
                log.warning("grammar cache disabled: %s: %s", cache_dir, e)

    def normalize(self, spec: GrammarSpec):
        """(key, prepared): the compile key and the schema text (or regex) handed to xgrammar. Schemas
        that differ only in annotations or key order share a key. GrammarError if the normalizer
        refuses."""
        if spec.kind == "regex":  # keyed by what xgrammar compiles: the meaning is in the key
            pattern = regex_dialect.as_ecma(spec.value)
            return (NAME, "regex", pattern) + spec.key[2:3], pattern
        if spec.kind != "json_schema":
            return (NAME,) + spec.key[:3], None
        prepared = prepare_schema(json.loads(spec.value), spec.strict)
        prepared = json.dumps(canonical_schema(prepared), separators=(",", ":"), ensure_ascii=False)
        return (NAME, "json_schema", prepared, spec.strict), prepared

    def compile(self, spec: GrammarSpec, prepared: Optional[str], pruned: Optional["xgr.Grammar"] = None):
        """xgrammar's CompiledGrammar; GrammarError if xgrammar fails. `pruned`: the spec's grammar
        without its dead branches (`productivity`), compiled instead of the spec's (the same path:
        xgrammar compiles a schema, a regex or an EBNF as its grammar)."""
        try:
            if pruned is not None:
                return self.compiler.compile_grammar(pruned)
            if spec.kind == "json_schema":
                return self.compiler.compile_grammar(self.json_grammar(prepared, spec.strict))
            if spec.kind == "json_object":
                return self.compiler.compile_grammar(self.json_grammar('{"type":"object"}', False))
            if spec.kind == "regex":
                return self.compiler.compile_regex(prepared)
            if spec.kind == "ebnf":
                return self.compiler.compile_grammar(spec.value)
            if spec.kind == "choice":
                opts = json.loads(spec.value)
                return self.compiler.compile_grammar("root ::= " + " | ".join(_ebnf_string(o) for o in opts))
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with a C++ trace
            raise GrammarError(f"{spec.kind} failed to compile: {xgrammar_message(e)}") from None
        raise GrammarError(f"unknown grammar kind '{spec.kind}'")

    def json_grammar(self, schema_text: str, strict: bool) -> "xgr.Grammar":
        """xgrammar's grammar of a JSON schema, its strings' `\\u` escapes without a lone UTF-16
        surrogate (`surrogate_free_escapes`)."""
        return surrogate_free_escapes(xgr.Grammar.from_json_schema(
            schema_text, any_whitespace=self.any_whitespace, strict_mode=strict,
            max_whitespace_cnt=self.max_whitespace_cnt))

    def grammar(self, spec: GrammarSpec, prepared: Optional[str]) -> Optional["xgr.Grammar"]:
        """xgrammar's grammar for a spec, uncompiled (0.1-1 ms for a dev schema, where compiling it
        takes 10 ms to seconds), or None where it is never unproductive (choice, json_object) or
        xgrammar cannot build it (its compile, or llguidance's, reports why)."""
        try:
            if spec.kind == "json_schema":
                return self.json_grammar(prepared, spec.strict)
            if spec.kind == "regex":
                return xgr.Grammar.from_regex(prepared)
            if spec.kind == "ebnf":
                return xgr.Grammar.from_ebnf(spec.value)
        except Exception:  # noqa: BLE001
            return None
        return None

    def disk_name(self, key, pruned: bool = False) -> str:
        """The cache file of a compile key (`normalize`); named as before the key named its backend.
        A grammar compiled without its dead branches has a name of its own: a cache written before
        they were pruned holds the grammar with them under the key's name."""
        return self.disk.name(key[1:] + (PRUNED,) if pruned else key[1:])

    def load(self, spec: GrammarSpec, prepared: Optional[str], key, pruned: bool = False) -> Optional[CompiledGrammar]:
        """The compiled grammar from the disk cache, or None. `pruned`: the spec's grammar without
        its dead branches is the one to load."""
        if self.disk is None or key is None:
            return None
        name = self.disk_name(key, pruned)
        text = self.disk.get(name)
        if text is None:
            return None
        t0 = time.perf_counter()
        try:
            cg = xgr.CompiledGrammar.deserialize_json(text, self.tokenizer_info)
        except Exception as e:  # noqa: BLE001 (a file from a crash or another build)
            log.warning("grammar cache: cannot load %s (%s); compiling", name, e)
            self.disk.drop(name)
            self.disk_stats["disk_errors"] += 1
            return None
        self.disk_stats["disk_hits"] += 1
        return CompiledGrammar(spec, NAME, cg, time.perf_counter() - t0, prepared, _memory(cg), True, pruned)

    def wrap(self, spec: GrammarSpec, cg, seconds: float, prepared: Optional[str],
             pruned: bool = False) -> CompiledGrammar:
        return CompiledGrammar(spec, NAME, cg, seconds, prepared, _memory(cg), pruned=pruned)

    def persist_call(self, key):
        """What the compile queue runs after a compile: saves it if it is worth saving, or None."""
        if self.disk is None:
            return None

        def persist(compiled: CompiledGrammar) -> None:
            if compiled.from_disk or compiled.compile_seconds < self.persist_min_s:
                return
            self._persist(key, compiled)
        return persist

    def _persist(self, key, compiled: CompiledGrammar) -> None:
        """Saves a compile worth saving. A saved grammar loads at about 60 MB/s of xgrammar's JSON
        (read, zlib and deserialize_json on the dev VM: 112 MB in 1.8 s for a 4.2 s compile,
        167 MB in 3.7 s for a 4.8 s one): one whose text would load slower than half its compile
        is not kept, nor one that compiled faster than persist_min_s (the median dev schema:
        11 ms to compile, 17 ms to load). With persist_min_s 0 every compile is saved.

        One larger than MAX_SAVED_MEMORY in memory is not even written out: its JSON is 3-64 times
        its memory size (dev schemas; an object of 100 optional properties, 11 MB, wrote 709 MB)
        and serializing it held ~13 times the text, so a few such grammars took the engine process
        past 24 GB and the kernel killed it."""
        if compiled.memory_bytes > MAX_SAVED_MEMORY:
            return
        try:
            text = compiled.grammar.serialize_json()
            if self.persist_min_s and len(text) > compiled.compile_seconds * 30e6:
                return
            self.disk.put(self.disk_name(key, compiled.pruned), text)
        except Exception as e:  # noqa: BLE001
            log.warning("grammar cache: cannot save a compiled grammar: %s", e)
            self.disk_stats["disk_errors"] += 1
            return
        self.disk_stats["disk_writes"] += 1

    def matcher(self, compiled: CompiledGrammar, specials: frozenset) -> XGrammarMatcher:
        return XGrammarMatcher(compiled, self.vocab_size, specials)

    @staticmethod
    def bitmask_width(vocab_size: int) -> int:
        return math.ceil(vocab_size / 32)

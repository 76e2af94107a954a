"""llguidance: grammars compiled in about a millisecond, masks computed per step.

llguidance (`LLMatcher`) compiles a JSON schema, regex, Lark/GBNF grammar or choice list into an
Earley parser over a lazily built lexer; a compile costs ~1 ms where xgrammar's precomputed token
masks cost 10 ms to seconds, and it refuses (never approximates) the JSON Schema keywords it cannot
enforce. Its bitmask rows have xgrammar's layout. Two of its behaviours the wrapper hides so that
both backends look the same to the engine:

* a refused token puts an LLMatcher into a permanent error state: accepts go through
  `try_consume_tokens`, which refuses without consuming;
* once the grammar can take nothing more (a JSON object's closing brace) the matcher is stopped and
  its stop token is legal, but consuming it is not recorded (a rollback would undo the brace): the
  wrapper records that stop token itself (`_ended`), so accept/rollback/is_terminated behave as
  xgrammar's do.

Special tokens are never text: the tokenizer handed to llguidance marks every special id special
(`llg_tokenizer`), as `xgrammar_backend.tokenizer_info_without_specials` does for xgrammar.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import llguidance as llg
import torch

from .errors import GrammarError
from .matcher import REFUSED_DRAFT, RequestMatcher, as_i64
from . import regex_dialect
from .llguidance_schema import for_llguidance
from .spec import GrammarSpec
from . import xgrammar_backend

NAME = "llguidance"
WHITESPACE = r"[\x20\x0A\x0D\x09]"


def llg_tokenizer(tokenizer, vocab_size: int, stop_token_ids: Sequence[int], special_ids: Sequence[int]):
    """An LLTokenizer for a Hugging Face fast tokenizer in which every id of `special_ids` is a special
    token (never legal inside a grammar; the stop tokens are legal where the grammar may end).

    A GGUF-converted tokenizer may list control tokens as plain vocabulary; llguidance would then
    read `<|im_end|>` as text. The tokenizer's JSON is rewritten so that each such id is an added
    special token before llguidance reads it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError("llguidance needs a fast (Rust) Hugging Face tokenizer")
    data = json.loads(backend.to_str())
    data["padding"] = data["truncation"] = None
    added = {int(t["id"]): t for t in data.get("added_tokens") or []}
    vocab_text = {i: s for s, i in tokenizer.get_vocab().items()}
    for i in special_ids:
        i = int(i)
        if i in added:
            added[i]["special"] = True
        elif i in vocab_text:
            added[i] = {"id": i, "content": vocab_text[i], "single_word": False, "lstrip": False,
                        "rstrip": False, "normalized": False, "special": True}
    data["added_tokens"] = sorted(added.values(), key=lambda t: t["id"])
    ll = llg.LLTokenizer(json.dumps(data), n_vocab=vocab_size, eos_token=[int(t) for t in stop_token_ids])
    _check_reads_tokens(ll, tokenizer)
    return ll


# JSON text whose tokens llguidance must read back as these bytes
_PROBE = ' {"name": "x y",\n "n": [1, 2.5e3], "ok": true}'


def _check_reads_tokens(ll: "llg.LLTokenizer", tokenizer) -> None:
    """GrammarError unless llguidance reads the tokenizer's tokens as the bytes they stand for. It
    infers each token's bytes from the tokenizer's JSON; a byte-level BPE described with a
    sentencepiece decoder (what transformers 5.17 made of SmolLM2's GGUF) reads as raw 'Ġ' text,
    and masks computed that way let through tokens the grammar refuses."""
    ids = tokenizer.encode(_PROBE, add_special_tokens=False)
    got = bytes(ll.decode_bytes(ids))
    if got != _PROBE.encode():
        raise GrammarError(f"llguidance reads this tokenizer's tokens as other bytes ({_PROBE!r} reads as {got!r}); "
                           "its tokenizer.json does not describe its vocabulary as llguidance expects")


_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')
_KEYWORD_HINTS = (("Unknown format", "format"), ("format", "format"), ("pattern", "pattern"),
                  ("$ref", "$ref"), ("allOf", "allOf"), ("oneOf", "oneOf"), ("anyOf", "anyOf"),
                  ("multipleOf", "multipleOf"), ("uniqueItems", "uniqueItems"))


def refusal_keyword(message: str) -> Optional[str]:
    """The JSON Schema keyword an llguidance refusal is about, where its message names one."""
    m = _UNIMPLEMENTED.search(message)
    if m:
        return m.group(1)
    for hint, keyword in _KEYWORD_HINTS:
        if hint in message:
            return keyword
    return None


def error_text(error: str, limit: int = 500) -> str:
    """llguidance's error as one line: its lines joined, without the caret lines and the echo of
    the grammar's source under them (the first line alone was "regex parse error:", the reason two
    lines further down), and without the parser's state that a parser error goes on with."""
    lines = (line.strip() for line in error.split("<state>", 1)[0].splitlines())  # not its parser's state dump
    kept = [line for line in lines if line and line.strip("^~ ") and not _SOURCE_LINE.match(line)]
    return " ".join(kept)[:limit]


# an llguidance option its refusal of a oneOf names, which a request cannot set: what it can do instead
_COERCE_ONE_OF = "Enable 'coerce_one_of' option to approximate oneOf with anyOf"
_ONE_OF_WAY_OUT = ("Use anyOf, or the xgrammar backend (grammar_backend), which takes a oneOf whose branches "
                   "are provably disjoint")
_SOURCE_LINE = re.compile(r"\d+ \|")  # "1 | start: /(ab/": llguidance quoting the grammar's line


def memory_estimate(text: str) -> int:
    """The memory a compiled grammar holds, estimated from its text: llguidance tells no size. Its
    lexer is built lazily, as requests use the grammar: after one request's first masks, the RSS of
    cached templates on the dev VM was ~90 KB a dev schema (150 of them; 2.7 KB of text on average)
    and ~2.8 MB a 4,000-string enum (40; ~50 KB of text). An estimate of 16 bytes a character, from
    templates never used, put the engine at 4.2x `--grammar-cache-mb` under distinct enums (QA 1130b
    soak D4); this one is over both (a dev schema's count, not its bytes, bounds the cache)."""
    return (32 << 10) + 56 * len(text)


class LLGuidanceCompiler:
    """Compiles GrammarSpecs into template LLMatchers (each request's matcher is a deep copy: ~1 us,
    where constructing one costs ~0.4 ms). Thread-safe: llguidance drops the GIL while compiling."""

    name = NAME

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], special_ids: Sequence[int],
                 max_whitespace_cnt: Optional[int] = None):
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.special_ids = frozenset(int(t) for t in special_ids).difference(self.stop_token_ids)
        self.tokenizer = llg_tokenizer(tokenizer, self.vocab_size, list(stop_token_ids), special_ids)
        ws = WHITESPACE + ("*" if max_whitespace_cnt is None else "{0,%d}" % int(max_whitespace_cnt))
        # no \u escapes (nor "\/"): an escaped spelling of a declared property name would take the
        # other-properties branch, its value unchecked (measured). A narrowing: control characters
        # other than \b\f\n\r\t cannot be written, nor a \u-escaped character that may be written raw
        self.json_options = {"whitespace_flexible": True, "whitespace_pattern": ws,
                             "json_allowed_escapes": 'nrbtf\\"'}

    def grammar_text(self, spec: GrammarSpec) -> str:
        """llguidance's grammar for the spec (not yet checked: `compile` does that)."""
        if spec.kind == "json_schema":
            schema = for_llguidance(json.loads(spec.value), spec.strict)
            if schema is True:
                schema = {}
            if schema is False:
                raise GrammarError("the schema 'false' accepts no instance", keyword="false", path="")
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=self.json_options)
        if spec.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type":"object"}', overrides=self.json_options)
        if spec.kind == "regex":
            pattern = regex_dialect.as_ecma(spec.value)
            # llguidance (Rust's regex syntax) takes what JavaScript refuses (`a**`; a trailing `\\`,
            # which it dropped): parsed as xgrammar parses it, a regex one backend refuses both do
            xgrammar_backend.check_syntax("regex", pattern)
            return llg.LLMatcher.grammar_from_regex(llg.regex_to_lark(pattern, "dw"))
        if spec.kind == "choice":
            return llg.grammar_from("choice", spec.value)
        if spec.kind == "ebnf":
            xgrammar_backend.check_syntax("ebnf", spec.value)  # (QA 1130 D3: `root ::=` empty, a rule defined twice)
            try:
                return llg.grammar_from("gbnf", spec.value)
            except ValueError as e:
                raise GrammarError(f"ebnf failed to compile: {e}") from None
        raise GrammarError(f"unknown grammar kind '{spec.kind}'")

    def compile(self, spec: GrammarSpec) -> tuple[llg.LLMatcher, str]:
        """A template matcher and its grammar text; GrammarError (with the keyword where llguidance
        names one) if llguidance refuses the grammar."""
        try:
            text = self.grammar_text(spec)
        except ValueError as e:
            if isinstance(e, GrammarError):
                raise
            raise GrammarError(f"{spec.kind} failed to compile: {e}") from None
        template = self.new_matcher(text)
        if template.is_error():
            message = error_text(template.get_error()) or "llguidance refused the grammar"
            message = message.replace(_COERCE_ONE_OF, _ONE_OF_WAY_OUT)
            keyword = refusal_keyword(message) if spec.kind == "json_schema" else None
            raise GrammarError(f"{spec.kind} not supported by llguidance: {message}", keyword=keyword,
                               path="" if keyword else None)
        return template, text

    def new_matcher(self, text: str) -> llg.LLMatcher:
        """A matcher built from grammar text, sharing no state with any other. Requests get deep
        copies of a template instead (~1 us against ~0.4 ms), but copies share the template's lazily
        built lexer: a mask computed on one of them, or on the template, made later copies refuse
        valid text when they consume without computing masks (llguidance 1.9.1; JSONSchemaBench's
        o21073 at token 30 of 301). What only looks at a grammar (the empty-language probe) uses
        one of these."""
        return llg.LLMatcher(self.tokenizer, text, log_level=0)


class LLGuidanceMatcher(RequestMatcher):
    """Per-request grammar state (one llguidance LLMatcher). Not thread-safe."""

    backend = NAME
    __slots__ = ("_m", "compiled", "_stops", "_specials", "_ended", "vocab_size")

    def __init__(self, compiled, matcher: llg.LLMatcher, vocab_size: int, stop_ids: frozenset,
                 specials: frozenset):
        self.compiled = compiled
        self._m = matcher
        self.vocab_size = vocab_size
        self._stops = stop_ids
        self._specials = specials
        self._ended = False  # a stop token accepted on a stopped matcher (llguidance does not record it)

    @property
    def ll_matcher(self) -> llg.LLMatcher:
        return self._m

    # The pool's xgrammar ABI does not apply: rows are filled through llguidance (`LLGuidanceFill`).
    ffi_handle = 0

    def accept_token(self, tok: int) -> bool:
        if self._ended or tok < 0 or tok >= self.vocab_size or tok in self._specials:
            return False
        m = self._m
        if tok in self._stops and m.is_stopped():
            if m.is_error() or not m.is_accepting():
                return False
            self._ended = True
            return True
        return m.try_consume_tokens([int(tok)]) == 1

    def accept_tokens(self, toks: Sequence[int]) -> int:
        if not toks:
            return 0
        if self._ended:
            return 0
        # the common case (no stop or special token among them) in one call
        if self._stops.isdisjoint(toks) and self._specials.isdisjoint(toks) and \
                all(0 <= t < self.vocab_size for t in toks):
            return self._m.try_consume_tokens([int(t) for t in toks])
        return super().accept_tokens(toks)

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if self._ended:
            self._ended = False
            n -= 1
        if n:
            self._m.rollback(int(n))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[int(row)]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def is_terminated(self) -> bool:
        return self._ended or self._m.stop_reason() == "EndOfSentence"

    def can_terminate(self) -> bool:
        return self.is_terminated() or (self._m.is_accepting() and not self._m.is_error())

    def reset(self) -> None:
        self._ended = False
        self._m.reset()

    def error(self) -> str | None:
        if not self._m.is_error():
            return None
        return error_text(self._m.get_error()) or "llguidance failed"

    def fork(self) -> "LLGuidanceMatcher":
        new = LLGuidanceMatcher(self.compiled, self._m.deep_copy(), self.vocab_size, self._stops, self._specials)
        new._ended = self._ended
        return new

    def jump_forward_string(self) -> str:
        if self.is_terminated():
            return ""
        forced = self._m.compute_ff_bytes()
        if not forced:
            return ""
        try:
            return forced.decode("utf-8")
        except UnicodeDecodeError as e:  # ends (or starts) inside a character: the whole ones before
            return forced[:e.start].decode("utf-8")

    def traverse_draft_tree(self, retrieve_next_token, retrieve_next_sibling, draft_tokens,
                            bitmask: torch.Tensor, time_threshold: float = -1.0) -> bool:
        """xgrammar's `traverse_draft_tree` walked here: depth first, accept a child's token, fill its
        row, descend, roll back (measured against xgrammar's native walk in
        benchmarks/bench_schema_coverage.py)."""
        rnt = as_i64(retrieve_next_token).tolist()
        rns = as_i64(retrieve_next_sibling).tolist()
        dt = as_i64(draft_tokens).tolist()
        self.fill_bitmask(bitmask, 0)
        stack = [(0, rnt[0])]  # (node, next child to try)
        while stack:
            node, child = stack[-1]
            if child == -1:
                stack.pop()
                if node != 0:
                    self.rollback(1)
                continue
            stack[-1] = (node, rns[child])
            if self.accept_token(dt[child]):
                if not self._ended:
                    self.fill_bitmask(bitmask, child)
                stack.append((child, rnt[child]))
        return True

    def chain_entry(self, chain: Sequence[int], row: int) -> tuple:
        """(matcher, first row, draft tokens) for `LLGuidanceFill.fill_chains`: a final stop token is
        left out (the row after it is left alone, as xgrammar leaves it)."""
        drafts = [int(t) for t in chain[1:]]
        if drafts and drafts[-1] in self._stops:
            drafts.pop()
        return (self._m, int(row), drafts)


class LLGuidanceFill:
    """llguidance's own parallel fill (`LLExecutor`, GIL-free on its own threads): a step's rows,
    and a speculative step's draft chains, for the llguidance matchers of a batch. `start` hands a
    step's fill to a thread of its own (the executor's call blocks its caller), so that the caller's
    Python work (streaming the step before) overlaps it, as the native pool's job does for the
    xgrammar rows."""

    def __init__(self, threads: Optional[int] = None):
        self._executor = llg.LLExecutor(threads) if threads else llg.LLExecutor()
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llguidance-fill")

    def start(self, matchers: Sequence[LLGuidanceMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> Future:
        """The fill of bitmask[rows[i]] from matchers[i], running until the returned future's
        `result()` returns (or raises what the fill raised); the matchers are the fill's until then."""
        return self._starter.submit(self.fill, matchers, bitmask, rows)

    def fill(self, matchers: Sequence[LLGuidanceMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        if not matchers:
            return
        _check(bitmask)
        self._executor.unsafe_compute_mask_ptr([(m._m, int(r)) for m, r in zip(matchers, rows)], *_rows_arg(bitmask))

    def fill_chains(self, matchers: Sequence[LLGuidanceMatcher], chains: Sequence[Sequence[int]],
                    bitmask: torch.Tensor, first_rows: Sequence[int], partial: bool = False) -> None:
        """matchers[i] (which has taken chains[i][0]) fills row first_rows[i] + d after
        chains[i][1:d + 1] for every d, and is where it was afterwards. Every chain token must be
        legal (grammar-guided chains are): RuntimeError(REFUSED_DRAFT) otherwise; with `partial`,
        a chain's rows stop before its first refused token instead."""
        if not matchers:
            return
        _check(bitmask)
        chains = list(chains)
        for i, (m, c) in enumerate(zip(matchers, chains)):
            drafts = m.chain_entry(c, 0)[2]
            legal = m._m.validate_tokens(drafts)
            if legal != len(drafts):
                if not partial:
                    raise RuntimeError(REFUSED_DRAFT)
                chains[i] = c[:1 + legal]
        entries = [m.chain_entry(c, r) for m, c, r in zip(matchers, chains, first_rows)]
        chained = [e for e in entries if e[2]]  # llguidance takes no empty draft: those are plain rows
        if len(chained) < len(entries):
            self._executor.unsafe_compute_mask_ptr([e[:2] for e in entries if not e[2]], *_rows_arg(bitmask))
        if chained:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(chained, *_rows_arg(bitmask))


def _rows_arg(bitmask: torch.Tensor) -> tuple:
    """(pointer, bytes per row, rows): how llguidance's executor takes a bitmask."""
    return bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]


def _check(bitmask: torch.Tensor) -> None:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("the bitmask must be a contiguous int32 CPU tensor")

"""The llguidance backend and the choice between backends (CPU, SmolLM2 tokenizer, no model): special
tokens are never text, stop tokens behave as xgrammar's (accepted, terminating, rolled back), the
draft-tree walk and the chain fill give the rows of sequential fills and leave the matcher as it was,
and `auto` serves a schema with llguidance, falls back to the normalizer and xgrammar where
llguidance refuses, and refuses (naming the keyword) only when neither enforces it."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from constrained_spec.grammar import GrammarBackend, GrammarError, GrammarSpec
from constrained_spec.grammar.llguidance_backend import LLGuidanceFill, error_text, refusal_keyword
from constrained_spec.grammar.llguidance_schema import close_objects
from constrained_spec.grammar.xgrammar_backend import special_token_ids

VOCAB = 49152
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = GrammarBackend(tokenizer, VOCAB, max_whitespace_cnt=16)
    yield b
    b.close()


def llg(spec: GrammarSpec) -> GrammarSpec:
    return spec.with_backend("llguidance")


def allowed(bitmask: torch.Tensor, row: int) -> set:
    words = bitmask[row].numpy().view(np.uint32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:VOCAB]).tolist())


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_special_tokens_are_never_text(backend, tokenizer):
    specials = special_token_ids(tokenizer)
    assert specials and backend.stop_token_ids <= specials
    for spec in (GrammarSpec.json_schema({"type": "object", "properties": {"s": {"type": "string"}}}),
                 GrammarSpec.regex(r"[\s\S]{0,40}"), GrammarSpec.json_object()):
        m = backend.matcher(backend.compile(llg(spec)))
        assert m.backend == "llguidance"
        prefix = '{"s": "ab' if spec.kind != "regex" else "ab"
        assert m.accept_tokens(ids(tokenizer, prefix)) == len(ids(tokenizer, prefix))
        bm = backend.allocate_bitmask(1)
        m.fill_bitmask(bm, 0)
        legal = allowed(bm, 0)
        assert len(legal) > 1000  # inside a string: most of the vocabulary
        inside = legal & specials
        # a regex that may end here allows its stop tokens, and nothing else special
        assert inside <= (backend.stop_token_ids if spec.kind == "regex" else set()), inside
        for t in specials - backend.stop_token_ids:
            assert not m.accept_token(t)
    # the xgrammar view of the same vocabulary agrees
    assert set(backend.tokenizer_info.special_token_ids) >= specials - backend.stop_token_ids


def test_stop_token_terminates_and_rolls_back(backend, tokenizer):
    stop = min(backend.stop_token_ids)
    m = backend.matcher(backend.compile(llg(GrammarSpec.json_schema(PERSON))))
    text = ids(tokenizer, '{"name": "Ann", "age": 7}')
    assert m.accept_tokens(text) == len(text)
    assert m.can_terminate() and not m.is_terminated()
    bm = backend.allocate_bitmask(2)
    m.fill_bitmask(bm, 0)
    assert allowed(bm, 0) == backend.stop_token_ids  # the object is closed: only its end
    assert m.accept_token(stop) and m.is_terminated()
    assert not m.accept_token(stop) and m.jump_forward_string() == ""
    m.rollback(1)
    assert not m.is_terminated() and m.can_terminate()
    m.fill_bitmask(bm, 1)
    assert torch.equal(bm[0], bm[1])  # where it was before the stop token
    m.rollback(1)  # the closing brace
    assert not m.can_terminate() and m.accept_token(text[-1])
    # a grammar that may go on: the stop token is consumed by llguidance itself
    r = backend.matcher(backend.compile(llg(GrammarSpec.regex("a+"))))
    assert r.accept_tokens(ids(tokenizer, "aa")) and r.accept_token(stop) and r.is_terminated()
    r.rollback(1)
    assert not r.is_terminated() and r.accept_tokens(ids(tokenizer, "a")) == 1


def test_refused_token_leaves_the_matcher_alone(backend, tokenizer):
    m = backend.matcher(backend.compile(llg(GrammarSpec.json_schema(PERSON))))
    assert m.accept_tokens(ids(tokenizer, '{"name": "A", "age": ')) > 0
    assert not m.accept_token(ids(tokenizer, "x")[0])  # an error state in llguidance itself
    assert m.accept_tokens(ids(tokenizer, "12}")) == len(ids(tokenizer, "12}"))
    assert m.can_terminate()


def test_jump_forward_and_fork(backend, tokenizer):
    m = backend.matcher(backend.compile(llg(GrammarSpec.json_schema({**PERSON, "additionalProperties": False}))))
    assert m.jump_forward_string() == "{"
    m.accept_tokens(ids(tokenizer, '{"'))
    assert m.jump_forward_string().startswith('name"')
    forced = m.jump_forward_tokens(tokenizer)
    fork = m.fork()
    assert forced and fork.accept_tokens(forced) == len(forced)
    assert m.jump_forward_string().startswith('name"')  # the original did not move


def _tree(tokenizer):
    """A tree over `{"name": "Al` with legal and illegal branches: (next_token, next_sibling, tokens)."""
    a, b = ids(tokenizer, '{"'), ids(tokenizer, 'name": "Al')
    bad_key, bad_char = ids(tokenizer, "]")[0], ids(tokenizer, "\n")[0]  # no such key; raw in a string
    # node 0 = '{"' (already accepted); chain of b under it, an illegal sibling at depth 2 and at the end
    tokens = [a[-1]] + b[:2] + [bad_key] + b[2:] + [bad_char]
    n = len(tokens)
    nxt, sib = [-1] * n, [-1] * n
    nxt[0], nxt[1] = 1, 2
    sib[2] = 3  # ']' beside b[1]
    prev = 2
    for i in range(4, n - 1):
        nxt[prev] = i
        prev = i
    sib[n - 2] = n - 1  # ']' beside the last token of b
    return a, nxt, sib, tokens


def test_tree_walk_gives_sequential_rows(backend, tokenizer):
    from constrained_spec.grammar import legal_draft_nodes
    compiled = backend.compile(llg(GrammarSpec.json_schema(PERSON)))
    a, nxt, sib, tokens = _tree(tokenizer)
    m = backend.matcher(compiled)
    assert m.accept_tokens(a) == len(a)
    before = backend.allocate_bitmask(1)
    m.fill_bitmask(before, 0)
    rows = backend.allocate_bitmask(len(tokens))
    m.traverse_draft_tree(torch.tensor(nxt), torch.tensor(sib), torch.tensor(tokens), rows)
    legal = legal_draft_nodes(rows, nxt, sib, tokens)
    assert legal[:3] == [True, True, True] and not legal[3] and not legal[-1] and all(legal[4:-1])
    after = backend.allocate_bitmask(1)
    m.fill_bitmask(after, 0)
    assert torch.equal(before, after)  # the walk left the matcher where it was
    # each legal node's row is the row of a matcher that accepted its path
    parent = {c: p for p in range(len(tokens)) for c in _children(nxt, sib, p)}
    for node in range(len(tokens)):
        if not legal[node]:
            continue
        path, i = [], node
        while i:
            path.append(tokens[i])
            i = parent[i]
        seq = backend.matcher(compiled)
        seq.accept_tokens(a + path[::-1])
        one = backend.allocate_bitmask(1)
        seq.fill_bitmask(one, 0)
        assert torch.equal(one[0], rows[node]), node


def _children(nxt, sib, p):
    c = nxt[p]
    while c != -1:
        yield c
        c = sib[c]


def test_chain_fill_gives_sequential_rows(backend, tokenizer):
    stop = min(backend.stop_token_ids)
    specs = [GrammarSpec.json_schema(PERSON), GrammarSpec.regex("[0-9]{1,3}"), GrammarSpec.choice(["yes", "no"])]
    texts = ['{"name": "Bo", "age": 4', "12", "yes"]
    matchers, chains = [], []
    for spec, text in zip(specs, texts):
        m = backend.matcher(backend.compile(llg(spec)))
        t = ids(tokenizer, text)
        assert m.accept_token(t[0])
        matchers.append(m)
        chains.append(t + ([stop] if spec.kind == "choice" else []))  # a chain that ends the grammar
    chains.append([chains[0][0]])  # a root alone: one row, no drafts
    matchers.append(backend.matcher(backend.compile(llg(specs[0]))))
    matchers[-1].accept_token(chains[0][0])
    first = [0, 20, 40, 60]
    rows = backend.allocate_bitmask(80)
    rows.zero_()
    LLGuidanceFill(2).fill_chains(matchers, chains, rows, first)
    for m, chain, f in zip(matchers, chains, first):
        seq = m.fork()
        for d in range(len(chain)):
            if d:
                assert seq.accept_token(chain[d])
            if d == len(chain) - 1 and d and chain[d] == stop:
                assert not rows[f + d].any()  # the row after a stop token is left alone
                continue
            one = backend.allocate_bitmask(1)
            seq.fill_bitmask(one, 0)
            assert torch.equal(one[0], rows[f + d]), (chain, d)
        # the matcher is where it was (after the chain's root)
        assert m.accept_tokens(chain[1:]) == len(chain) - 1


def test_partial_chain_fill_stops_before_a_refused_token(backend, tokenizer):
    """Unguided drafts: with `partial` a chain's rows stop before its first refused token (no
    error), and the matcher is where it was."""
    m = backend.matcher(backend.compile(llg(GrammarSpec.json_schema(PERSON))))
    t = ids(tokenizer, '{"name": "Bo"')
    assert m.accept_token(t[0])
    chain = t[:3] + ids(tokenizer, "zebra")[:1] + t[3:5]  # refused at depth 3
    rows = backend.allocate_bitmask(8)
    rows.fill_(7)
    with pytest.raises(RuntimeError):
        LLGuidanceFill(1).fill_chains([m], [chain], rows, [0])
    LLGuidanceFill(1).fill_chains([m], [chain], rows, [0], partial=True)
    seq = m.fork()
    for d in range(3):
        if d:
            assert seq.accept_token(chain[d])
        one = backend.allocate_bitmask(1)
        seq.fill_bitmask(one, 0)
        assert torch.equal(one[0], rows[d]), d
    assert (rows[3:] == 7).all()
    assert m.accept_tokens(t[1:4]) == 3  # where it was


def test_auto_prefers_llguidance_and_falls_back(backend):
    served = backend.compile(GrammarSpec.json_schema(PERSON).with_backend("auto"))
    assert served.backend == "llguidance"
    # a standard format llguidance does not implement: the normalizer and xgrammar enforce it
    standard = GrammarSpec.json_schema({"type": "string", "format": "json-pointer"})
    assert backend.compile(standard.with_backend("auto")).backend == "xgrammar"
    with pytest.raises(GrammarError) as e:
        backend.compile(standard.with_backend("llguidance"))
    assert e.value.keyword == "format"
    # refused by both: the normalizer's refusal names the keyword
    with pytest.raises(GrammarError) as e:
        backend.compile(GrammarSpec.json_schema({"type": "integer", "not": {"const": 3}}).with_backend("auto"))
    assert e.value.keyword == "not"
    # EBNF is xgrammar's dialect
    assert backend.compile(GrammarSpec.ebnf('root ::= "a" | "b"').with_backend("auto")).backend == "xgrammar"
    assert backend.compile(GrammarSpec.regex("[a-z]+")).backend == "llguidance"
    assert backend.compile(GrammarSpec.regex("[a-z]+").with_backend("xgrammar")).backend == "xgrammar"


# (pattern, strings it matches, strings it does not), in ECMA-262's meaning, under both backends
REGEX_MEANINGS = [
    (r"\d{2}", ["12"], ["\u0661\u0662", "\U0001FBF1\U0001FBF2"]),  # ASCII digits only
    (r"\w+", ["a_9"], ["\u00e9", "\u0661"]),
    (r"[\d.]+", ["1.5"], ["\u0661"]),
    (r"\D", ["a", "\u0661"], ["1"]),
    (r"a.b", ["a-b", "a\u00e9b", "a\U0001F600b"], ["a\nb", "a\rb", "a\u2028b"]),  # `.`: no line terminator
    (r"a\.b", ["a.b"], ["a-b"]),
    (r"[.]", ["."], ["a"]),
    (r"[^.]", ["a"], ["."]),
    (r"a\\.", ["a\\x"], ["a\\\n"]),  # an escaped backslash, then any character
]


@pytest.mark.parametrize("pattern,inside,outside", REGEX_MEANINGS)
def test_a_regex_means_the_same_under_both_backends(backend, tokenizer, pattern, inside, outside):
    """A regex constraint is read as ECMA-262 reads it (JSON Schema's `pattern` meaning) whichever
    backend compiles it: llguidance read \\d and \\w as Unicode classes and xgrammar `.` as any
    character, so a request moved between them by `auto` changed meaning."""
    for name in ("llguidance", "xgrammar"):
        compiled = backend.compile(GrammarSpec.regex(pattern).with_backend(name))
        for text, expected in [(t, True) for t in inside] + [(t, False) for t in outside]:
            m = backend.matcher(compiled)
            toks = ids(tokenizer, text)
            assert (m.accept_tokens(toks) == len(toks) and m.can_terminate()) is expected, (name, pattern, text)


@pytest.mark.parametrize("pattern", ["a^b", "a$b", "^a$b", "x(?:^y)?", "[a]^"])
def test_a_regex_anchor_inside_is_refused(backend, pattern):
    """xgrammar dropped an inner anchor silently: `a^b`, which matches nothing, answered "ab" under
    auto (llguidance refused it as a lookaround, and auto fell back to xgrammar)."""
    for name in ("llguidance", "xgrammar", "auto"):
        with pytest.raises(GrammarError, match="anchors"):
            backend.compile(GrammarSpec.regex(pattern).with_backend(name))


@pytest.mark.parametrize("kind, text, says", [
    ("regex", r"\A\d{3}\z", "leave the anchor out"),  # llguidance: anchors; xgrammar (as JavaScript): letters
    ("regex", r"\d{3}\Z", "letter 'Z'"),
    ("regex", r"\p{L}+", "letter 'p'"),  # llguidance: Unicode letters; JavaScript without u: `p{L}`
    ("regex", r"\x4", r"\x4"),
    ("regex", "abc\\", "lone backslash"),  # llguidance dropped it: "abc"
    ("regex", "a**", "Two consecutive repetition modifiers"),
    ("regex", "(?i)abc", "inline flags"),  # llguidance: case-insensitive
    ("regex", "(?P<n>a)", "inline flags"),
    ("regex", r"(a)\1", "backreferences"),
    ("ebnf", "root ::= ", "Expect element"),  # llguidance: the empty answer
    ("ebnf", 'root ::= "a"\nroot ::= "b"', "defined multiple times"),  # llguidance: the last one
])
def test_a_grammar_one_backend_refuses_the_other_refuses_too(backend, kind, text, says):
    """QA 1130 D1-D3: llguidance's parsers (Rust's regex syntax, its GBNF) took what xgrammar's
    refuses, and gave it another meaning; under auto a repeated request moved between them."""
    spec = GrammarSpec.regex(text) if kind == "regex" else GrammarSpec.ebnf(text)
    for name in ("llguidance", "xgrammar", "auto"):
        with pytest.raises(GrammarError, match=re.escape(says)):
            backend.compile(spec.with_backend(name))


@pytest.mark.parametrize("pattern, text", [(r"[(?]x", "?x"), (r"[\b]", "\b"), (r"(?:ab)+", "abab"),
                                           (r"\x41\u0042\cJ", "AB\n"), (r"a\.b\-c\/", "a.b-c/")])
def test_javascript_s_own_syntax_is_kept(backend, tokenizer, pattern, text):
    # (llguidance refuses `\cJ` and `[\b]`, which auto serves with xgrammar)
    for name in ("auto", "xgrammar"):
        m = backend.matcher(backend.compile(GrammarSpec.regex(pattern).with_backend(name)))
        t = ids(tokenizer, text)
        assert m.accept_tokens(t) == len(t) and m.can_terminate(), (pattern, name)


def test_regex_anchors_at_the_edges_and_literal_ones_are_kept(backend, tokenizer):
    for pattern, text in ((r"^ab$", "ab"), (r"[$^]+", "$^"), (r"a\$", "a$"), (r"\^b", "^b"), (r"a\\$", "a\\")):
        for name in ("llguidance", "xgrammar"):
            m = backend.matcher(backend.compile(GrammarSpec.regex(pattern).with_backend(name)))
            t = ids(tokenizer, text)
            assert m.accept_tokens(t) == len(t) and m.can_terminate(), (pattern, name)


def test_only_a_wildcard_dot_is_rewritten():
    from constrained_spec.grammar.regex_dialect import _DOT, _ecma_dot
    assert _ecma_dot(r"a.\.[.]\\.") == "a" + _DOT + r"\.[.]\\" + _DOT
    assert _ecma_dot("[]a.].[^].].") == "[]a.]" + _DOT + "[^].]" + _DOT  # `]` first in a class is a member


def test_every_regex_walk_reads_classes_alike():
    """A regex constraint's checks and a JSON Schema pattern's read one structure (`regex_pieces`):
    the anchor check read `[]^]` as the class `[]` and a `^` after it, and refused it as an inner
    anchor, where the dot rewrite and xgrammar's JSON-string rewrite read a class of `]` and `^`."""
    from constrained_spec.grammar.regex_scan import regex_pieces, scan_regex
    assert [p for _, p, _ in regex_pieces(r"a[^]\]x](\\")] == ["a", "[^", "]", "\\]", "x", "]", "(", "\\\\"]
    assert [c for _, _, c in regex_pieces("[]a]b")] == [True, True, True, True, False]
    assert scan_regex("[]^$|]") == (False, False)
    assert scan_regex("[^]|]a|b") == (True, False)
    assert scan_regex("(a|b)c") == (False, False)
    assert scan_regex("a^b") == (False, True)
    from constrained_spec.grammar.regex_dialect import as_ecma
    assert as_ecma("[]^]x") == "[]^]x"  # (not an inner anchor)


@pytest.mark.parametrize("schema,inside,outside,keyword", [
    # llguidance read these as f64: 2**53 was taken for 2**53 + 1, 10**19 clamped to i64's maximum
    ({"type": "integer", "minimum": 2**53 + 1, "maximum": 2**53 + 3}, 2**53 + 1, 2**53, "minimum"),
    ({"type": "integer", "minimum": 2**62 + 1, "maximum": 2**62 + 3}, 2**62 + 2, 2**62, "minimum"),
    ({"enum": [2**53 + 1, "a"]}, 2**53 + 1, 2**53, "enum"),
    ({"type": "object", "properties": {"n": {"const": 2**60 + 1}}}, {"n": 2**60 + 1}, {"n": 2**60}, "const"),
    # a property named as a data keyword is a subschema, not data (its schema was read as an enum)
    ({"type": "object", "properties": {"enum": {"type": "integer", "minimum": 2**53 + 1, "maximum": 2**53 + 3}},
      "required": ["enum"]}, {"enum": 2**53 + 1}, {"enum": 2**53}, "minimum"),
    # a bound at i64's minimum crashed the process inside llguidance (SIGSEGV)
    ({"type": "integer", "minimum": -2**63, "maximum": -2**63 + 8}, -2**63 + 1, -2**63 + 9, "minimum"),
])
def test_numbers_past_2_53_go_to_xgrammar(backend, tokenizer, schema, inside, outside, keyword):
    import json
    with pytest.raises(GrammarError, match="2\\*\\*53") as e:
        backend.compile(llg(GrammarSpec.json_schema(schema)))
    assert e.value.keyword == keyword, e.value
    served = backend.compile(GrammarSpec.json_schema(schema).with_backend("auto"))
    assert served.backend == "xgrammar"
    for value, ok in ((inside, True), (outside, False)):
        m = backend.matcher(served)
        t = ids(tokenizer, json.dumps(value))
        assert (m.accept_tokens(t) == len(t) and m.can_terminate()) == ok, value


@pytest.mark.parametrize("keyword, bound, outside, inside", [
    ("maximum", 999.9999999999999, "1000", "999.5"),  # 1000 was taken: the bound read rounded
    ("exclusiveMaximum", 999.9999999999999, "1000", "999.25"),
    ("minimum", -999.9999999999999, "-1000", "-999.5"),
    ("maximum", 0.30000000000000004, "0.31", "0.3")])
def test_fractional_bounds_of_many_digits_bound_what_is_written(backend, tokenizer, keyword, bound, outside, inside):
    spec = llg(GrammarSpec.json_schema({"type": "number", keyword: bound}))
    for text, ok in ((outside, False), (inside, True)):
        m = backend.matcher(backend.compile(spec))
        t = ids(tokenizer, text)
        assert (m.accept_tokens(t) == len(t) and m.can_terminate()) == ok, text


@pytest.mark.parametrize("schema,inside,outside", [
    # llguidance refused a decimal whose digits begin the bound's: the model, having written `1.4`,
    # had to write another digit (`1.45` at T=0 for an intended 1.4)
    ({"type": "number", "maximum": 1.49}, ["1.4", "1", "1.48", "1.49", "-3.7"], ["1.5", "1.491", "2"]),
    ({"type": "number", "exclusiveMaximum": 1.49}, ["1.4", "1.489"], ["1.49", "1.5"]),
    ({"type": "number", "minimum": -1.49, "description": "d"}, ["-1.4", "-1", "-1.49", "0.3"], ["-1.5", "-1.491"]),
    ({"type": "number", "minimum": 0.5, "maximum": 0.75, "multipleOf": 0.05}, ["0.7", "0.75", "0.5"], ["0.8", "0.4", "0.72"]),
    ({"type": "number", "maximum": 100.25}, ["100.2", "100.25", "99"], ["100.3", "100.251"]),
    ({"type": "number", "maximum": 1.049}, ["1.04", "1", "1.049"], ["1.05", "1.1"]),
    ({"type": "number", "maximum": 0.75, "default": 0.5, "examples": [0.6]}, ["0.7", "0.75"], ["0.8"]),
])
def test_a_decimal_beginning_a_bound_s_digits_is_taken(backend, tokenizer, schema, inside, outside):
    spec = llg(GrammarSpec.json_schema({"type": "object", "properties": {"x": schema}, "required": ["x"]}))
    for value, ok in [(v, True) for v in inside] + [(v, False) for v in outside]:
        m = backend.matcher(backend.compile(spec))
        t = ids(tokenizer, '{"x": ' + value + "}")
        assert (m.accept_tokens(t) == len(t) and m.can_terminate()) == ok, value


def test_only_plain_bounded_numbers_are_rewritten_for_their_bound_s_decimals():
    from constrained_spec.grammar.llguidance_schema import bound_prefixes_kept
    # pydantic's `x: float = Field(0.5, le=0.75)`: annotations stay beside the anyOf
    assert bound_prefixes_kept({"type": "number", "maximum": 0.75, "default": 0.5, "title": "t"}) == {
        "anyOf": [{"type": "number", "maximum": 0.75}, {"enum": [0.7]}], "default": 0.5, "title": "t"}
    assert bound_prefixes_kept({"type": "number", "maximum": 1.2345, "minimum": 1.2, "multipleOf": 0.01})["anyOf"][1] == {
        "enum": [1.2, 1.23]}  # the shorter decimals the rest allows: not 1.0 (minimum), 1.234 (multipleOf)
    draft4 = {"type": "number", "maximum": 1.49, "exclusiveMaximum": True}  # 1.4 is within "< 1.49" too
    assert bound_prefixes_kept(draft4)["anyOf"][1] == {"enum": [1.4]}
    for unchanged in ({"type": "number", "maximum": 1.5}, {"type": "number", "minimum": 1.49},
                      {"type": "number", "maximum": -1.49}, {"type": "integer", "maximum": 12.5},
                      {"type": ["number", "string"], "maximum": 1.49, "maxLength": 3},
                      {"enum": [1.49], "maximum": 1.49}):
        assert bound_prefixes_kept(unchanged) == unchanged


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "integer", "minimum": 10**19}, "minimum"),  # answered 9223372036854775807 under llguidance
    ({"type": "number", "minimum": 2**53 + 1}, "minimum"),  # xgrammar bounds numbers as doubles
    ({"const": 2**64 + 1}, "const"),  # xgrammar matched no text at all
    ({"type": "integer", "minimum": -1e23, "maximum": 1e23}, "minimum"),  # xgrammar's own check failed, in C++ words
])
def test_numbers_no_backend_holds_exactly_are_refused(backend, schema, keyword):
    with pytest.raises(GrammarError) as e:
        backend.compile(GrammarSpec.json_schema(schema).with_backend("auto"))
    assert e.value.keyword == keyword or "exceeds" in str(e.value), str(e.value)


def _wide(n: int, required=()) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}, "required": list(required)}


def test_an_object_too_wide_for_llguidance_goes_to_xgrammar(backend, tokenizer):
    """An object of 499 properties none required (600 under strict): llguidance's mask allowed "{"
    and accepting it failed (a parser row over its 2,000 items), a 500 mid-request. Now refused for llguidance
    (400 when asked for), compiled by xgrammar under auto; one required property keeps it."""
    from constrained_spec.grammar.llguidance_schema import MAX_OPTIONAL_ONLY_PROPERTIES as most
    with pytest.raises(GrammarError, match="none is required") as e:
        backend.compile(llg(GrammarSpec.json_schema(_wide(most + 1))))
    assert (e.value.keyword, e.value.path) == ("properties", "")
    nested = {"type": "array", "items": _wide(most + 1)}
    with pytest.raises(GrammarError) as e:
        backend.compile(llg(GrammarSpec.json_schema(nested)))
    assert e.value.path == "/items"
    served = backend.compile(GrammarSpec.json_schema(_wide(499)).with_backend("auto"))
    assert served.backend == "xgrammar"
    m = backend.matcher(served)
    t = ids(tokenizer, '{"p7": 1, "p498": 2}')
    assert m.accept_tokens(t) == len(t) and m.can_terminate()
    assert backend.compile(llg(GrammarSpec.json_schema(_wide(most + 1, ["p0"])))).backend == "llguidance"
    assert backend.compile(llg(GrammarSpec.json_schema(_wide(most)))).backend == "llguidance"


def test_a_backend_failure_is_told_from_a_refusal(backend, tokenizer, monkeypatch):
    """Where llguidance fails on a token its mask allowed (one of its parser limits), the matcher
    says why: the engine's error names it instead of a grammar violation."""
    from constrained_spec.grammar import llguidance_schema
    monkeypatch.setattr(llguidance_schema, "MAX_OPTIONAL_ONLY_PROPERTIES", 10**6)
    # the compile-time probe refuses it (it accepts a first token): these test the failure it misses
    monkeypatch.setattr(GrammarBackend, "_probe_llguidance", lambda self, compiled: None)
    m = backend.matcher(backend.compile(llg(GrammarSpec.json_schema(_wide(600)))))
    bitmask = backend.allocate_bitmask(1)
    m.fill_bitmask(bitmask, 0)
    brace = ids(tokenizer, "{")[0]
    assert allowed(bitmask, 0) >= {brace} and m.error() is None
    assert not m.accept_token(brace)
    assert "max is 2000" in m.error()
    ok = backend.matcher(backend.compile(llg(GrammarSpec.json_schema(_wide(3)))))
    assert not ok.accept_token(ids(tokenizer, "x")[0]) and ok.error() is None  # a refusal is not a failure


def test_unknown_backend_is_refused():
    with pytest.raises(GrammarError, match="grammar backend"):
        GrammarSpec.regex("a").with_backend("outlines")


def test_strict_closes_objects_where_xgrammar_does(backend, tokenizer):
    def accepts(spec, text):
        m = backend.matcher(backend.compile(spec))
        t = ids(tokenizer, text)
        return m.accept_tokens(t) == len(t) and m.can_terminate()
    extra = '{"name": "A", "age": 1, "x": 2}'
    for strict, expected in ((True, False), (False, True)):
        for name in ("llguidance", "xgrammar"):
            spec = GrammarSpec.json_schema(PERSON, strict=strict).with_backend(name)
            assert accepts(spec, extra) is expected, (name, strict)
    # an object without properties stays open under strict, as in xgrammar
    assert accepts(llg(GrammarSpec.json_schema({"type": "object"})), '{"x": 1}')
    # allOf branches are not closed (that would reject the other branch's properties)
    both = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]}
    assert close_objects(both) == both
    assert accepts(llg(GrammarSpec.json_schema({"type": "object", **both})), '{"a": 1, "b": 2}')
    # a required name the object does not declare is declared, any value, under both backends (llguidance
    # refused it as unsatisfiable, xgrammar served it: JSONSchemaBench Github_medium---o73996, QA 1130c)
    undeclared = {"type": "object", "properties": {"guid": {"type": "string"}}, "required": ["guid", "text"]}
    for name in ("llguidance", "xgrammar"):
        spec = GrammarSpec.json_schema(undeclared).with_backend(name)
        assert accepts(spec, '{"guid": "a", "text": [1]}') and not accepts(spec, '{"guid": "a", "text": 1, "x": 2}')
    # and one a dependency requires (its trigger could not be written: review 1130c M2)
    for dep in ({"dependentRequired": {"a": ["b"]}}, {"dependencies": {"a": ["b"]}}):
        spec = llg(GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, **dep}))
        assert accepts(spec, '{"a": 1, "b": 2}') and not accepts(spec, '{"a": 1}') and accepts(spec, '{}')


def test_strict_closes_a_reference_target_unless_it_is_intersected(backend, tokenizer):
    """A `$ref` target used only as a whole subschema is closed under `strict`, as xgrammar closes
    it; one referenced beside other keywords, or from an `allOf` branch (directly or through another
    target), stays open."""
    def accepts(spec, text):
        m = backend.matcher(backend.compile(spec))
        t = ids(tokenizer, text)
        return m.accept_tokens(t) == len(t) and m.can_terminate()
    pt = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    plain = {"$defs": {"pt": pt}, "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}}, "required": ["a"]}
    for name in ("llguidance", "xgrammar"):
        spec = GrammarSpec.json_schema(plain, strict=True).with_backend(name)
        assert accepts(spec, '{"a": {"x": 1}}') and not accepts(spec, '{"a": {"x": 1, "z": 1}}'), name
    assert close_objects(plain)["$defs"]["pt"]["additionalProperties"] is False
    # OpenAPI's `example` beside the `$ref` is an annotation: the target is still closed (review 1130c M3)
    noted = {**plain, "properties": {"a": {"$ref": "#/$defs/pt", "example": {"x": 1}}}}
    assert close_objects(noted)["$defs"]["pt"]["additionalProperties"] is False
    beside = {"$ref": "#/$defs/pt", "properties": {"y": {"type": "integer"}}}
    chained = {"$defs": {"pt": pt, "via": {"$ref": "#/$defs/pt"}},
               "allOf": [{"$ref": "#/$defs/via"}, {"properties": {"y": {"type": "integer"}}}]}
    for schema in ({"$defs": {"pt": pt}, **beside}, chained):
        assert "additionalProperties" not in close_objects(schema)["$defs"]["pt"]
        assert accepts(llg(GrammarSpec.json_schema(schema, strict=True)), '{"x": 1, "y": 2}')


def test_refusal_keyword():
    assert refusal_keyword('Unimplemented keys: ["not"]') == "not"
    assert refusal_keyword("Unknown format: foo") == "format"


def test_no_escaped_spelling_of_a_declared_name(backend, tokenizer):
    """An open object: `{"\\u0061": "x"}` names property a with a string; llguidance's default escapes
    let it through the other-properties branch. \\u escapes are left out of the grammar."""
    spec = llg(GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "number"}}}, strict=False))
    compiled = backend.compile(spec)
    for text, ok in (('{"\\u0061": "x"}', False), ('{"a": "x"}', False), ('{"a": 1, "b\\nc": "x"}', True)):
        m = backend.matcher(compiled)
        t = ids(tokenizer, text)
        assert (m.accept_tokens(t) == len(t) and m.can_terminate()) is ok, text
    # a literal only a \u escape writes is refused (llguidance dropped the character from it)
    with pytest.raises(GrammarError) as e:
        backend.compile(llg(GrammarSpec.json_schema({"const": "hello\u0000there"})))
    assert e.value.keyword == "const"
    assert backend.compile(GrammarSpec.json_schema({"const": "hello\u0000there"})).backend == "xgrammar"


@pytest.mark.parametrize("name", ["llguidance", "xgrammar"])
def test_dates_a_format_checker_takes(backend, tokenizer, name):
    """llguidance's own "date" takes year 0000 and Feb 29 of any year (the H100 stress run under auto
    answered "0000-01-01"); both backends now enforce the normalizer's patterns, as Python's
    date (jsonschema's format checker) reads dates."""
    import datetime
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                               "t": {"type": "string", "format": "date-time"}},
              "required": ["d", "t"]}
    compiled = backend.compile(GrammarSpec.json_schema(schema).with_backend(name))
    assert compiled.backend == name
    for day in ("0000-01-01", "2023-02-29", "1900-02-29", "2024-02-29", "2000-02-29", "0001-12-31", "2023-04-31"):
        try:
            ok = datetime.date.fromisoformat(day) is not None
        except ValueError:
            ok = False
        m = backend.matcher(compiled)
        t = ids(tokenizer, f'{{"d": "{day}", "t": "{day}T10:00:00Z"}}')
        assert (m.accept_tokens(t) == len(t) and m.can_terminate()) is ok, (name, day)


def test_auto_moves_a_repeated_grammar_to_xgrammar(tokenizer):
    """auto: a grammar's first request is llguidance's (compiled in ~1 ms); seen again, xgrammar
    compiles it in the background, and once that is done its requests take xgrammar's (cheaper
    masks at large batches). A schema the normalizer refuses stays llguidance's."""
    import time
    b = GrammarBackend(tokenizer, VOCAB, default_backend="auto", compile_workers=2)
    try:
        spec = GrammarSpec.json_schema({"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]})
        assert b.compile(spec).backend == "llguidance"
        for _ in range(3):  # the server's up-front checks are no uses
            assert b.compile_async(spec, check_only=True).result().backend == "llguidance"
        assert not b._background and b.queue.stats["inflight"] == 0
        assert b.compile(spec).backend == "llguidance"  # the second use starts xgrammar's compile
        deadline = time.monotonic() + 60
        while b._background and time.monotonic() < deadline:
            time.sleep(0.01)
        compiled = b.compile(spec)
        assert compiled.backend == "xgrammar" and compiled.spec == spec
        assert b.stats["auto_served_by_xgrammar"] == 1
        m = b.matcher(compiled)
        t = ids(tokenizer, '{"q": 12}')
        assert m.accept_tokens(t) == len(t) and m.can_terminate()
        only_llg = GrammarSpec.json_schema({"type": "object", "minProperties": 2})
        refusals = b.stats["schema_refusals"]
        for _ in range(3):
            assert b.compile(only_llg).backend == "llguidance"
        assert b.stats["schema_refusals"] == refusals  # the normalizer's refusal is not the request's
    finally:
        b.close()


def test_formats_as_patterns_rewrites_only_format_keywords():
    from constrained_spec.grammar.llguidance_schema import formats_as_patterns
    schema = {"type": "object",
              "properties": {"format": {"type": "string", "format": "date"},  # a property named format
                             "when": {"type": "array", "items": {"format": "date-time"}},
                             "mine": {"type": "string", "format": "date", "pattern": "^2"},  # its own pattern
                             "mail": {"type": "string", "format": "email"}},
              "enum": [{"format": "date"}], "default": {"format": "time"}}
    out = formats_as_patterns(schema)
    props = out["properties"]
    assert "format" not in props["format"] and props["format"]["pattern"].startswith("^")
    assert "format" not in props["when"]["items"] and "pattern" in props["when"]["items"]
    assert props["mine"] == {"type": "string", "format": "date", "pattern": "^2"}
    assert props["mail"] == {"type": "string", "format": "email"}
    assert out["enum"] == [{"format": "date"}] and out["default"] == {"format": "time"}
    assert schema["properties"]["format"]["format"] == "date"  # the input is not changed


def test_formats_llguidance_lacks_become_the_narrower_ones_it_has(backend, tokenizer):
    """`iri` and `idn-email` hold every `uri` and `email`: served by llguidance as those (where both
    refused them), and every answer a URI, so an IRI; `idn-hostname` stays refused."""
    from constrained_spec.grammar.llguidance_schema import formats_as_patterns
    assert formats_as_patterns({"format": "iri"}) == {"format": "uri"}
    assert formats_as_patterns({"format": "idn-email"}) == {"format": "email"}
    assert formats_as_patterns({"format": "idn-hostname"}) == {"format": "idn-hostname"}
    compiled = backend.compile(GrammarSpec.json_schema({"type": "string", "format": "iri"}))
    assert compiled.backend == "llguidance"
    for text, ok in (('"https://example.com/a?b=1"', True), ('"not a uri"', False)):
        m = backend.matcher(compiled)
        toks = ids(tokenizer, text)
        assert (m.accept_tokens(toks) == len(toks) and m.can_terminate()) == ok, text
    with pytest.raises(GrammarError):
        backend.compile(GrammarSpec.json_schema({"type": "string", "format": "idn-hostname"}))


@pytest.mark.parametrize("name", ["llguidance", "xgrammar", "auto"])
def test_a_grammar_that_accepts_nothing_is_refused(backend, name):
    """Its first mask would hold no token but a stop token its matcher refuses (llguidance) or none at
    all (xgrammar): the request would fail in the engine."""
    for spec in (GrammarSpec.ebnf("root ::= a\na ::= a"), GrammarSpec.regex("[^\\x00-\\U0010FFFF]")):
        with pytest.raises(GrammarError) as e:
            backend.compile(spec.with_backend(name))
        assert "accepts no" in str(e.value) or "failed to compile" in str(e.value)
    assert backend.compile(GrammarSpec.regex("a?").with_backend(name))  # may end at once


ENDLESS = [  # (spec, what its refusal names, whether it recurses)
    (GrammarSpec.ebnf('root ::= "a" root'), "rule root never ends", True),
    (GrammarSpec.ebnf('root ::= "a" b | "c" d\nb ::= "b" b\nd ::= ("d" root)+'), "rules root, b, d never end", True),
    (GrammarSpec.json_schema({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}),
     "$ref", True),
    (GrammarSpec.json_schema({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}},
                              "$ref": "#/$defs/n"}), "$ref", True),
    (GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[^\\s\\S]$"}},
                              "required": ["a"]}), "pattern", False),
    (GrammarSpec.regex("a[^\\s\\S]"), "character class", False),
]


@pytest.mark.parametrize("name", ["llguidance", "xgrammar", "auto"])
@pytest.mark.parametrize("spec,cause,recursive", ENDLESS, ids=[s.value[:24] for s, _, _ in ENDLESS])
def test_a_grammar_that_accepts_no_finite_string_is_refused(tokenizer, name, spec, cause, recursive):
    """Its masks always allow a token, so it compiled, and a request under it wrote until max_tokens
    ("length", its output never complete). Refused at compile time under every backend, the refusal
    cached like any other; one without recursion llguidance refuses by itself (its own words)."""
    b = GrammarBackend(tokenizer, VOCAB, default_backend=name)
    try:
        with pytest.raises(GrammarError) as e:
            b.compile(spec)
        if recursive or name == "xgrammar":
            assert "accepts no finite string" in str(e.value) and cause in str(e.value)
            assert recursive or "$ref" not in str(e.value)  # the cause named, not recursion's sentence
        compiles = b.stats["compile_count"]
        with pytest.raises(GrammarError):
            b.compile(spec)
        assert b.stats["compile_count"] == compiles and b.stats["cache_hits"] == 1
    finally:
        b.close()


@pytest.mark.parametrize("name", ["llguidance", "xgrammar", "auto"])
def test_recursive_grammars_that_can_end_are_served(backend, name):
    for spec in (GrammarSpec.ebnf('root ::= "a" root | "b"'),
                 GrammarSpec.ebnf('root ::= ("a" root)*'),
                 GrammarSpec.json_schema({"type": "object", "properties": {"next": {"$ref": "#"}}}),
                 GrammarSpec.json_schema({"type": "object", "required": ["next"], "properties": {
                     "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}),
                 GrammarSpec.json_schema({"type": "array", "items": {"$ref": "#"}, "minItems": 1, "maxItems": 1,
                                          "prefixItems": [{"type": "integer"}]})):
        assert backend.compile(spec.with_backend(name))


def test_unproductive_rules():
    import xgrammar as xgr
    from constrained_spec.grammar.dead_branches import unproductive_rules
    cases = {'root ::= x+\nx ::= "a" x': ["root", "x"], 'root ::= x{2,3}\nx ::= "a" x': ["root", "x"],
             'root ::= x* | x?\nx ::= "a" x': [], 'root ::= x{0,3}\nx ::= "a" x': [],
             'root ::= "a" x | y\nx ::= "b" | x\ny ::= y': [], 'root ::= [^\\x00-\\U0010FFFF]*': [],
             'root ::= "a" [^\\x00-\\x7f\\x80-\\U0010FFFF]': ["root"]}
    for ebnf, dead in cases.items():
        assert [r for r in unproductive_rules(xgr.Grammar.from_ebnf(ebnf)) if r in ("root", "x", "y")] == dead, ebnf


@pytest.mark.parametrize("schema,cycle", [
    ({"type": "object", "properties": {"next": {"$ref": "#"}}}, True),
    ({"$defs": {"a": {"items": {"$ref": "#/$defs/b"}}, "b": {"properties": {"c": {"$ref": "#/$defs/a"}}}},
      "$ref": "#/$defs/a"}, True),
    ({"$defs": {"a": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/a"}, "y": {"$ref": "#/$defs/a"}}},
     False),
    ({"$defs": {"a": {"properties": {"b": {"$ref": "#/$defs/b"}}}, "b": {"type": "string"}}, "$ref": "#/$defs/a"},
     False),
    ({"enum": [{"$ref": "#"}]}, False), ({"$ref": "#/nowhere"}, False),
])
def test_has_ref_cycle(schema, cycle):
    from constrained_spec.grammar.schema_refs import has_ref_cycle
    assert has_ref_cycle(schema) == cycle


@pytest.mark.parametrize("schema,path", [
    ({"$ref": "#"}, ""),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a", "title": "B"}}, "$ref": "#/$defs/a"}, ""),
    # reachable only through a required property: llguidance let a request write `{"a":` and then
    # offered only a stop token it refused
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
      "$defs": {"x": {"$ref": "#/$defs/x"}}}, "/properties/a"),
])
def test_a_reference_only_to_itself_is_refused(schema, path):
    with pytest.raises(GrammarError) as e:
        GrammarSpec.json_schema(schema)
    assert "leads only to references back to itself" in str(e.value) and e.value.keyword == "$ref"
    assert e.value.path == path


@pytest.mark.parametrize("schema", [
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "string"}}},
    {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
     "$ref": "#/$defs/node"},  # recursive, and satisfiable
    {"$ref": "#", "type": "string"},  # a sibling constrains (2019-09+)
    {"$ref": "#/$defs/missing"},  # unresolvable: the compilers say so
    {"$ref": "#foo", "$defs": {"A": {"$anchor": "foo", "type": "integer"}}},  # an anchor, not the root
    {"enum": [{"$ref": "#"}]},  # data, not a schema
    {"type": "string", "$defs": {"loop": {"$ref": "#/$defs/loop"}}},  # a cycle no $ref uses
])
def test_references_that_reach_a_schema_are_kept(schema):
    assert GrammarSpec.json_schema(schema).kind == "json_schema"


def test_llguidance_copies_of_one_template_accept_the_same_text(tokenizer):
    """A mask filled on one deep copy of an llguidance template once made later copies refuse valid
    text (the compile-time probe did that): every valid instance of o21073, each on a fresh copy."""
    import json
    from pathlib import Path
    rows = (Path(__file__).resolve().parent.parent / "schemas" / "jsonschemabench-dev.jsonl").read_text().splitlines()
    row = next(json.loads(line) for line in rows if '"Github_hard---o21073"' in line)
    b = GrammarBackend(tokenizer, VOCAB, max_whitespace_cnt=16, default_backend="llguidance")
    try:
        compiled = b.compile(GrammarSpec.json_schema(row["schema"], strict=False))
        for x in row["valid"]:
            t = ids(tokenizer, json.dumps(x, ensure_ascii=False))
            assert b.matcher(compiled).accept_tokens(t) == len(t)
    finally:
        b.close()


@pytest.mark.parametrize("spec", [GrammarSpec.choice([f"option number {i}" for i in range(2500)]),
                                  GrammarSpec.regex("a{1000000}")], ids=["row-of-2500", "lexer-limit"])
def test_grammars_past_llguidances_limits_are_found_at_compile_time(backend, spec):
    """llguidance builds its parser's rows and lexer lazily: these compiled, then failed at a
    request's first token (a 500 mid-answer). They are refused at compile time under llguidance
    (a 400 naming the limit) and served by xgrammar under auto."""
    with pytest.raises(GrammarError, match="llguidance cannot serve this"):
        backend.compile(spec.with_backend("llguidance"), timeout_s=60)
    assert backend.compile(spec.with_backend("auto"), timeout_s=60).backend == "xgrammar"


def test_one_matcher_checks_an_llguidance_grammar(tokenizer, monkeypatch):
    """The probe of llguidance's limits and the empty-language check each built a matcher from the
    grammar text (~0.4 ms, most of either check); both run on one now, as their refusals show."""
    from constrained_spec.grammar.llguidance_backend import LLGuidanceCompiler
    built = []
    new_matcher = LLGuidanceCompiler.new_matcher
    monkeypatch.setattr(LLGuidanceCompiler, "new_matcher", lambda self, text: built.append(1) or new_matcher(self, text))
    b = GrammarBackend(tokenizer, VOCAB, max_whitespace_cnt=16, default_backend="llguidance")
    try:
        cases = [(GrammarSpec.json_schema(PERSON), None),
                 (GrammarSpec.regex("a?"), None),  # nothing but the empty string: it ends at once
                 (GrammarSpec.regex("[^\\x00-\\U0010FFFF]"), "accepts no string"),
                 (GrammarSpec.choice([f"option number {i}" for i in range(2500)]), "llguidance cannot serve")]
        for spec, refusal in cases:
            built.clear()
            if refusal is None:
                assert b.compile(spec).backend == "llguidance"
            else:
                with pytest.raises(GrammarError, match=refusal):
                    b.compile(spec)
            assert len(built) == 2, spec  # the template, and one matcher for both checks
    finally:
        b.close()


def test_a_second_mask_past_llguidances_limits_is_found_at_compile(tokenizer):
    """An enum of 60,000 strings: llguidance's first mask allows the opening quote and its second
    fails ("too many expressions constructed"); the compile's probe accepted one token only, so the
    grammar was served and its requests failed at their second token (a 500). The probe computes
    the next mask too: llguidance cannot serve it (under auto: xgrammar's turn)."""
    import random
    rnd = random.Random(2)
    enum = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(40)) for _ in range(60000)]
    b = GrammarBackend(tokenizer, VOCAB, max_whitespace_cnt=16)
    try:
        with pytest.raises(GrammarError, match="llguidance cannot serve.*too many expressions"):
            b.compile(llg(GrammarSpec.json_schema({"enum": enum})))
    finally:
        b.close()


def test_llguidance_errors_read_as_one_line():
    """A regex's error was cut at its first line, "regex parse error:"; the reason is kept now, the
    caret lines and the grammar's quoted source left out."""
    raw = ('at 1(8): invalid regex "(ab" (in regex): regex parse error:\n    (ab\n    ^\nerror: unclosed group\n'
           '   1 | start: /(ab/\n              ^\n')
    assert error_text(raw) == 'at 1(8): invalid regex "(ab" (in regex): regex parse error: (ab error: unclosed group'
    assert error_text("lexer error: too many expressions constructed") == "lexer error: too many expressions constructed"
    assert error_text("x" * 900) == "x" * 500


def test_a_first_mask_past_llguidances_limits_is_not_an_empty_language(tokenizer):
    """20,000 alternatives and a recursion: llguidance's first mask fails ("Too many items") and
    allows no token. That was read as a grammar that accepts no string (a 400 saying so under
    llguidance, and under auto no fallback to xgrammar); it is llguidance that cannot serve it."""
    grammar = "root ::= " + " | ".join(f'"w{i}"' for i in range(20000)) + ' | "(" root ")"'
    b = GrammarBackend(tokenizer, VOCAB, max_whitespace_cnt=16)
    try:
        with pytest.raises(GrammarError, match="llguidance cannot serve"):
            b.compile(llg(GrammarSpec.ebnf(grammar)))
        m = b.matcher(b.compile(GrammarSpec.ebnf(grammar).with_backend("xgrammar")))
        text = ids(tokenizer, "(w7)")
        assert m.accept_tokens(text) == len(text) and m.can_terminate()
    finally:
        b.close()


def test_a_refused_one_of_says_what_a_request_can_do(backend):
    """llguidance's refusal told the user to "Enable 'coerce_one_of'", an option of its own no
    request can set."""
    overlapping = {"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                             {"type": "object", "properties": {"b": {"type": "string"}}}]}
    with pytest.raises(GrammarError) as e:
        backend.compile(GrammarSpec.json_schema(overlapping).with_backend("llguidance"), timeout_s=30)
    assert "coerce_one_of" not in str(e.value) and "Use anyOf" in str(e.value) and e.value.keyword == "oneOf"


SPELLS_SPECIAL = [GrammarSpec.choice(["<|endoftext|>"]), GrammarSpec.choice(["<|im_end|>", "x"]),
                  GrammarSpec.regex(r"a<\|endoftext\|>"), GrammarSpec.ebnf('root ::= "<filename>"'),
                  GrammarSpec.json_schema({"const": "x<|endoftext|>y"}),
                  # spelled another way (QA: a 500 in mid-answer under llguidance and auto's first uses)
                  GrammarSpec.regex("<[|]im_start[|]>"), GrammarSpec.regex("(<)(reponame)(>)"),
                  GrammarSpec.regex("<(file)_sep>"), GrammarSpec.regex(r"<\x7cim_end\x7c>"),
                  GrammarSpec.json_schema({"type": "string", "pattern": "^<(gh_stars)>$"}),
                  GrammarSpec.ebnf('root ::= "<" "filename" ">"'), GrammarSpec.ebnf('root ::= "<|" "im_end" "|>" " ok"')]


@pytest.mark.parametrize("name", ["llguidance", "auto"])
def test_a_grammar_spelling_a_special_token_is_served_by_xgrammar(backend, name):
    """llguidance's masks let the model write a special token's text (`<|endoftext|>` in a choice,
    `<filename>` in an EBNF literal, inside a JSON const) as the special token itself, which the
    matcher never takes as text: the request failed in mid-answer ("token 0 violates the grammar"),
    or the grammar was refused as accepting no string. xgrammar spells it in ordinary tokens."""
    specials = special_token_ids(backend.tokenizer)
    for spec in SPELLS_SPECIAL:
        compiled = backend.compile(spec.with_backend(name))
        assert compiled.backend == "xgrammar", spec
        m = backend.matcher(compiled)
        bitmask = torch.zeros((1, backend.bitmask_width), dtype=torch.int32)
        m.fill_bitmask(bitmask, 0)
        assert not allowed(bitmask, 0) & (specials - backend.stop_token_ids), spec
    for plain in (GrammarSpec.choice(["<b>", "im_end"]), GrammarSpec.regex("[a-z]+"),
                  GrammarSpec.json_schema({"type": "object", "properties": {"filename": {"type": "string"}}})):
        assert backend.compile(llg(plain)).backend == "llguidance", plain  # no special token's text


@pytest.mark.parametrize("spec", [GrammarSpec.regex("<[a-z_]+>"), GrammarSpec.regex("<(file|repo)[a-z]*>"),
                                  GrammarSpec.json_schema({"type": "string", "pattern": "^<[a-z_]+>$"})])
def test_a_wider_class_spelling_a_special_token_stays_on_llguidance(backend, tokenizer, spec):
    """llguidance offers the special token only where the grammar forces its whole text (it tokenizes
    forced text with the tokenizer, which reads `<filename>` as the token): a class that merely can
    spell it (`<[a-z_]+>`) forces nothing, and its masks offer ordinary tokens all along `<filename>`."""
    specials = special_token_ids(backend.tokenizer) - backend.stop_token_ids
    compiled = backend.compile(llg(spec))
    assert compiled.backend == "llguidance"
    m = backend.matcher(compiled)
    bitmask = torch.zeros((1, backend.bitmask_width), dtype=torch.int32)
    quote = ids(tokenizer, '"') if spec.kind == "json_schema" else []
    walk = quote + ids(tokenizer, "<") + ids(tokenizer, "filename") + ids(tokenizer, ">")
    for tok in walk:
        m.fill_bitmask(bitmask, 0)
        offered = allowed(bitmask, 0)
        assert not offered & specials and tok in offered, (spec, tok)
        assert m.accept_token(tok)


def test_a_special_token_s_text_is_answered_under_llguidance(tiny_llama_dir):
    from constrained_spec import SamplingParams
    from constrained_spec.engine import Engine, FinishReason
    eng = Engine(model=tiny_llama_dir, device="cpu")
    try:
        for spec, text in ((GrammarSpec.choice(["<|endoftext|>"]), "<|endoftext|>"),
                           (GrammarSpec.regex("<[|]im_start[|]>"), "<|im_start|>")):
            outs = eng.generate([[5, 6, 7]] * 4, [SamplingParams(max_tokens=24, temperature=1.0, seed=s)
                                                  for s in range(4)], spec.with_backend("llguidance"))
            assert all(o.text == text and o.finish_reason is FinishReason.STOP for o in outs), outs
    finally:
        eng.shutdown()

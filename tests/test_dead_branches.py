"""Grammars with dead branches: the root can end, but it reaches an alternative that cannot (an anyOf
branch that requires itself, `root ::= "a" | dead` with `dead ::= "b" dead`, a branch whose pattern
matches nothing). Their masks allowed the dead branch's first token, and a request that took it
wrote until max_tokens (finish "length", its output never valid). They are served without the
dead branches (`dead_branches.productivity`, `GrammarBackend._served_pruned`): no mask allows a
token that cannot lead to a complete string, and the grammar accepts the strings it did. A grammar
without dead branches compiles as before. CPU, SmolLM2's tokenizer; the end-to-end check runs the
tiny random Llama."""
from __future__ import annotations

import json
import time
import types

import pytest
import xgrammar as xgr

from constrained_spec.grammar import GrammarBackend, GrammarError, GrammarSpec

VOCAB = 49152
SELF_REQUIRING = {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/a"}],
                  "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}}}
NO_MATCH = "^[^\\s\\S]$"  # a pattern that matches no string

# (name, spec, the dead branch's first text, a live answer, the backends that serve it with llguidance's own
# grammar: llguidance masks out a pattern or character class that matches nothing by itself)
DEAD = [
    ("schema", GrammarSpec.json_schema(SELF_REQUIRING), "{", "null", ()),
    ("ebnf", GrammarSpec.ebnf('root ::= "a" | dead\ndead ::= "b" dead'), "b", "a", ()),
    ("pattern", GrammarSpec.json_schema({"anyOf": [{"type": "null"}, {"type": "string", "pattern": NO_MATCH}]}),
     '"', "null", ("llguidance", "auto")),
    ("pattern-in-recursion", GrammarSpec.json_schema({
        "type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                                         "tag": {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": NO_MATCH}]}},
        "required": ["tag"], "additionalProperties": False}), '{"tag": "', '{"tag": 1}', ()),
    ("regex", GrammarSpec.regex("a|b[^\\s\\S]"), "b", "a", ("llguidance", "auto")),
]


@pytest.fixture(scope="module")
def backends(tokenizer):
    made = {name: GrammarBackend(tokenizer, VOCAB, default_backend=name, max_whitespace_cnt=16)
            for name in ("xgrammar", "llguidance", "auto")}
    yield made
    for b in made.values():
        b.close()


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def allowed(backend: GrammarBackend, m) -> set:
    bitmask = backend.allocate_bitmask(1)
    m.fill_bitmask(bitmask, 0)
    return set(backend.allowed_tokens(bitmask[0]).tolist())


def accepts(backend, compiled, tokenizer, text) -> bool:
    m = backend.fresh_matcher(compiled)
    toks = ids(tokenizer, text)
    return m.accept_tokens(toks) == len(toks) and m.can_terminate()


@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "auto"])
@pytest.mark.parametrize("case,spec,dead,live,llg", DEAD, ids=[c[0] for c in DEAD])
def test_a_dead_branch_is_never_allowed(backends, tokenizer, name, case, spec, dead, live, llg):
    b = backends[name]
    compiled = b.compile(spec)
    assert accepts(b, compiled, tokenizer, live)
    # a fresh matcher, fed the dead branch's text but its last token, does not allow that token
    toks = ids(tokenizer, dead)
    m = b.fresh_matcher(compiled)
    assert m.accept_tokens(toks[:-1]) == len(toks) - 1
    assert toks[-1] not in allowed(b, m)
    assert not b.fresh_matcher(compiled).accept_tokens(toks) == len(toks)
    assert compiled.backend == ("llguidance" if name in llg else "xgrammar")
    assert compiled.pruned == (compiled.backend == "xgrammar")


def test_served_under_llguidance_and_auto_by_xgrammars_pruned_grammar(tokenizer):
    """llguidance builds its own grammar from the spec, which we cannot prune: the request gets
    xgrammar's grammar of it without the dead branch, compiled once and cached like any other."""
    for name in ("llguidance", "auto"):
        b = GrammarBackend(tokenizer, VOCAB, default_backend=name)
        try:
            first = b.compile(GrammarSpec.json_schema(SELF_REQUIRING))
            assert first.backend == "xgrammar" and first.pruned
            assert b.compile(GrammarSpec.json_schema(SELF_REQUIRING)) is first
            stats = b.stats
            assert stats["dead_branches_pruned"] == 1 and stats["served_by_xgrammar"] == 1
            assert stats["served_by_llguidance"] == 0 and stats["cache_hits"] == 1
        finally:
            b.close()


def test_the_pruned_grammar_is_saved_and_loaded_under_its_own_name(tokenizer, tmp_path):
    """A cache written before dead branches were pruned holds the grammar with them under the spec's
    name: the pruned one has another."""
    spec = GrammarSpec.json_schema(SELF_REQUIRING)
    b = GrammarBackend(tokenizer, VOCAB, default_backend="xgrammar", cache_dir=str(tmp_path), persist_min_s=0)
    try:
        key, _ = b._normalize(spec)
        b.compile(spec)
        deadline = time.monotonic() + 30
        while b.stats["disk_writes"] < 1:  # saved after the future resolves
            assert time.monotonic() < deadline, b.stats
            time.sleep(0.02)
        assert b.xgrammar.disk.get(b.xgrammar.disk_name(key, pruned=True)) is not None
        assert b.xgrammar.disk.get(b.xgrammar.disk_name(key)) is None
    finally:
        b.close()
    b = GrammarBackend(tokenizer, VOCAB, default_backend="xgrammar", cache_dir=str(tmp_path), persist_min_s=0)
    try:
        loaded = b.compile(spec)
        assert loaded.from_disk and loaded.pruned and b.stats["disk_hits"] == 1
        assert ids(tokenizer, "{")[0] not in allowed(b, b.fresh_matcher(loaded))
        assert accepts(b, loaded, tokenizer, "null")
    finally:
        b.close()


@pytest.mark.parametrize("spec", [
    GrammarSpec.ebnf('root ::= "a" root | "b"'),
    GrammarSpec.ebnf('root ::= ("a" root)* | x{0,2}\nx ::= [a-z]'),
    GrammarSpec.json_schema({"type": "object", "properties": {"next": {"$ref": "#"}}}),
    GrammarSpec.json_schema({"type": "object", "required": ["next"], "properties": {
        "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}),
    GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}}}),
    GrammarSpec.regex("a|b[c-d]"),
], ids=lambda s: s.value[:30])
def test_a_grammar_without_dead_branches_compiles_as_before(backends, spec):
    b = backends["xgrammar"]
    _, prepared = b._normalize(spec)
    assert b._refuse_if_unproductive(spec, prepared) is None
    compiled = b.compile(spec)
    assert not compiled.pruned
    assert compiled.grammar.serialize_json() == b.xgrammar.compile(spec, prepared).serialize_json()


def test_productivity_prunes_what_cannot_end():
    from constrained_spec.grammar.dead_branches import productivity, unproductive_rules
    cases = {  # grammar: its root rule once pruned (None: nothing to prune)
        'root ::= "a" | dead\ndead ::= "b" dead': 'root ::= (("a"))',
        'root ::= d* "a" d{0,3} | d? [a-z] | "q" d{0,2} | d{0,1} | d+\nd ::= "b" d':
            'root ::= ("" | (root_1 "a") | (root_2 [a-z]) | ("q"))',
        'root ::= "" | x\nx ::= "c" | [^\\x00-\\U0010FFFF]': None,  # x can end: its dead class is x's own
        'root ::= "a" root | "b"': None,
        'root ::= "a" [^\\x00-\\U0010FFFF] | "c"': 'root ::= (("c"))',
    }
    for ebnf, root in cases.items():
        dead, pruned = productivity(xgr.Grammar.from_ebnf(ebnf))
        assert dead == []
        if root is None:
            continue
        assert pruned is not None, ebnf
        assert str(pruned).splitlines()[0] == root, (ebnf, str(pruned))
    x = productivity(xgr.Grammar.from_ebnf('root ::= "" | x\nx ::= "c" | [^\\x00-\\U0010FFFF]'))[1]
    assert str(x).splitlines()[1] == 'x ::= (("c"))'
    # a grammar that cannot end at all is refused, not pruned
    assert productivity(xgr.Grammar.from_ebnf('root ::= "a" root')) == (["root"], None)
    assert unproductive_rules(xgr.Grammar.from_ebnf('root ::= "a" | dead\ndead ::= "b" dead')) == []


def test_a_pruned_grammar_accepts_the_strings_it_did(backends, tokenizer):
    b = backends["xgrammar"]
    spec = GrammarSpec.ebnf('root ::= x* "a" x{0,3} | x? [c-d] | "q" x{0,2} | x{0,1} | x+ | "e" y\n'
                            'x ::= "b" x\ny ::= "f" | "g" y | "h" x')
    compiled = b.compile(spec)
    assert compiled.pruned
    for text, ok in (("a", True), ("c", True), ("q", True), ("", True), ("ef", True), ("eggf", True),
                     ("b", False), ("ab", False), ("eh", False), ("egh", False)):
        assert accepts(b, compiled, tokenizer, text) == ok, text


def test_a_schema_with_a_dead_object_branch_in_the_dev_set(backends, tokenizer):
    """JSONSchemaBench's Github_medium---o74424: no type at the root, whose object branch requires
    properties that require themselves; every other type is an answer."""
    d = {"additionalProperties": False, "type": "object",
         "properties": {"nest": {"$ref": "#/$defs/d"}}, "required": ["nest"]}
    spec = GrammarSpec.json_schema({"$defs": {"d": d}, "properties": {"d": {"$ref": "#/$defs/d"}}, "required": ["d"]})
    for name in ("xgrammar", "auto"):
        compiled = backends[name].compile(spec)
        assert compiled.pruned
        assert ids(tokenizer, "{")[0] not in allowed(backends[name], backends[name].fresh_matcher(compiled))
        for text in ("null", "[]", '"s"', "1.5", "true"):
            assert accepts(backends[name], compiled, tokenizer, text), text


def test_a_grammar_that_cannot_end_is_still_refused(backends):
    for name, b in backends.items():
        with pytest.raises(GrammarError, match="accepts no finite string"):
            b.compile(GrammarSpec.ebnf('root ::= "a" dead\ndead ::= "b" dead'))


@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "auto"])
def test_sampled_answers_of_a_dead_branch_schema_end(tiny_llama_dir, name):
    """End to end: at temperature 1, with the first token of the dead branch pushed up, every answer is
    the live one and ends with a stop token (it wrote `{"x": {"x": ...` until max_tokens)."""
    from constrained_spec import SamplingParams
    from constrained_spec.engine import Engine, FinishReason
    engine = Engine(model=tiny_llama_dir, device="cpu", dtype="float32", grammar_cache_dir="none",
                    max_running_requests=16, grammar_backend=name)
    try:
        brace = engine.tokenizer.encode("{", add_special_tokens=False)[0]
        spec = GrammarSpec.json_schema(SELF_REQUIRING)
        params = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, logit_bias={brace: 5.0} if s % 2 else None)
                  for s in range(16)]
        outs = engine.generate(["Answer in JSON."] * 16, params, spec)
        assert [json.loads(o.text) for o in outs] == [None] * 16
        assert all(o.finish_reason is FinishReason.STOP for o in outs)
        # once, the compile cached; auto compiles a grammar it sees again under xgrammar's key too, in
        # the background (begun by now, or not yet)
        pruned = engine.grammar.stats["dead_branches_pruned"]
        assert pruned in ((1, 2) if name == "auto" else (1,))
        from constrained_spec.server.metrics import ServerMetrics, engine_snapshot
        state = types.SimpleNamespace(pending=0, limit=16)  # the service's admission counts
        text = ServerMetrics(engine, state).render(engine_snapshot(engine)).decode()
        (line,) = [ln for ln in text.splitlines() if ln.startswith("constrained_spec_grammar_dead_branches_pruned_total ")]
        assert float(line.split()[1]) >= pruned
    finally:
        engine.shutdown()

"""Dead branches of xgrammar grammars: the rules that derive no finite string.

A grammar whose root derives no finite string (`root ::= "a" root`) has no complete answer, and one
with such a branch (`root ::= "a" | dead`) lets a request into a branch it can never leave: both
backends' masks allow its first token, and the output ends "length", never valid. `productivity`
finds them on xgrammar's grammar of a request (its serialized expressions), and
`prune_dead_branches` writes the grammar without them (`GrammarBackend._refuse_if_unproductive`).
"""
from __future__ import annotations

import json
from typing import List, Optional

import xgrammar as xgr

# xgrammar 0.2.8's grammar expression types (`Grammar::GrammarExprType`, serialization "v16"); the
# types after REPEAT (tokens, structural-tag dispatch, regex, substring) are taken to be productive
GRAMMAR_FORMAT = "v16"
PRUNED = "dead branches pruned"  # in the disk cache's name of a grammar compiled without them
BYTES, CLASS, CLASS_STAR, EMPTY_STR, RULE_REF, SEQUENCE, CHOICES, TAG_DISPATCH, REPEAT = range(9)


def unproductive_rules(grammar: "xgr.Grammar") -> List[str]:
    """If the grammar's root derives no finite string (`root ::= "a" root`), the names of its rules
    that derive none, the root's first; else [] (`productivity`'s first answer)."""
    return productivity(grammar)[0]


def productivity(grammar: "xgr.Grammar", prune: bool = True):
    """(dead, pruned) for xgrammar's grammar of a spec.

    dead: if the grammar's root derives no finite string (`root ::= "a" root`), the names of its
    rules that derive none, the root's first; else []. The classic fixed point, over xgrammar's
    structure of the grammar (its serialized form: the printed EBNF would have to be parsed again).
    A sequence is productive once all its parts are, a choice once one is, a rule once its body is,
    `x{0,n}` always and `x{m,n}` once `x` is; a character class is unless it matches no character.
    Neither xgrammar nor llguidance checks this (0.2.8, 1.9.1): such a grammar compiles, and its
    requests write until max_tokens.

    pruned: where the root can end but an alternative reachable from it cannot (a dead branch:
    `root ::= "a" | d`, `d ::= "b" d`; a schema's anyOf branch that requires itself), the grammar
    without them (`prune_dead_branches`), else None. The masks of the grammar as written allow the
    dead branch's first token (xgrammar's and llguidance's alike: neither asks whether a branch
    can end), and a request that takes it can never end. None too where nothing is dead (the common
    case, one `in` over the fixed point's answer) or with `prune` false.

    Another serialization version is not read (nothing is unproductive, nothing pruned)."""
    d = json.loads(grammar.serialize_json())
    if d.get("__VERSION__") != GRAMMAR_FORMAT:
        return [], None
    data, starts, rules = d["grammar_expr_data"], d["grammar_expr_indptr"], d["rules"]
    n = len(starts)
    # nodes: expression i is node i, rule r node n + r; an expression is productive once `need` of
    # its children are (each counted once it is), a rule once its body is
    need = [0] * n
    users: dict = {}
    ready = []
    for i, s in enumerate(starts):
        kind, size = data[s], data[s + 1]
        if kind == RULE_REF or (kind == REPEAT and data[s + 3] > 0):
            children = (n + data[s + 2],)
        elif kind == SEQUENCE or kind == CHOICES:
            children = data[s + 2:s + 2 + size]
        elif kind == CLASS and _matches_nothing(data[s + 2:s + 2 + size]):
            continue
        else:
            children = ()
        if not children:
            if kind != CHOICES:  # a choice of nothing is never productive
                ready.append(i)
            continue
        need[i] = 1 if kind == CHOICES else len(children)
        for c in children:
            users.setdefault(c, []).append(i)
    for r, rule in enumerate(rules):
        users.setdefault(rule[1], []).append(n + r)
        need.append(1)
    productive = bytearray(n + len(rules))
    while ready:
        node = ready.pop()
        if productive[node]:
            continue
        productive[node] = 1
        for u in users.get(node, ()):
            need[u] -= 1
            if need[u] == 0:
                ready.append(u)
    root = d["root_rule_id"]
    if not productive[n + root]:
        return [rules[root][0]] + [rule[0] for r, rule in enumerate(rules)
                                   if r != root and not productive[n + r]], None
    if not prune or 0 not in productive:
        return [], None
    return [], prune_dead_branches(d, productive)


def prune_dead_branches(d: dict, productive: bytearray) -> Optional["xgr.Grammar"]:
    """The grammar (`d`, its serialized form, and `productive`, `productivity`'s fixed point over
    it, its root productive) without what its root reaches but derives no finite string, or None
    where its root reaches nothing dead (every unproductive rule is unused).

    The rewrite keeps each expression's id (rewritten ones get new contents) and each rule, so
    every reference stays valid: a choice reached from the root keeps only its productive
    alternatives (a sequence that needs a dead rule, or a character class that matches nothing,
    is such an alternative), and `x{0,n}` of a dead rule `x` becomes the empty string (dropped
    from its sequence). Each rewrite leaves the expression's finite strings as they were, so the
    grammar accepts the same strings, and a dead rule is no longer reached (xgrammar's optimizer
    drops unreached rules when it compiles; kept or not, a matcher never enters one). Not rewritten: a rule's lookahead
    assertion (a JSON schema's are of whitespace and punctuation) and a tag dispatch's rules (none
    in a JSON schema's, a regex's or an EBNF's without one)."""
    data, starts, rules = d["grammar_expr_data"], d["grammar_expr_indptr"], d["rules"]
    n = len(starts)
    ends = starts[1:] + [len(data)]
    # what the root reaches through productive expressions; xgrammar's normal form: a rule's body
    # is a choice of sequences (and "" first), a sequence's parts are strings, classes, rule
    # references and repeats
    reached = bytearray(n)
    choices, sequences, emptied = [], [], set()  # emptied: x{0,n} of a dead rule x
    dead_alternative = False
    stack = [rules[d["root_rule_id"]][1]]
    while stack:
        i = stack.pop()
        if reached[i]:
            continue
        reached[i] = 1
        s = starts[i]
        kind = data[s]
        if kind == RULE_REF or kind == REPEAT:
            rule = data[s + 2]
            if productive[n + rule]:
                stack.append(rules[rule][1])
            else:  # a repeat that may be empty (it is productive): no reference to a dead rule is
                emptied.add(i)
        elif kind == SEQUENCE:
            sequences.append(i)
            stack.extend(data[s + 2:ends[i]])  # all productive, as the sequence is
        elif kind == CHOICES:
            choices.append(i)
            for c in data[s + 2:ends[i]]:
                if productive[c]:
                    stack.append(c)
                else:
                    dead_alternative = True
    if not dead_alternative and not emptied:
        return None
    body: dict = {}
    empty = set(emptied)  # what becomes "": those, and sequences of nothing else
    for i in sequences:
        parts = data[starts[i] + 2:ends[i]]
        kept = [e for e in parts if e not in emptied]
        if not kept:
            empty.add(i)
        elif len(kept) < len(parts):
            body[i] = [SEQUENCE, len(kept)] + kept
    for i in empty:
        body[i] = [EMPTY_STR, 0]
    for i in choices:
        alternatives = data[starts[i] + 2:ends[i]]
        live = [c for c in alternatives if productive[c]]
        kept = [c for c in live if c not in empty and data[starts[c]] != EMPTY_STR]
        if len(kept) == len(alternatives):
            continue
        if len(kept) < len(live):  # one "", first
            kept.insert(0, next(c for c in live if c in empty or data[starts[c]] == EMPTY_STR))
        body[i] = [CHOICES, len(kept)] + kept
    new_data, new_starts = [], []
    for i in range(n):
        new_starts.append(len(new_data))
        new_data.extend(body.get(i) or data[starts[i]:ends[i]])
    d = dict(d, grammar_expr_data=new_data, grammar_expr_indptr=new_starts)
    return xgr.Grammar.deserialize_json(json.dumps(d, separators=(",", ":"), ensure_ascii=False))


def _matches_nothing(cls: List[int]) -> bool:
    """Whether a character class ([negated, lo0, hi0, lo1, hi1, ...]) matches no character."""
    ranges = sorted(zip(cls[1::2], cls[2::2]))
    if not cls[0]:
        return all(lo > hi for lo, hi in ranges)
    covered = -1  # a negated class matches nothing where its ranges cover every code point
    for lo, hi in ranges:
        if lo > covered + 1:
            return False
        covered = max(covered, hi)
    return covered >= 0x10FFFF

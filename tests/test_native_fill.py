"""The native mask-fill pool (`grammar/native_fill.py`, `native/mask_fill_pool.cpp`): the rows it
writes are xgrammar's own, for any number of helper threads and any row order, call after call;
an xgrammar error reaches the caller."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from constrained_spec.grammar import GrammarSpec
from constrained_spec.grammar.native_fill import NativeFill
from matcher_states import backend, matchers_along  # noqa: F401 (backend: a fixture)

SCHEMA = GrammarSpec.json_schema({
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                   "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
                   "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False})
TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["bb", "a"], "ok": True})
WIDTH = 1536  # SmolLM2's 49152 tokens / 32


@pytest.fixture(scope="module")
def states(backend):
    n = len(backend.tokenizer.encode(TEXT, add_special_tokens=False)) + 1
    ms, _ = matchers_along(backend, SCHEMA, TEXT, n)
    ref = torch.empty((n, WIDTH), dtype=torch.int32)
    for i, m in enumerate(ms):
        m.fill_bitmask(ref, i)
    return ms, ref


@pytest.fixture(scope="module")
def native():
    fill = NativeFill.create(3)
    assert fill is not None, "the native extension and xgrammar's FFI layout are part of the package"
    yield fill


@pytest.mark.parametrize("helpers", [0, 1, 3])
def test_rows_are_xgrammars(states, native, helpers):
    ms, ref = states
    order = list(range(len(ms)))
    random.Random(helpers).shuffle(order)
    out = torch.full((len(ms) + 5, WIDTH), 0x5A5A5A5A, dtype=torch.int32)
    rows = [r + 5 for r in order]  # matcher order[k] fills row order[k] + 5
    native.prepare([ms[i] for i in order], out, rows).run(helpers)
    assert torch.equal(out[5:], ref)
    assert (out[:5] == 0x5A5A5A5A).all()  # rows it was not given are untouched


def test_repeated_calls_are_stable(states, native):
    """Many calls in a row on the same threads (the engine's use): every one complete and exact."""
    ms, ref = states
    out = torch.empty_like(ref)
    fill = native.prepare(ms, out, list(range(len(ms))))
    for _ in range(300):
        out.fill_(0)
        fill.run(native.workers)
        assert torch.equal(out, ref)


def test_matcher_state_is_unchanged(states, native):
    ms, ref = states
    out = torch.empty_like(ref)
    native.prepare(ms, out, list(range(len(ms)))).run(2)
    again = torch.empty_like(ref)
    for i, m in enumerate(ms):
        m.fill_bitmask(again, i)
    assert torch.equal(again, ref)


def test_xgrammar_error_is_raised(states, native):
    """A bitmask too narrow for the vocabulary: xgrammar refuses it, and the caller hears why."""
    ms, _ = states
    narrow = torch.zeros((len(ms), WIDTH // 2), dtype=torch.int32)
    with pytest.raises(Exception):
        native.prepare(ms[:4], narrow, [0, 1, 2, 3]).run(1)


def test_bad_arguments_are_refused(states, native):
    ms, ref = states
    with pytest.raises(ValueError):
        native.prepare(ms[:2], torch.zeros((2, WIDTH), dtype=torch.int64), [0, 1])
    with pytest.raises(IndexError):
        native.prepare(ms[:2], torch.zeros((2, WIDTH), dtype=torch.int32), [0, 2]).run(0)
    from types import SimpleNamespace
    with pytest.raises(ValueError, match="FFI handle"):  # the pool would dereference it
        native.prepare([SimpleNamespace(ffi_handle=0)], torch.zeros((1, WIDTH), dtype=torch.int32), [0])


def states_and_next_rows(backend):
    """(n, n matchers along TEXT with ms[k] having taken ids[:k], ids, the rows of the n + 1 states
    along it: ref[k] is ms[k]'s row, ref[k + 1] its row after taking ids[k])."""
    n = len(backend.tokenizer.encode(TEXT, add_special_tokens=False))
    ms, ids = matchers_along(backend, SCHEMA, TEXT, n)
    after, _ = matchers_along(backend, SCHEMA, TEXT, n + 1)
    ref = torch.empty((n + 1, WIDTH), dtype=torch.int32)
    for i, m in enumerate(after):
        m.fill_bitmask(ref, i)
    return n, ms, ids, ref


def test_accept(backend, native):
    """Each matcher accepts its token (in parallel): the rows then are those of the next state; a
    refused token (illegal there, or outside the vocabulary) leaves its matcher as it was and is
    reported."""
    n, ms, ids, ref = states_and_next_rows(backend)
    tokens = list(ids[:n])
    tokens[0] = backend.tokenizer.encode("zebra", add_special_tokens=False)[0]  # an object must open first
    tokens[3] = 60000  # outside the vocabulary
    assert native.accept(ms, tokens, 2) == [0, 3]
    out = torch.empty((n, WIDTH), dtype=torch.int32)
    native.prepare(ms, out, list(range(n))).run(2)
    for k in range(n):
        assert torch.equal(out[k], ref[k] if k in (0, 3) else ref[k + 1]), k
    assert native.accept(ms[:0], [], 2) == []


def chains_with_a_refusal(backend, depth: int):
    """Matchers along TEXT with chains of three tokens from where each stands (ms[k] has taken
    ids[:k + 1]: its chain's root is ids[k]), the first chain's token at `depth` one its grammar
    refuses there, and every matcher's row as it stands (to check they are back where they were)."""
    n = len(backend.tokenizer.encode(TEXT, add_special_tokens=False))
    ms, ids = matchers_along(backend, SCHEMA, TEXT, n - 4)
    ms = ms[1:]
    chains = [[ids[k], ids[k + 1], ids[k + 2]] for k in range(len(ms))]
    chains[0][depth] = backend.tokenizer.encode("zebra", add_special_tokens=False)[0]
    return ms, chains, _rows_of(ms)


def _rows_of(ms) -> torch.Tensor:
    rows = torch.empty((len(ms), WIDTH), dtype=torch.int32)
    for i, m in enumerate(ms):
        m.fill_bitmask(rows, i)
    return rows


def test_refused_chain_token_raises_and_rolls_back(backend, native):
    """A draft chain the grammar refuses midway (a bug upstream: guided chains are legal) raises;
    every matcher, the refusing one included, is back where it was."""
    ms, chains, before = chains_with_a_refusal(backend, 2)  # refused after '{"'
    out = torch.zeros((3 * len(ms), WIDTH), dtype=torch.int32)
    call = native.chains_call(ms, chains, out, [3 * i for i in range(len(ms))], frozenset(), 2)
    with pytest.raises(RuntimeError, match="refused"):
        call()
    assert torch.equal(_rows_of(ms), before)


def test_partial_chain_walk_zeroes_rows_from_a_refused_token(backend, native):
    """Unguided drafts (a top-1 EAGLE chain): with `partial` a refused token ends its chain's walk,
    with no error; the rows up to it are the grammar's, the rows from it on allow nothing, and
    every matcher is back where it was."""
    ms, chains, before = chains_with_a_refusal(backend, 1)  # refused after '{'
    out = torch.full((3 * len(ms), WIDTH), 7, dtype=torch.int32)
    native.chains_call(ms, chains, out, [3 * i for i in range(len(ms))], frozenset(), 2, partial=True)()
    assert torch.equal(out[0], before[0]) and (out[1:3] == 0).all()  # the root's row, then nothing
    for i in range(1, len(ms)):
        assert torch.equal(out[3 * i], before[i]) and not (out[3 * i + 1:3 * i + 3] == 7).all()
    assert torch.equal(_rows_of(ms), before)


@pytest.mark.parametrize("helpers", [1, 3])
def test_started_fill_runs_on_the_pool(states, native, helpers):
    """`start` returns at once with the rows filling on the pool's threads; `finish` completes them.
    Until then the pool takes no other job."""
    ms, ref = states
    out = torch.zeros_like(ref)
    started = native.prepare(ms, out, list(range(len(ms))))
    started.start(helpers)
    with pytest.raises(RuntimeError, match="before the last fill_finish"):
        native.prepare(ms, out, list(range(len(ms)))).start(helpers)
    with pytest.raises(RuntimeError, match="before the last fill_finish"):
        native.prepare(ms, out, list(range(len(ms)))).run(0)
    with pytest.raises(RuntimeError, match="pending"):
        native.accept(ms[:1], [0], 0)
    started.finish()
    started.finish()  # once is enough; again is a no-op
    assert torch.equal(out, ref)
    native.prepare(ms, out, list(range(len(ms)))).run(1)  # the pool serves again


@pytest.mark.parametrize("helpers", [0, 2])
def test_accepts_ride_along_with_the_fill(backend, native, helpers):
    """The overlapped step's job: each matcher accepts its token (none where -1), then fills its row
    (none where -1): the rows are those of the states after the accepts; a refused token is
    reported, its matcher stays where it was and fills from there."""
    n, ms, ids, ref = states_and_next_rows(backend)
    tokens = list(ids[:n])
    tokens[1] = -1  # fill only: no token this step
    tokens[2] = backend.tokenizer.encode("zebra", add_special_tokens=False)[0]  # refused after '{'
    rows = list(range(n))
    rows[4] = -1  # accept only: no row this step
    out = torch.full((n, WIDTH), 0x5A5A5A5A, dtype=torch.int32)
    fill = native.prepare(ms, out, rows, tokens)
    fill.run(helpers)
    assert fill.refused() == [2]
    for k in range(n):
        if k == 4:
            assert (out[k] == 0x5A5A5A5A).all()  # no row: untouched
        else:
            assert torch.equal(out[k], ref[k] if k in (1, 2) else ref[k + 1]), k
    check = torch.empty((1, WIDTH), dtype=torch.int32)
    ms[4].fill_bitmask(check, 0)
    assert torch.equal(check[0], ref[5])  # the accept-only matcher moved on
    with pytest.raises(IndexError):
        native.prepare(ms[:1], out, [-2], [0]).run(0)
    with pytest.raises(IndexError):  # -1 means "no row" only beside tokens
        native.prepare(ms[:1], out, [-1]).run(0)


def _draft_tree(backend, ms_root, ids, rng: random.Random):
    """Paths (tokens after the matcher's state) of a random tree of draft nodes from where the
    matcher stands: children are legal tokens mostly, sometimes an illegal one (whose subtree the
    walk must zero) or the text's own next token, up to depth 5."""
    probe = torch.empty((1, WIDTH), dtype=torch.int32)
    paths = [[]]
    frontier = [[]]
    zebra = backend.tokenizer.encode("zebra", add_special_tokens=False)[0]
    for _ in range(5):
        nxt = []
        for path in frontier:
            fork = ms_root.fork()
            if fork.accept_tokens(path) < len(path) or fork.is_terminated():
                kids = [zebra]  # below an illegal node: anything
            else:
                fork.fill_bitmask(probe, 0)
                bits = np.unpackbits(probe[0].numpy().view(np.uint8), bitorder="little")  # (a Python loop over
                legal = np.flatnonzero(bits)[:400].tolist()  # the 49,152 bits was most of the test's time)
                kids = rng.sample(legal, min(2, len(legal))) + ([zebra] if rng.random() < 0.3 else [])
            for t in kids:
                nxt.append(path + [t])
        paths += nxt
        frontier = rng.sample(nxt, min(3, len(nxt)))
    return paths


def _reference_rows(m, paths):
    """Each path's row by the plain way: a fork accepts the path and fills; zero if it is refused.
    And whether each was refused."""
    out = torch.empty((len(paths), WIDTH), dtype=torch.int32)
    refused = []
    for j, path in enumerate(paths):
        fork = m.fork()
        refused.append(fork.accept_tokens(path) < len(path))
        if refused[-1] or fork.is_terminated():
            out[j] = 0
        else:
            fork.fill_bitmask(out, j)
    return out, refused


@pytest.mark.parametrize("parts", [1, 3])
def test_walks_fill_each_paths_row_as_a_fork_would(backend, native, parts):
    """Draft nodes given as paths, walked depth first (`WalkSteps.add_paths`, cut into `parts` walks
    on forks of the matcher): every node's row is the one a fork that accepted its path fills, zero
    below a refused token; the pool and the walk on this thread (`walk_paths_here`) agree, `ok` says
    which walks met a refused token, and the matchers end where they were."""
    from constrained_spec.grammar.walks import WalkSteps, sorted_paths, split_paths, walk_paths_here
    n = len(backend.tokenizer.encode(TEXT, add_special_tokens=False))
    ms, ids = matchers_along(backend, SCHEMA, TEXT, n)
    rng = random.Random(parts)
    refusals = 0
    for k in (1, 5, n // 2):
        m = ms[k]
        before = _rows_of([m])
        paths = _draft_tree(backend, m, ids, rng)
        ref, refused = _reference_rows(m, paths)
        runs = split_paths(sorted_paths(paths), parts)
        walkers = [m] + [m.fork() for _ in runs[1:]]
        steps = WalkSteps()
        for order in runs:
            steps.add_paths(paths, range(len(paths)), order, m.never_accepts)
            steps.end_walk()
        out = torch.full((len(paths), WIDTH), 7, dtype=torch.int32)
        ok = native.walk_call(walkers, steps.walks(), out, 2)()
        assert torch.equal(out, ref)
        assert ok.astype(bool).tolist() == [not any(refused[j] for j in order) for order in runs]
        here = torch.full_like(out, 7)
        walk_paths_here(m, paths, range(len(paths)), here)
        assert torch.equal(here, ref)
        refusals += sum(refused)
        assert torch.equal(_rows_of([m]), before)
    assert refusals  # the trees held refused tokens


def test_a_walk_that_rolls_back_past_its_start_is_refused(native, states):
    ms, _ = states
    out = torch.zeros((2, WIDTH), dtype=torch.int32)
    with pytest.raises(ValueError, match="rolls back past its start"):
        native.walk_call(ms[:1], _walks([([0, 2], [5, -1], [0, 1])]), out, 0)()
    with pytest.raises(IndexError):
        native.walk_call(ms[:1], _walks([([0], [-1], [2])]), out, 0)()


def _walks(steps):
    """Walks from (back, tokens, rows) lists per walk."""
    from constrained_spec.grammar.walks import WalkSteps
    built = WalkSteps()
    for back, tokens, rows in steps:
        built.back += back
        built.tokens += tokens
        built.rows += rows
        built.end_walk()
    return built.walks()


@pytest.mark.parametrize("partial", [False, True])
def test_chain_walk_ends_at_a_stop_token(backend, native, partial):
    """A chain drafted on past a stop token (a top-1 EAGLE chain drafts after `<|im_end|>`): the
    matcher that took the stop has ended, so the chain's walk ends there without an error (xgrammar
    refuses to fill a row of an ended matcher: the walk failed, and the engine step with it); the
    row after the stop allows nothing, so the tokens drafted past it are pruned, and the rows below
    are left alone. The other chains' rows are the grammar's, and every matcher is where it was."""
    ids = backend.tokenizer.encode(TEXT, add_special_tokens=False)
    ms, _ = matchers_along(backend, SCHEMA, TEXT, len(ids) + 1)
    ended, mid = ms[-1], ms[1]  # the whole text taken (the grammar may end here); '{' taken
    stop_ids = frozenset(backend.grammar.stop_token_ids)
    stop = min(stop_ids)
    before = _rows_of([mid, ended])
    out = torch.full((8, WIDTH), 7, dtype=torch.int32)
    chains = [[ids[0], ids[1], ids[2], ids[3]], [ids[-1], stop, ids[0], ids[1]]]
    native.chains_call([mid, ended], chains, out, [0, 4], stop_ids, 2, partial)()
    assert torch.equal(out[:4], _rows_of(ms[1:5]))  # row d: after the chain's tokens 1..d
    assert torch.equal(out[4], before[1])  # the stop's parent: the stop is legal there
    assert (out[5] == 0).all() and (out[6:] == 7).all()
    assert torch.equal(_rows_of([mid, ended]), before) and not ended.is_terminated()


def test_chain_walks_end_at_the_first_stop():
    """`Walks.of_chains`' arrays: each chain's root is taken (no token), row first_row + d follows
    token d; a chain's walk ends at its first stop token (the row after it is returned to be zeroed,
    the steps past it fill nothing and accept nothing), and only its first: a second stop in the same
    chain, or chains without one, change nothing else."""
    from constrained_spec.grammar.walks import NO_TOKEN, Walks
    STOP = 2
    chains = [[7, 8, 9], [7, STOP, 8, STOP, 9], [7, 8, STOP], [STOP, 8]]  # the last root is no stop: taken
    walks, ended = Walks.of_chains(chains, [0, 10, 20, 30], frozenset({STOP}))
    assert walks.offsets.tolist() == [0, 3, 8, 11, 13]
    assert walks.tokens.tolist() == [NO_TOKEN, 8, 9, NO_TOKEN, STOP, NO_TOKEN, NO_TOKEN, NO_TOKEN,
                                     NO_TOKEN, 8, STOP, NO_TOKEN, 8]
    assert walks.rows.tolist() == [0, 1, 2, 10, -1, -1, -1, -1, 20, 21, -1, 30, 31]
    assert ended == [11, 22]  # after chain 1's token 1 and chain 2's token 2
    assert Walks.of_chains(chains, [0, 10, 20, 30], frozenset())[1] == []

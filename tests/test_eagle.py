"""EAGLE on the CPU with a tiny random target and head: the head's serving and training forwards
agree, it saves and loads, its drafts are trees of legal tokens, and speculation with it is
lossless (greedy output equals plain greedy output token for token; seeded sampling equals plain
seeded sampling), with and without a JSON schema."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from constrained_spec import SamplingParams
from constrained_spec.engine import Engine
from constrained_spec.grammar import GrammarSpec
from constrained_spec.models import load_model
from constrained_spec.models.eagle import EagleHead, HeadMismatch, init_head, load_head, save_head

from server_fixtures import exact_dtype
from grammar_pin import PINNED

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Describe a cat.", "List three colors.", "Give a JSON profile of a chef.", "What is 2+2?"]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, tiny_head_dir):
    made = {}

    def get(name, **kw):
        if name not in made:
            made[name] = Engine(model=tiny_llama_dir, device="cpu", dtype=exact_dtype(), max_running_requests=8, grammar_backend=PINNED,
                                kv_cache_slots=4096, **kw)
        return made[name]
    yield get
    for e in made.values():
        e.shutdown()


def test_sequence_forward_matches_serving_forward(tiny_llama_dir, tiny_head_dir):
    """The training forward (padded batch, plain torch) and the serving forward (paged KV, the
    attention backend) compute the same head."""
    from constrained_spec.attention import AttentionMetadata, ForwardMode, KVCache, get_attention_backend
    loaded = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu")
    cfg = loaded.config
    head = load_head(tiny_head_dir, cfg, torch.float32, "cpu")
    torch.manual_seed(0)
    L = 7
    feats = torch.randn(1, L, cfg.hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (1, L))
    with torch.no_grad():
        ref = head.sequence_forward(loaded.model, feats, ids)[0]
    kv = KVCache(1, L + 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    slots = torch.arange(1, L + 1)
    meta = AttentionMetadata(mode=ForwardMode.EXTEND, out_slots=slots, q_starts=torch.tensor([0, L], dtype=torch.int32),
                             q_lens=torch.tensor([L], dtype=torch.int32), kv_lens=torch.tensor([L], dtype=torch.int32),
                             slot_table=slots[None], max_q_len=L, max_kv_len=L)
    with torch.inference_mode():
        out = head(loaded.model, feats[0], ids[0], torch.arange(L), kv, meta, get_attention_backend("torch", "cpu"))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_head_refuses_another_models_shapes(tiny_head_dir, tiny_qwen2_dir, tmp_path):
    other = load_model(tiny_qwen2_dir, dtype=torch.float32, device="cpu").config
    with pytest.raises(HeadMismatch, match="another model"):
        load_head(tiny_head_dir, other, torch.float32, "cpu")
    with pytest.raises(HeadMismatch, match="train-eagle"):
        load_head(tmp_path, other, torch.float32, "cpu")
    saved = json.loads((__import__("pathlib").Path(tiny_head_dir) / "config.json").read_text())
    assert saved["architecture"] == "eagle" and saved["info"] == {"test": True}


def _greedy(engine, prompts, grammar=None, n=32):
    return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0), grammar)]


@pytest.mark.parametrize("topk,depth,masked", [(1, 4, 1), (3, 4, 1), (2, 1, 1), (3, 4, 2), (1, 4, 4)])
def test_eagle_greedy_is_lossless(engines, tiny_head_dir, topk, depth, masked):
    plain = engines("plain")
    spec = engines(f"eagle{topk}{depth}" + (f"m{masked}" if masked > 1 else ""), speculative_algorithm="eagle",
                   eagle_head=tiny_head_dir, eagle_topk=topk, eagle_depth=depth, eagle_masked_depths=masked,
                   speculative_policy="always", speculative_min_accept=0.0)
    grammar = GrammarSpec.json_schema(SCHEMA)
    for g in (None, grammar, grammar.with_backend("llguidance")):
        ref = _greedy(plain, PROMPTS, g)
        got = _greedy(spec, PROMPTS, g)
        assert got == ref
    st = spec.spec.stats
    assert st.steps > 0 and st.verified_requests > 0
    assert spec.runner.pool.num_free == spec.runner.pool.capacity


def test_drafting_reads_count_as_device_waits(engines, tiny_head_dir, monkeypatch):
    """The drafter's reads of the device (each masked depth's frontier, the drafts) go through the
    engine's `stats.wait_for_device`, so /metrics' device-wait figure holds them."""
    spec = engines("eagle34m2", speculative_algorithm="eagle", eagle_head=tiny_head_dir, eagle_topk=3, eagle_depth=4,
                   eagle_masked_depths=2, speculative_policy="always", speculative_min_accept=0.0)
    drafter = spec.spec.drafter
    assert drafter.wait_for_device == spec.stats.wait_for_device
    reads, proposals = [], []
    monkeypatch.setattr(drafter, "wait_for_device", lambda wait: reads.append(1) or spec.stats.wait_for_device(wait))
    propose = drafter.propose_arrays
    monkeypatch.setattr(drafter, "propose_arrays", lambda batch: proposals.append(1) or propose(batch))
    before = spec.stats.device_wait_seconds
    _greedy(spec, PROMPTS[:2], GrammarSpec.json_schema(SCHEMA), n=8)
    assert proposals and len(reads) == 2 * len(proposals)  # depth 2's frontier, then the drafts
    assert spec.stats.device_wait_seconds > before


def test_eagle_seeded_sampling_equals_plain(engines, tiny_head_dir):
    plain = engines("plain")
    spec = engines("eagle34", speculative_algorithm="eagle", eagle_head=tiny_head_dir, eagle_topk=3, eagle_depth=4,
                   speculative_policy="always", speculative_min_accept=0.0)
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=11 + i) for i in range(len(PROMPTS))]
    for g in (None, GrammarSpec.json_schema(SCHEMA)):
        ref = [o.token_ids for o in plain.generate(PROMPTS, params, g)]
        got = [o.token_ids for o in spec.generate(PROMPTS, params, g)]
        assert got == ref


@pytest.mark.parametrize("masked", [1, 2, 4])
def test_drafted_trees_are_well_formed_and_verified_legal(engines, tiny_head_dir, masked, monkeypatch):
    """The drafter masks depths 1..M by the grammar (`eagle_masked_depths`) and drafts deeper
    unmasked; every tree is well formed (parents before children, within the width, every node
    linked), its nodes at masked depths are legal, and what the worker verifies after its grammar
    traversal holds only legal paths: the illegal deeper nodes (a random head drafts some) are pruned.
    Every verified node's row is the grammar's after its path, whether copied from the drafting
    (`Drafter.filled_rows`) or walked on forks of the matcher."""
    from constrained_spec.speculative.tree import HostTrees
    # four grammar threads and walks of one path: the rows walk on forks of each matcher
    # (`MaskFiller.fill_paths`), as on a many-core host
    spec = engines(f"eagle34m{masked}t4", speculative_algorithm="eagle", grammar_mask_threads=4,
                   grammar_paths_per_walk=1,
                   eagle_head=tiny_head_dir, eagle_topk=3, eagle_depth=4, eagle_masked_depths=masked,
                   speculative_policy="always", speculative_min_accept=0.0)
    worker, drafter = spec.spec, spec.spec.drafter
    native, forked, owners = spec.masks._native, [], set()  # owners: the requests' own matchers
    walk_call = native.walk_call

    def spy_walk(matchers, *a, **k):
        forked.append(sum(id(m) not in owners for m in matchers))
        return walk_call(matchers, *a, **k)
    monkeypatch.setattr(native, "walk_call", spy_walk)
    seen, bad, pruned = [], [], []  # recorded on the engine thread, asserted here
    propose, mask_trees = drafter.propose_arrays, worker._mask_trees

    def path_to(trees, b, j):
        path = [j]
        while trees.parents[b, path[-1]] > 0:
            path.append(int(trees.parents[b, path[-1]]))
        return [int(trees.tokens[b, i]) for i in reversed(path)]

    def legal(m, path):
        took = m.accept_tokens(path)
        m.rollback(took)
        return took == len(path)

    def spy_propose(batch):
        owners.update(id(r.matcher) for r in batch.requests)
        out = propose(batch)
        tokens, nxt, sib, count = out
        for b, r in enumerate(batch.requests):
            n = int(count[b])
            toks = tokens[b, :n].copy()
            toks[0] = r.output_ids[-1]
            trees = HostTrees.build(toks[None], nxt[b:b + 1, :n], sib[b:b + 1, :n], np.array([n]))
            if not trees.live.all() or (trees.parents[0, 1:] >= np.arange(1, n)).any():
                bad.append(("malformed", n))
            if r.matcher is not None:
                bad.extend(("masked depth", j) for j in range(1, n) if trees.depth[0, j] <= masked
                           and not legal(r.matcher, path_to(trees, 0, j)))
            seen.append(n)
        return out

    def row_after(m, path):
        row = torch.zeros((1, io_width[0]), dtype=torch.int32)
        took = m.accept_tokens(path)
        if took == len(path) and not m.is_terminated():
            m.fill_bitmask(row, 0)
        m.rollback(took)
        return row[0]

    def spy_mask(reqs, trees, io, filled=None):
        if filled is not None:
            reused.append(int((filled[2] >= 0).sum()))
        out = mask_trees(reqs, trees, io, filled)
        io_width[0] = io.bitmask_rows.shape[1]
        N = trees.shape[1]
        for b, r in enumerate(reqs):
            live = np.nonzero(out.live[b])[0]
            bad.extend(("verified", j) for j in live[1:] if not legal(r.matcher, path_to(out, b, j)))
            pruned.append(int(trees.live[b].sum() - len(live)))
            # every verified node's row is the grammar's after its path, copied from the drafting or not
            bad.extend(("row", j) for j in live
                       if not torch.equal(io.bitmask_rows[b * N + j], row_after(r.matcher, path_to(out, b, j) if j else [])))
        return out
    reused, io_width = [], [0]
    drafter.propose_arrays, worker._mask_trees = spy_propose, spy_mask
    try:
        outs = spec.generate(PROMPTS[:2], SamplingParams(max_tokens=24, temperature=0), GrammarSpec.json_schema(SCHEMA))
        assert all(o.finish_reason in ("length", "stop") for o in outs), outs  # no spy failed a request
    finally:
        drafter.propose_arrays, worker._mask_trees = propose, mask_trees
    assert not bad, bad[:5]
    assert seen and max(seen) > 1
    assert (sum(pruned) > 0) == (masked < 4)  # every depth masked: nothing left to prune
    assert sum(reused) > 0  # rows filled while drafting served the verify trees
    assert sum(forked) > 0  # and rows were walked on forks


def test_train_eagle_end_to_end(tiny_llama_dir, tmp_path):
    """`constrained-spec train-eagle` on the CPU with the tiny model: answers generated by the
    engine, features captured, the head trained (the loss falls), saved with how it was made, and
    measured by the engine with it on held-out JSON tasks; the saved head loads and drafts."""
    from constrained_spec.cli import main
    out = tmp_path / "head"
    rc = main(["train-eagle", "--model", tiny_llama_dir, "--out", str(out), "--device", "cpu", "--dtype", "float32",
               "--prompts", "8", "--max-tokens", "24", "--gen-batch", "8", "--max-steps", "30", "--lr", "3e-3",
               "--batch-tokens", "512", "--eval-prompts", "2", "--log-level", "warning"])
    assert rc == 0
    info = json.loads((out / "config.json").read_text())["info"]
    assert info["answers"] == 8 and info["steps"] == 30 and info["config"]["prompts"] == 8
    assert info["heldout_acceptance"]["spec_steps"] > 0 and info["heldout_acceptance"]["mean_accepted"] >= 1.0
    log = json.loads((out / "train_log.json").read_text())
    assert log["loss"][-1] < log["loss"][0]
    loaded = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu")
    load_head(out, loaded.config, torch.float32, "cpu")


def test_default_head_is_only_for_the_default_model(tiny_llama_dir, smollm2_dir):
    from constrained_spec.models.eagle import default_head_dir
    assert default_head_dir(None).name == "smollm2-135m-eagle"
    assert default_head_dir("SmolLM2-135M") == default_head_dir(smollm2_dir) == default_head_dir(None)
    with pytest.raises(HeadMismatch, match="train-eagle"):
        default_head_dir(tiny_llama_dir)
    tiny = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu").config
    with pytest.raises(HeadMismatch):  # it does not fit the tiny model
        load_head(default_head_dir(None), tiny, torch.float32, "cpu")


def test_features_are_the_targets_pre_norm_hidden_states(engines, tiny_head_dir):
    """What the drafter reads at a position's slot is the target's last-layer output before the final
    norm there, whichever forward computed it (prefill, plain decode, verify)."""
    from constrained_spec.attention import AttentionMetadata, ForwardMode, KVCache
    spec = engines("eagle34", speculative_algorithm="eagle", eagle_head=tiny_head_dir, eagle_topk=3, eagle_depth=4,
                   speculative_policy="always", speculative_min_accept=0.0)
    runner, drafter = spec.runner, spec.spec.drafter
    checked = []
    original = drafter.propose_arrays

    def spy(batch):
        r = batch.requests[0]
        n = r.num_cached
        slots = torch.from_numpy(runner.table.host[r.row, :n].copy())
        got = runner.features[slots].float()
        model, cfg = runner.model, runner.mcfg
        kv = KVCache(cfg.num_layers, n + 1, cfg.num_kv_heads, cfg.head_dim, runner.dtype, "cpu")
        own = torch.arange(1, n + 1)
        meta = AttentionMetadata(mode=ForwardMode.EXTEND, out_slots=own, q_starts=torch.tensor([0, n], dtype=torch.int32),
                                 q_lens=torch.tensor([n], dtype=torch.int32), kv_lens=torch.tensor([n], dtype=torch.int32),
                                 slot_table=own[None], max_q_len=n, max_kv_len=n)
        x, residual = model.embed_tokens(torch.tensor(r.all_ids[:n])), None
        for layer in model.layers:  # the layers by hand: the last one's output plus the residual stream
            x, residual = layer(x, residual, torch.arange(n), model.rope, kv, meta, runner.backend)
        want = x + residual
        checked.append(float((got - want.float()).abs().max() / want.float().abs().max()))
        return original(batch)
    drafter.propose_arrays = spy
    try:
        _greedy(spec, PROMPTS[:1], n=12)
    finally:
        drafter.propose_arrays = original
    assert checked and max(checked) < 1e-3, checked


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [3, 4])
def test_eagle_on_cuda_graphs_is_lossless(tiny_llama_dir, tiny_head_dir, topk):
    """On CUDA the draft steps replay graphs (one per batch size and masking) and the output is the
    plain engine's, greedy, with and without a schema; top-4 drafts through the fused Triton tail
    (`kernels.topk_logprobs`, `speculative.frontier`), top-3 through the torch one."""
    kw = dict(model=tiny_llama_dir, device="cuda", dtype="float32", max_running_requests=8, kv_cache_slots=1 << 14)
    plain = Engine(**kw)
    spec = Engine(**kw, speculative_algorithm="eagle", eagle_head=tiny_head_dir, eagle_topk=topk,
                  eagle_depth=4, speculative_policy="always", speculative_min_accept=0.0)
    try:
        assert spec.runner.graphs.can_draft(4)
        assert {("draft", "start", 4, False), ("draft", "start", 4, True), ("draft", "step", 4, False)} <= \
            set(spec.runner.graphs.graphs)
        # a prompt longer than the start graph's width: its first draft catches up eagerly, then replays
        prompts = PROMPTS[:3] + [" ".join(PROMPTS) * 3]
        for g in (None, GrammarSpec.json_schema(SCHEMA)):
            assert _greedy(spec, prompts, g) == _greedy(plain, prompts, g)
        profile = spec.spec.drafter.profile
        assert spec.spec.stats.steps > 0 and profile.eager == 0 and profile.seconds["catch_up"] > 0
        assert profile.syncs == profile.calls  # one read per draft
    finally:
        plain.shutdown()
        spec.shutdown()


@pytest.mark.gpu
def test_fused_chains_on_cuda_graphs_are_lossless(tiny_llama_dir, tiny_head_dir):
    """Top-1 chains on CUDA: the verify tail, the acceptance and the next chain's draft replay one
    graph per batch size and masking, each step reads once, and the output is the plain engine's,
    greedy, with and without a schema, on the same chains the unfused step verifies."""
    kw = dict(model=tiny_llama_dir, device="cuda", dtype="float32", max_running_requests=8, kv_cache_slots=1 << 14,
              grammar_backend=PINNED)
    spec_kw = dict(speculative_algorithm="eagle", eagle_head=tiny_head_dir, eagle_topk=1, eagle_depth=4,
                   speculative_policy="always", speculative_min_accept=0.0)
    plain, fused, apart = Engine(**kw), Engine(**kw, **spec_kw), Engine(**kw, **spec_kw, eagle_fused_chain=False)
    try:
        N = fused.spec.width
        assert {("verify", "chain", 4, N, False), ("verify", "chain", 4, N, True)} <= set(fused.runner.graphs.graphs)
        assert not any(k[:2] == ("verify", "chain") for k in apart.runner.graphs.graphs)
        prompts = PROMPTS[:3] + [" ".join(PROMPTS) * 3]
        for g in (None, GrammarSpec.json_schema(SCHEMA)):
            ref = _greedy(plain, prompts, g)
            assert _greedy(fused, prompts, g) == ref
            assert _greedy(apart, prompts, g) == ref
        st = fused.spec.stats
        assert st.steps > 0 and fused.spec.fused_steps == st.steps
        assert fused.spec.drafter.profile.calls < st.steps / 4  # drafted apart only for arrivals
        assert fused.runner.pool.num_free == fused.runner.pool.capacity
    finally:
        for e in (plain, fused, apart):
            e.shutdown()


@pytest.mark.parametrize("topk", [2, 1])
def test_eagle_with_retractions_is_lossless(tiny_llama_dir, tiny_head_dir, engines, topk):
    """A pool too small for every request: requests are retracted and prefilled again on new rows
    and slots (the head's record of what it has seen no longer holds, nor the chain a fused step
    drafted) and speculation pauses while the trees do not fit; greedy output is still the plain
    engine's, and nothing fails."""
    plain = engines("plain")
    prompts = [plain.chat_prompt([{"role": "user", "content": f"Name a color number {i}."}]) for i in range(12)]
    per_req = max(len(p) for p in prompts) + 24
    small = Engine(model=tiny_llama_dir, device="cpu", dtype=exact_dtype(), max_running_requests=12, grammar_backend=PINNED,
                   kv_cache_slots=4 * per_req, speculative_algorithm="eagle", eagle_head=tiny_head_dir, eagle_topk=topk,
                   eagle_depth=3, speculative_num_draft_tokens=4, speculative_policy="always",
                   speculative_min_accept=0.0)
    try:
        sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        got = [o.token_ids for o in small.generate(prompts, sp)]
        assert got == [o.token_ids for o in plain.generate(prompts, sp)]
        assert small.scheduler.num_retractions > 0 and small.spec.stats.steps > 0
    finally:
        small.shutdown()


def test_fused_chains_draft_what_the_drafter_drafts(tiny_qwen2_dir, tmp_path):
    """Top-1 chains run fused (`chain_step.py`: the next chain drafted in the verify's launch) and
    draft, without a grammar, the very chains the drafter drafts apart, step by step; the drafter
    itself drafts only for requests that arrive. With a grammar (drafts unmasked, pruned before
    verify) and with seeded sampling (which drafts apart) the output is the plain engine's, fused
    or not. (The tied-head Qwen2's head accepts drafts, so the fused step's acceptance is exercised.)"""
    loaded = load_model(tiny_qwen2_dir, dtype=torch.float32, device="cpu")
    head_dir = str(save_head(init_head(EagleHead(loaded.config), loaded.model), tmp_path, dtype=torch.float32))
    kw = dict(model=tiny_qwen2_dir, device="cpu", dtype=exact_dtype(), max_running_requests=8, grammar_backend=PINNED,
              kv_cache_slots=4096)
    spec_kw = dict(speculative_algorithm="eagle", eagle_head=head_dir, eagle_topk=1, eagle_depth=4,
                   speculative_policy="always", speculative_min_accept=0.0)
    plain, fused, apart = Engine(**kw), Engine(**kw, **spec_kw), Engine(**kw, **spec_kw, eagle_fused_chain=False)
    try:
        assert fused.spec.drafter.fuses_chains and not apart.spec.drafter.fuses_chains
        chains = {}
        for spec in (fused, apart):
            st, profile, io = spec.spec.stats, spec.spec.drafter.profile, spec.spec._verify_io()
            verified, set_inputs = [], io.set_inputs
            io.set_inputs = lambda size, rows, base, trees, slots: (
                verified.append(trees.tokens[:, 1:].copy()), set_inputs(size, rows, base, trees, slots))
            try:  # one prompt at a time: the steps' batches do not depend on when requests arrive
                for prompt in PROMPTS:
                    assert _greedy(spec, [prompt], n=40) == _greedy(plain, [prompt], n=40)
            finally:
                del io.set_inputs
            chains[spec] = verified
            assert spec.spec.fused_steps == (st.steps if spec is fused else 0)
            assert profile.calls == (st.steps if spec is apart else len(PROMPTS))  # fused: each one's first step
            assert st.accepted_tokens > 0
        same = [np.array_equal(a, b) for a, b in zip(chains[fused], chains[apart])]
        assert len(chains[fused]) == len(chains[apart]) and all(same), same
        grammar = GrammarSpec.json_schema(SCHEMA)
        params = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=3 + i) for i in range(len(PROMPTS))]
        for spec in (fused, apart):
            assert _greedy(spec, PROMPTS, grammar) == _greedy(plain, PROMPTS, grammar)
            assert [o.token_ids for o in spec.generate(PROMPTS, params, grammar)] == \
                [o.token_ids for o in plain.generate(PROMPTS, params, grammar)]
            assert spec.runner.pool.num_free == spec.runner.pool.capacity
    finally:
        for e in (plain, fused, apart):
            e.shutdown()


def test_select_trees_matches_the_path_by_path_layout():
    """The vectorized tree selection lays out what picking candidate by candidate does: the best
    width-1 finite candidates, parents first, children best first, siblings linked in order."""
    from constrained_spec.speculative.eagle import _candidates, _select_trees
    rng = np.random.default_rng(3)
    B, D, K, W = 12, 5, 3, 8
    tok = rng.integers(0, 1000, (B, D, K * K))
    logp = np.log(rng.dirichlet(np.ones(K * K), (B, D)))
    score = np.full_like(logp, -np.inf)
    best = np.zeros((B, D, K), np.int64)
    score[:, 0, :K] = logp[:, 0, :K]  # depth 1: the root's K children, all of them the frontier
    best[:, 0] = np.arange(K)
    for t in range(1, D):  # as the draft step does: children add their log-probability to the parent's
        parent_score = np.take_along_axis(score[:, t - 1], best[:, t - 1], 1)
        score[:, t] = np.repeat(parent_score, K, 1) + logp[:, t]
        best[:, t] = np.argsort(-score[:, t], -1)[:, :K]
    cand = _candidates(tok, score, best, K)
    cand[1][0, :] = -np.inf  # a request with nothing to draft
    cand[1][1, 1:] = -np.inf  # and one with a single node
    *got, node_cand = _select_trees(*cand, W)
    for b in range(B):
        want = _select_one(*(x[b] for x in cand), W)
        for g, w in zip(got, want):
            assert np.array_equal(g[b], w), b
    assert list(got[3][:2]) == [1, 2] and (got[3][2:] > 2).all()


def _select_one(tok, score, parent, depth, width):
    """The reference: one request, candidate by candidate."""
    tokens, nxt, sib = np.zeros(width, np.int64), np.full(width, -1), np.full(width, -1)
    picked = [c for c in np.lexsort((depth, -score))[:width - 1] if np.isfinite(score[c])]
    picked.sort(key=lambda c: (depth[c], -score[c]))
    node_of, last_child = {-1: 0}, {}
    for i, c in enumerate(picked, 1):
        p = node_of[int(parent[c])]
        node_of[int(c)] = i
        tokens[i] = tok[c]
        if p in last_child:
            sib[last_child[p]] = i
        else:
            nxt[p] = i
        last_child[p] = i
    return tokens, nxt, sib, 1 + len(picked)


@pytest.mark.parametrize("backend_name,threads", [("xgrammar", 1), ("xgrammar", 3), ("llguidance", 2)])
def test_frontier_rows_match_path_by_path_fills(tokenizer, backend_name, threads, capfd):
    """A masked depth's rows (`MaskFiller.fill_paths`, the frontier's paths walked depth first, on
    forks of the matcher when the pool has threads): every row equals a fill after accepting that
    path alone; a path through a refused token, or ending on a stop token, gets an empty row; the
    matcher ends where it started. A path past a stop token is not walked (xgrammar warned of each
    token a terminated matcher was asked to accept: 18 lines for 3 JSON answers under EAGLE)."""
    from constrained_spec.engine.mask_filler import MaskFiller
    from constrained_spec.grammar import GrammarBackend
    backend = GrammarBackend(tokenizer, 49152, default_backend=backend_name)  # no disk cache (cache_dir None)
    try:
        matcher = backend.matcher(backend.compile(GrammarSpec.json_schema(SCHEMA)))
        rng = np.random.default_rng(threads)
        legal = lambda m: np.nonzero(_allowed(m))[0]
        stem = []
        for _ in range(3):
            t = int(rng.choice(legal(matcher)))
            matcher.accept_token(t)
            stem.append(t)
        paths = []
        for j in range(6):  # branches off the stem at several depths
            cut = j % 4
            matcher.rollback(len(stem) - cut)
            path = stem[:cut]
            for _ in range(2):
                t = int(rng.choice(legal(matcher)))
                matcher.accept_token(t)
                path.append(t)
            matcher.rollback(len(path))
            matcher.accept_tokens(stem)
            paths.append(path)
        matcher.rollback(len(stem))
        paths.append([0, 0])  # illegal at once
        paths.append([1] + stem)  # a special token first
        # a second request, where the grammar may end: paths ending on, and going past, a stop token
        ended = backend.matcher(backend.compile(GrammarSpec.json_schema({"type": "integer"})))
        digit = tokenizer.encode("4", add_special_tokens=False)[0]
        assert ended.accept_token(digit) and ended.can_terminate()
        stop = min(backend.stop_token_ids)
        ended_paths = [[stop], [digit], [stop, digit], [digit, stop]]
        ms, all_paths = [matcher, ended], [paths, ended_paths]
        before = torch.zeros((2, 1536), dtype=torch.int32)
        for i, m in enumerate(ms):
            m.fill_bitmask(before, i)
        filler = MaskFiller(torch.zeros((1, 1536), dtype=torch.int32), threads=threads, budget_ms=None,
                            max_requests=2, stop_ids=backend.stop_token_ids)
        got = torch.full((len(paths) + len(ended_paths) + 2, 1536), -1, dtype=torch.int32)
        rows = [list(range(2, len(paths) + 2)), list(range(len(paths) + 2, len(got)))]
        capfd.readouterr()
        filler.fill_paths(ms, all_paths, rows, got)
        assert "has terminated" not in capfd.readouterr().err
        want = torch.zeros_like(got)
        for m, node_paths, node_rows in zip(ms, all_paths, rows):
            for path, row in zip(node_paths, node_rows):
                took = m.accept_tokens(path)
                if took == len(path) and not m.is_terminated():
                    m.fill_bitmask(want, row)
                m.rollback(took)
        assert torch.equal(got[2:], want[2:]) and (got[:2] == -1).all()
        live = (want[2:] != 0).any(1).tolist()
        assert live == [True] * 6 + [False] * 2 + [False, True, False, False]
        after = torch.zeros_like(before)
        for i, m in enumerate(ms):
            m.fill_bitmask(after, i)
        assert torch.equal(after, before)
    finally:
        backend.close()


def _allowed(matcher) -> np.ndarray:
    row = torch.zeros((1, 1536), dtype=torch.int32)
    matcher.fill_bitmask(row, 0)
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")
    return bits[:49152].astype(bool)


def test_staged_start_equals_eager_start(engines, tiny_head_dir):
    """The start of a draft step read from the staged block (the layout its CUDA graph replays) gives
    what the eager start gives from packed tensors: same first frontier, scores and root state; so
    does an eager catch-up of the positions the staged start cannot take, followed by it."""
    spec = engines("eagle34", speculative_algorithm="eagle", eagle_head=tiny_head_dir, eagle_topk=3, eagle_depth=4,
                   speculative_policy="always", speculative_min_accept=0.0)
    runner, io = spec.runner, spec.spec.drafter.io
    N, B = io.width, 2
    rows = np.array([runner.table.take_row() for _ in range(B)])
    n = np.array([N + 5, N + 9])
    slots_all = [runner.pool.alloc(int(k)) for k in n]
    try:
        for r, s in zip(rows, slots_all):
            runner.table.host[r, :len(s)] = s
            runner.table.device_table[r, :len(s)] = torch.from_numpy(s)
        torch.manual_seed(1)
        runner.features.normal_()
        q_lens = np.array([N, N])
        start = n - q_lens
        pos = np.concatenate([np.arange(a, b) for a, b in zip(start, n)])
        slots = np.concatenate([s[a:b] for s, a, b in zip(slots_all, start, n)])
        ids = np.random.default_rng(0).integers(0, runner.vocab_size, len(pos))
        results = []
        for graphed in (True, False):
            eager = io.set_inputs(B, rows, n, ids, pos, slots, q_lens, graphed)
            with torch.inference_mode():
                io.start(B, False, eager, None if graphed else int(q_lens.max()), int(n.max()))
            results.append([x.clone() for x in (io.front_tok[:B * 3], io.front_score[:B * 3], io.parent_hidden[:B * 3],
                                                io.out_tok[:B, 0], io._n_rep[:B * 3])])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b)
        # a request further behind than the graph's width: the positions before the last N are caught
        # up eagerly first (their K/V), then the staged start reads the last N: the same as one eager
        # start over everything the head has not seen
        whole = np.concatenate([np.arange(0, k) for k in n])
        slots_whole = np.concatenate(slots_all)
        ids_whole = np.random.default_rng(1).integers(0, runner.vocab_size, len(whole))
        last_n = np.concatenate([np.arange(o + k - N, o + k) for o, k in zip([0, n[0]], n)])
        # (padded as on CUDA: one more sequence on the spare table row, writing slot 0)
        runs = []
        for caught_up in (False, True, "padded"):
            io.kv.k.zero_()  # nothing the other run wrote
            io.kv.v.zero_()
            with torch.inference_mode():
                if caught_up:
                    behind = np.concatenate([np.arange(o, o + k - N) for o, k in zip([0, n[0]], n)])
                    pad_to = len(behind) + 3 if caught_up == "padded" else None
                    io.catch_up(rows, n - N, ids_whole[behind], whole[behind], slots_whole[behind], n - N, int(n.max()),
                                pad_to=pad_to)
                    io.set_inputs(B, rows, n, ids_whole[last_n], whole[last_n], slots_whole[last_n], q_lens, True)
                    io.start(B, False)
                else:
                    eager = io.set_inputs(B, rows, n, ids_whole, whole, slots_whole, n, False)
                    io.start(B, False, eager, int(n.max()), int(n.max()))
            runs.append([x.clone() for x in (io.front_tok[:B * 3], io.front_score[:B * 3], io.parent_hidden[:B * 3])])
        for other in runs[1:]:
            for a, b in zip(runs[0], other):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    finally:
        for r, s in zip(rows, slots_all):
            runner.table.release_row(int(r))
            runner.pool.free(s)


def test_serve_flags_reach_the_engine_process(tiny_llama_dir, tiny_head_dir, engines):
    """`serve --speculative-algorithm eagle --eagle-*`: the flags become the EngineConfig the engine
    process is started with, it speculates with the head (verify steps in /metrics), and the answer
    over HTTP equals plain greedy decoding."""
    import httpx

    from constrained_spec.cli import build_parser, engine_config_from_args
    from constrained_spec.server.app import ServerConfig, create_app
    from constrained_spec.server.engine_process import EngineProcess
    from constrained_spec.server.runner import start_server_thread

    args = build_parser().parse_args(["serve", "--model", tiny_llama_dir, "--device", "cpu", "--dtype", exact_dtype(),
                                      "--grammar-cache-dir", "none", "--max-running-requests", "8",
                                      "--kv-cache-slots", "4096", "--speculative-algorithm", "eagle",
                                      "--eagle-head", tiny_head_dir, "--eagle-topk", "2", "--eagle-depth", "3"])
    config = engine_config_from_args(args)
    assert (config.speculative_algorithm, config.eagle_head, config.eagle_topk, config.eagle_depth) == \
        ("eagle", tiny_head_dir, 2, 3)
    process = EngineProcess(config)
    client = process.connect(owns_process=True)
    handle = start_server_thread(create_app(client, ServerConfig(served_model_name="tiny"), owns_engine=True))
    try:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 24, "ignore_eos": True, "temperature": 0}
        r = httpx.post(handle.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        metrics = httpx.get(handle.url + "/metrics", timeout=30).text
        steps = [float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("constrained_spec_spec_verify_steps")]
        assert steps and steps[0] > 0, metrics
        plain = engines("plain").generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert r.json()["choices"][0]["text"] == plain[0].text
    finally:
        handle.stop()
        process.stop()


def _toy_training_data(loaded, n_seqs: int = 12, length: int = 16, prompt: int = 4, seed: int = 0):
    """Random sequences with random 'features' standing in for the target's: enough for the
    training loop's bookkeeping (schedule, logging), not for learning anything."""
    from constrained_spec.training.eagle import Batches
    g = torch.Generator().manual_seed(seed)
    seqs = [(torch.randint(0, loaded.config.vocab_size, (length,), generator=g).numpy(), prompt) for _ in range(n_seqs)]
    feats = torch.randn(n_seqs * length, loaded.config.hidden_size, generator=g)
    index = [(i * length, length, prompt) for i in range(n_seqs)]
    return Batches(seqs, feats, index, batch_tokens=4 * length, device=torch.device("cpu"), seed=seed)


def test_time_budgeted_schedule_follows_the_clock_not_the_first_steps(tiny_llama_dir, monkeypatch):
    """A time-budgeted run decays its learning rate over the budget's seconds. The first steps of a
    CUDA run are far slower than the rest (kernel compiles, allocator growth); a schedule sized from
    their speed ended its cosine within the first ~5% of the H100 run's steps and trained the rest at
    the floor (lr / 10)."""
    from constrained_spec.training import eagle as eagle_train
    from constrained_spec.training.eagle_config import TrainConfig
    loaded = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu")
    target = loaded.model.requires_grad_(False)
    head = init_head(EagleHead(loaded.config), target)
    data = _toy_training_data(loaded)

    clock = {"now": 0.0, "calls": 0}

    class FakeTime:  # a step takes 1 s for the first 20 steps, then 0.5 s: 20 s + 80 steps in 60 s
        @staticmethod
        def perf_counter():
            return clock["now"]

    real_losses = eagle_train._losses

    def timed_losses(*a, **kw):
        clock["calls"] += 1
        clock["now"] += 1.0 if clock["calls"] <= 20 else 0.5
        return real_losses(*a, **kw)

    seen_lr = []

    class RecordingAdamW(torch.optim.AdamW):
        def step(self, *a, **kw):
            seen_lr.append((clock["now"], self.param_groups[0]["lr"]))
            return super().step(*a, **kw)

    monkeypatch.setattr(eagle_train, "time", FakeTime)
    monkeypatch.setattr(eagle_train, "_losses", timed_losses)
    monkeypatch.setattr(torch.optim, "AdamW", RecordingAdamW)
    cfg = TrainConfig(out="unused", train_minutes=1.0, lr=1e-3, noise=0.0)
    eagle_train.train_head(head, target, data, list(range(len(data.seqs))), [], cfg, scale=1.0)
    assert 95 <= len(seen_lr) <= 105
    # the old schedule: 60 steps planned from the first 20, cosine over steps 0..60 (t = 40 s), then the floor
    mid = [lr for t, lr in seen_lr if 29.0 <= t <= 31.0]  # half the budget: cos(pi / 2), lr 0.55e-3 (old: 0.33e-3)
    assert mid and all(0.45e-3 < lr < 0.65e-3 for lr in mid), mid
    late = [lr for t, lr in seen_lr if 47.0 <= t <= 49.0]  # 80%: 0.186e-3 (old: the floor, 0.1e-3)
    assert late and all(0.16e-3 < lr < 0.21e-3 for lr in late), late


def test_unrolled_draft_steps_see_what_a_serving_draft_sees(tiny_llama_dir, tiny_head_dir):
    """Draft step s of the training-time unroll at position k equals the head run over the verified
    context 0..k-s+1 followed by its own earlier guesses (what a draft node at depth s reads and
    attends to while serving), for sequences padded to different lengths; step 1 is sequence_forward."""
    from constrained_spec.training.eagle import unrolled_forward
    loaded = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu")
    target = loaded.model
    head = load_head(tiny_head_dir, loaded.config, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    B, L, H = 2, 10, loaded.config.hidden_size
    feats = torch.randn(B, L, H, generator=g) * 3
    ids = torch.randint(0, loaded.config.vocab_size, (B, L), generator=g)
    lengths = torch.tensor([L, 7])
    with torch.no_grad():
        steps = unrolled_forward(head, target, feats, ids, lengths, 3)
        one = head.sequence_forward(target, feats, ids, lengths)
        torch.testing.assert_close(steps[0], one)
        for b in range(B):
            n = int(lengths[b])
            for s in (2, 3):
                for k in range(s - 1, n):
                    root = k - s + 1  # the last verified position; then the guesses of steps 1..s-1
                    guesses = [steps[u - 1][b, root + u - 1] for u in range(1, s)]
                    f = torch.cat([feats[b, :root + 1], torch.stack(guesses)])[None]
                    want = head.sequence_forward(target, f, ids[b:b + 1, :k + 1])[0, -1]
                    torch.testing.assert_close(steps[s - 1][b, k], want, rtol=1e-4, atol=1e-4)


def test_training_on_unrolled_draft_steps_and_their_held_out_top1(tiny_llama_dir):
    """`unroll` > 1 trains on the head's own guesses too (the loss falls, stays finite with answers
    shorter than the unroll), and validation reports held-out top-1 at draft steps 1..3 beside the
    step-1 figure, whatever the unroll."""
    from dataclasses import dataclass
    from constrained_spec.training import eagle as eagle_train
    from constrained_spec.training.eagle_config import TrainConfig

    @dataclass
    class Cfg(TrainConfig):
        unroll: int = 1

    loaded = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu")
    target = loaded.model.requires_grad_(False)
    data = _toy_training_data(loaded, n_seqs=10, length=16, prompt=13)  # answers of 3 tokens: step 3 barely fits
    for unroll in (1, 3):
        head = init_head(EagleHead(loaded.config), target)
        hist = eagle_train.train_head(head, target, data, list(range(8)), [8, 9],
                                      Cfg(out="unused", max_steps=40, lr=3e-3, unroll=unroll), scale=1.0)
        assert hist["unroll"] == unroll and all(math.isfinite(x) for x in hist["loss"])
        assert hist["loss"][-1] < hist["loss"][0]
        assert len(hist["val_top1_by_step"]) == len(hist["val_step"]) == 1  # at the end
        for by_step, top1 in zip(hist["val_top1_by_step"], hist["val_top1"]):
            assert len(by_step) == 3 and by_step[0] == pytest.approx(top1, abs=1e-4)


def test_catch_up_pads_to_few_sizes():
    """A catch-up's row count on CUDA is a power of two (at least 64), so that its GEMMs repeat their
    shapes; unpadded where the padding would not fit the spare table row."""
    from constrained_spec.speculative.eagle_step import catch_up_size
    assert [catch_up_size(n, 8192) for n in (1, 64, 65, 300, 372, 5094)] == [64, 64, 128, 512, 512, 8192]
    assert len({catch_up_size(n, 8192) for n in range(300, 500)}) == 1
    assert catch_up_size(9000, 4096) == 9000  # 16,384 would pad 7,384 positions, past a row of 4,096


def test_warmed_catch_up_changes_nothing(engines, tiny_head_dir):
    """The start-up warm-up of the catch-up (run on CUDA after the draft graphs are captured) runs
    the head over padding alone at each padded size, writing only the reserved slot 0: speculation
    after it is as lossless as before, and the pool is whole."""
    plain = engines("plain")
    spec = engines("eagle34warm", speculative_algorithm="eagle", eagle_head=tiny_head_dir, eagle_topk=3, eagle_depth=4,
                   speculative_policy="always", speculative_min_accept=0.0)
    io = spec.spec.drafter.io
    sizes = io.warm_catch_up()
    assert sizes[0] == 64 and sizes[-1] <= io.max_context < 2 * sizes[-1]
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    grammar = GrammarSpec.json_schema(SCHEMA)
    for g in (None, grammar):
        assert _greedy(spec, PROMPTS, g) == _greedy(plain, PROMPTS, g)
    assert spec.runner.pool.num_free == spec.runner.pool.capacity


@pytest.fixture(scope="module")
def answers_to_their_end(smollm2_dir):
    """SmolLM2's plain greedy JSON answers to 12 hand-written schemas, under either grammar backend,
    most of them ended by `<|im_end|>` within 40 tokens: (engine arguments, prompts, grammars,
    [(token ids, finish reason)])."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cases = [json.loads(line) for line in (ROOT / "schemas/handwritten/handwritten.jsonl").read_text().splitlines()
             if line.strip()][:12]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{c['prompt']} Answer in JSON."}],
                                       tokenize=True, add_generation_prompt=True) for c in cases]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts] * 2
    grammars = [GrammarSpec.json_schema(c["schema"]).with_backend(backend)
                for backend in (None, "llguidance") for c in cases]  # both backends' draft walks
    kw = dict(model=smollm2_dir, device="cpu", dtype=exact_dtype(), max_running_requests=24, grammar_backend=PINNED)
    plain = Engine(**kw)
    try:
        want = [(o.token_ids, o.finish_reason) for o in plain.generate(prompts, END_PARAMS, grammars)]
    finally:
        plain.shutdown()
    assert sum(reason == "stop" for _, reason in want) >= 6  # answers that end inside the drafts' reach
    return kw, prompts, grammars, want


END_PARAMS = SamplingParams(max_tokens=40, temperature=0)


@pytest.mark.parametrize("drafts", ["fused chain", "tree, every depth masked"])
def test_drafts_past_the_end_of_an_answer(answers_to_their_end, drafts):
    """SmolLM2 with the shipped head: where a JSON answer ends, drafts go on past `<|im_end|>`.
    A chain's grammar walk ends at the stop token and the tokens after it are pruned (the walk
    failed on the ended matcher, and the engine step with every running request, before 81af8fc);
    a masked tree's frontier after a stop allows nothing. The answers, run to their end, equal
    plain decoding's."""
    kw, prompts, grammars, want = answers_to_their_end
    shape = dict(eagle_topk=1, eagle_depth=7) if drafts == "fused chain" else dict(eagle_masked_depths=6)
    spec = Engine(**kw, speculative_algorithm="eagle", speculative_policy="always", speculative_min_accept=0.0,
                  **shape)
    try:
        got = [(o.token_ids, o.finish_reason, o.error) for o in spec.generate(prompts, END_PARAMS, grammars)]
        assert got == [(ids, reason, None) for ids, reason in want]
        assert spec.spec.stats.steps > 0 and spec.spec.stats.failed_steps == 0
        assert (spec.spec.fused_steps > 0) == (drafts == "fused chain")
    finally:
        spec.shutdown()

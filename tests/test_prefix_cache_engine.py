"""Prefix caching through the engine (CPU): greedy output is the same with and without the cache,
with grammars and with n-gram speculation; a small pool filled past capacity with distinct
prefixes evicts, finishes everything, and accounts for every slot; cached_tokens is reported."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from constrained_spec import SamplingParams
from constrained_spec.engine import Engine, FinishReason
from constrained_spec.grammar import GrammarSpec
from grammar_pin import PINNED

SYSTEM = ("You are a records clerk. Answer with one JSON object that follows the schema exactly. "
          "Example: {\"name\": \"Ada\", \"age\": 36}. Another example: {\"name\": \"Linus\", \"age\": 54}. "
          "Never add fields, never explain.")
USERS = ["A chef from Lyon.", "A chess player aged nine."]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smollm2_f32(smollm2_dir):
    from constrained_spec.models import load_model
    return load_model(smollm2_dir, dtype=torch.float32, device="cpu")


def _prompts(engine):
    return [engine.chat_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}])
            for u in USERS]


def _run(engine, prompts, grammar=None):
    sp = SamplingParams(max_tokens=14, temperature=0)
    return engine.generate(prompts, sp, grammar)


def _accounted(engine):
    """Every slot is free or the tree's, nobody else's, once all requests are done."""
    pool, cache = engine.runner.pool, engine.runner.prefix_cache
    tree = cache.tree if cache is not None else None
    owned = 0 if tree is None else tree.size
    assert pool.num_unused + owned == pool.capacity
    if tree is not None:
        assert tree.evictable_size == tree.size  # no reference left behind
        slots = tree.all_slots()
        assert len(set(slots.tolist())) == len(slots) and 0 not in set(slots.tolist())
    assert engine.runner.table.num_free_rows == engine.config.max_running_requests


def test_outputs_match_without_cache_with_grammar_speculation_and_turns(smollm2_f32):
    grammar = GrammarSpec.json_schema(SCHEMA)
    plain = Engine(device="cpu", loaded=smollm2_f32, max_running_requests=8, disable_prefix_cache=True,
                   grammar_backend=PINNED)
    try:
        prompts = _prompts(plain)
        ref_free = [o.token_ids for o in _run(plain, prompts)]
        ref_json = [o.token_ids for o in _run(plain, prompts, grammar)]
        assert all(o.cached_tokens == 0 for o in _run(plain, prompts[:1]))
    finally:
        plain.shutdown()
    # the cache alone is compared with a cache-less engine in the eviction test; here it runs with
    # n-gram speculation (whose greedy output equals plain decoding's, test_speculative.py)
    eng = Engine(device="cpu", loaded=smollm2_f32, max_running_requests=8, speculative_algorithm="ngram",
                 speculative_policy="always", speculative_min_accept=0.0, grammar_backend=PINNED)
    try:
        first = _run(eng, prompts[:1])  # cold: the system prompt enters the cache
        assert first[0].cached_tokens == 0 and first[0].token_ids == ref_free[0]
        outs = _run(eng, prompts)  # every prompt shares the cached system prompt
        assert [o.token_ids for o in outs] == ref_free
        assert all(o.cached_tokens > len(SYSTEM) // 8 for o in outs)
        assert outs[0].cached_tokens == len(prompts[0]) - 1  # the whole prompt but the last token
        outs = _run(eng, prompts, grammar)
        assert [o.token_ids for o in outs] == ref_json  # (cut at max_tokens: not always whole JSON)
        # a second turn: the first turn's prompt and answer come from the cache
        turn2 = [p + o.token_ids + eng.tokenizer.encode("\nAnother one.", add_special_tokens=False)
                 for p, o in zip(prompts, outs)]
        again = _run(eng, turn2, grammar)
        assert all(o.cached_tokens >= len(p) + len(a.token_ids) - 1 for o, p, a in zip(again, prompts, outs))
        stats = eng.runner.prefix_cache.snapshot()
        assert stats["hit_tokens"] > 0 and 0 < stats["hit_rate"] < 1
        _accounted(eng)
    finally:
        eng.shutdown()


def test_small_pool_evicts_and_accounts_for_every_slot(tiny_llama_dir):
    """64 requests with distinct 40-token prefixes (each seen twice) through a 600-slot pool: the
    tree fills the pool, eviction makes room, nothing fails, no slot leaks; the answers equal a
    cache-less engine's."""
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(100, 40000, size=40).tolist() for _ in range(32)]
    prompts = [p + [7, 8, 9 + k] for k in range(2) for p in prefixes]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_slots=600, max_running_requests=8)
    ref = Engine(**kw, disable_prefix_cache=True)
    try:
        expected = [o.token_ids for o in ref.generate(prompts, sp)]
    finally:
        ref.shutdown()
    eng = Engine(**kw)
    try:
        outs = eng.generate(prompts, sp)
        assert all(o.finish_reason is FinishReason.LENGTH and o.completion_tokens == 12 for o in outs)
        assert [o.token_ids for o in outs] == expected
        tree = eng.runner.prefix_cache.tree
        assert tree.evicted_tokens > 0  # 64 x 55 tokens went through a 600-slot pool
        assert tree.size > 0
        assert sum(o.cached_tokens for o in outs) > 0
        _accounted(eng)
    finally:
        eng.shutdown()


def test_abort_and_retraction_release_their_references(tiny_llama_dir):
    """Requests aborted mid-decode, and requests retracted by a pool too small for all of them,
    leave no reference on the tree."""
    import threading
    import time
    eng = Engine(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_slots=300, max_running_requests=16)
    try:
        shared = list(range(1000, 1060))
        started = threading.Event()
        reqs = [eng.add_request(shared + [i], SamplingParams(max_tokens=200, ignore_eos=True),
                                on_output=lambda out: started.set()) for i in range(6)]
        assert started.wait(30)
        time.sleep(0.2)
        for r in reqs:
            eng.abort(r.request_id)
        outs = eng.generate([shared + [50 + i] for i in range(12)],
                            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        assert all(o.completion_tokens == 30 for o in outs)
        deadline = time.time() + 10
        while eng.scheduler.has_work() and time.time() < deadline:
            time.sleep(0.01)
        assert eng.scheduler.num_retractions > 0
        _accounted(eng)
    finally:
        eng.shutdown()


def test_scheduler_defers_siblings_and_prefers_cached_prefixes(tiny_llama_dir):
    """The scheduler alone over a real runner: a request identical to one admitted in the same step
    (an n > 1 sibling) waits a step and then finds the whole prompt cached; a request with a cached
    prefix is admitted before an earlier one without."""
    from constrained_spec.engine.config import EngineConfig
    from constrained_spec.engine.model_runner import ModelRunner
    from constrained_spec.engine.request import Request
    from constrained_spec.engine.scheduler import Scheduler
    from constrained_spec.models import load_model
    loaded = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu")
    config = EngineConfig(device="cpu", kv_cache_slots=2000, max_running_requests=8, max_prefill_tokens=512)
    runner = ModelRunner(loaded, config, torch.device("cpu"), torch.float32)
    sched = Scheduler(runner, config)
    prompt = list(range(1000, 1300))
    new = lambda ids: Request(list(ids), SamplingParams(max_tokens=4), lambda out: None)
    a, sibling, other = new(prompt), new(prompt), new(range(2000, 2040))
    for r in (a, sibling, other):
        sched.add(r)
    batch = sched.schedule(can_retract=True)
    assert batch.requests == [a, other]  # the sibling waits for a's prompt
    runner.forward(batch)
    batch = sched.schedule(can_retract=True)  # caches a's prompt first
    assert batch.requests == [sibling] and batch.num_new_tokens == [1]
    assert sibling.cached_tokens == len(prompt) - 1
    runner.forward(batch)
    # 450 + 203 tokens exceed the step's 512 without the cache: the cached prefix goes first
    late_plain, late_cached = new(range(3000, 3450)), new(prompt[:200] + [5, 6, 7])
    sched.add(late_plain)
    sched.add(late_cached)
    batch = sched.schedule(can_retract=True)
    assert batch.requests == [late_cached, late_plain] and batch.num_new_tokens == [3, 450]
    assert late_plain.skips == 1
    runner.forward(batch)
    # where every waiting request fits anyway, first come first served (no prompt is matched twice)
    early, cached = new(range(4000, 4010)), new(prompt[:250] + [9])
    sched.add(early)
    sched.add(cached)
    batch = sched.schedule(can_retract=True)
    assert batch.requests == [early, cached] and batch.num_new_tokens == [10, 1] and early.skips == 0


def test_a_short_cached_prefix_is_a_miss_unless_it_is_most_of_the_prompt(tiny_llama_dir):
    """Prompts that share only a chat template's first tokens with the cache are admitted as misses:
    nothing locked or split, the whole prompt computed, no cached tokens reported (their duplicate
    positions go back to the pool at release). A match of MIN_MATCH tokens is used, and so is a short
    prompt found whole."""
    from constrained_spec.engine.config import EngineConfig
    from constrained_spec.engine.model_runner import ModelRunner
    from constrained_spec.engine.prefix_cache import MIN_MATCH
    from constrained_spec.engine.request import Request
    from constrained_spec.engine.scheduler import Scheduler
    from constrained_spec.models import load_model
    loaded = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu")
    config = EngineConfig(device="cpu", kv_cache_slots=4000, max_running_requests=8, max_prefill_tokens=1024)
    runner = ModelRunner(loaded, config, torch.device("cpu"), torch.float32)
    sched, tree = Scheduler(runner, config), runner.prefix_cache.tree
    new = lambda ids: Request(list(ids), SamplingParams(max_tokens=4), lambda out: None)

    def admit(req):
        sched.add(req)
        batch = sched.schedule(can_retract=True)
        assert batch.requests == [req]
        return batch

    def finish(req, batch):
        runner.forward(batch)
        req.num_cached = req.total_len
        sched.remove(req)

    head = list(range(1000, 1008))  # a chat template's first tokens
    short = [5, 6, 7, 8, 9, 10]
    for prompt in (head + list(range(2000, 2200)), short):
        req = new(prompt)
        finish(req, admit(req))
    nodes = tree.num_nodes()
    other = new(head + list(range(3000, 3200)))
    batch = admit(other)
    assert batch.num_new_tokens == [len(other.prompt_ids)] and other.cache_len == 0 and other.cached_tokens == 0
    assert tree.num_nodes() == nodes and tree.evictable_size == tree.size  # nothing split, nothing locked
    finish(other, batch)
    assert runner.pool.num_unused + tree.size == runner.pool.capacity  # its duplicate head's slots freed
    longer = new(head + list(range(2000, 2000 + MIN_MATCH - len(head))) + list(range(4000, 4100)))
    batch = admit(longer)
    assert batch.num_new_tokens == [len(longer.prompt_ids) - MIN_MATCH] and longer.cached_tokens == MIN_MATCH
    finish(longer, batch)
    again = new(short)
    assert admit(again).num_new_tokens == [1] and again.cached_tokens == len(short) - 1


def test_repointed_rows_reach_the_device_before_the_next_launch(tiny_llama_dir):
    """Two prompts prefilled in one step share their first 40 tokens; a third request continuing
    the first's prompt is admitted: its admission caches both (`PrefixCache.admit`), the second's
    shared positions are duplicates, and its row is pointed at the tree's slots, its own freed. The
    device table has the new row before anything launches, whether the step extends (the third
    request fits: the row goes with its prefix in one upload, `ModelRunner.forward`) or decodes
    (the pool has no room left for it: the scheduler writes the row)."""
    from constrained_spec.attention import ForwardMode
    from constrained_spec.engine.config import EngineConfig
    from constrained_spec.engine.model_runner import ModelRunner
    from constrained_spec.engine.request import Request
    from constrained_spec.engine.scheduler import Scheduler
    from constrained_spec.models import load_model
    loaded = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu")
    new = lambda ids: Request(list(ids), SamplingParams(max_tokens=8), lambda out: None)
    shared = list(range(1000, 1040))
    for next_mode, pool_slots in ((ForwardMode.EXTEND, 4000), (ForwardMode.DECODE, 602)):
        config = EngineConfig(device="cpu", kv_cache_slots=pool_slots, max_running_requests=8,
                              max_prefill_tokens=1024)
        runner = ModelRunner(loaded, config, torch.device("cpu"), torch.float32)
        sched, table = Scheduler(runner, config), runner.table

        def mirrored(req) -> bool:
            n = int(table.lengths[req.row])
            return np.array_equal(table.device_table[req.row, :n].numpy(), table.host[req.row, :n])

        first, second = new(shared + list(range(2000, 2260))), new(shared + list(range(3000, 3260)))
        sched.add(first)
        sched.add(second)
        batch = sched.schedule(can_retract=True)
        assert batch.requests == [first, second]
        runner.forward(batch)  # both prompts computed; neither is in the tree yet
        assert runner.prefix_cache.tree.size == 0
        own = table.host[second.row, :40].copy()
        third = new(first.prompt_ids + list(range(4000, 4010)))
        sched.add(third)
        batch = sched.schedule(can_retract=True)
        assert batch.mode is next_mode
        tree_slots = runner.prefix_cache.tree.match(shared)[0]
        assert np.array_equal(table.host[second.row, :40], tree_slots)
        assert np.array_equal(table.host[first.row, :40], tree_slots) and not np.array_equal(own, tree_slots)
        if next_mode is ForwardMode.EXTEND:
            assert batch.requests == [third] and third.cache_len == len(first.prompt_ids)
            runner.forward(batch)
        else:
            assert third not in batch.requests
        assert mirrored(second) and mirrored(first)


def test_a_running_prompt_is_cached_for_a_request_that_continues_it(tiny_llama_dir):
    """A computed prompt waits outside the tree until an admission goes on with its next
    RUNNING_SHARE tokens past where both matched; one that shares fewer (prompts that start with
    the same digits) leaves it there, to go in once, with its answer, when its request ends."""
    from constrained_spec.engine.config import EngineConfig
    from constrained_spec.engine.model_runner import ModelRunner
    from constrained_spec.engine.prefix_cache import RUNNING_SHARE
    from constrained_spec.engine.request import Request
    from constrained_spec.engine.scheduler import Scheduler
    from constrained_spec.models import load_model
    loaded = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu")
    config = EngineConfig(device="cpu", kv_cache_slots=4000, max_running_requests=8, max_prefill_tokens=1024)
    runner = ModelRunner(loaded, config, torch.device("cpu"), torch.float32)
    sched, tree = Scheduler(runner, config), runner.prefix_cache.tree
    new = lambda ids: Request(list(ids), SamplingParams(max_tokens=4), lambda out: None)
    first = new(range(1000, 1300))
    sched.add(first)
    runner.forward(sched.schedule(can_retract=True))
    near = new(list(range(1000, 1000 + RUNNING_SHARE - 1)) + [7, 8, 9, 10, 11])
    sched.add(near)
    batch = sched.schedule(can_retract=True)
    assert batch.requests == [near] and near.cache_len == 0 and tree.size == 0
    runner.forward(batch)
    far = new(list(range(1000, 1000 + RUNNING_SHARE)) + [7, 8, 9])
    sched.add(far)
    batch = sched.schedule(can_retract=True)
    assert batch.requests == [far] and far.cache_len == RUNNING_SHARE and tree.size == len(first.prompt_ids)
    runner.forward(batch)
    for req in (first, near, far):
        req.num_cached = req.total_len
        sched.remove(req)
    assert tree.size == len(first.prompt_ids) + len(near.prompt_ids) - (RUNNING_SHARE - 1) + 3
    assert runner.pool.num_unused + tree.size == runner.pool.capacity


def test_short_new_prompt_parts_are_cached_when_the_request_ends(tiny_llama_dir):
    """A prompt whose uncached part is shorter than RUNNING_SHARE enters the tree at release,
    and is never filed for admissions to cache while it runs (a longer one: the tests above and
    below)."""
    from constrained_spec.engine.config import EngineConfig
    from constrained_spec.engine.model_runner import ModelRunner
    from constrained_spec.engine.prefix_cache import RUNNING_SHARE
    from constrained_spec.engine.request import Request
    from constrained_spec.engine.scheduler import Scheduler
    from constrained_spec.models import load_model
    loaded = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu")
    config = EngineConfig(device="cpu", kv_cache_slots=2000, max_running_requests=8, max_prefill_tokens=512)
    runner = ModelRunner(loaded, config, torch.device("cpu"), torch.float32)
    sched = Scheduler(runner, config)
    req = Request(list(range(100, 100 + RUNNING_SHARE - 1)), SamplingParams(max_tokens=4), lambda out: None)
    sched.add(req)
    runner.forward(sched.schedule(can_retract=True))
    sched.schedule(can_retract=True)  # the step that would insert a prefilled prompt
    tree = runner.prefix_cache.tree
    assert tree.size == 0
    req.num_cached = len(req.prompt_ids)
    sched.remove(req)
    assert tree.size == len(req.prompt_ids)
    assert runner.pool.num_unused + tree.size == runner.pool.capacity



def _scheduler(tiny_llama_dir, slots=20000):
    from constrained_spec.engine.config import EngineConfig
    from constrained_spec.engine.model_runner import ModelRunner
    from constrained_spec.engine.scheduler import Scheduler
    from constrained_spec.models import load_model
    loaded = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu")
    config = EngineConfig(device="cpu", kv_cache_slots=slots, max_running_requests=8, max_prefill_tokens=1024)
    runner = ModelRunner(loaded, config, torch.device("cpu"), torch.float32)
    return Scheduler(runner, config), runner


def _request(ids):
    from constrained_spec.engine.request import Request
    return Request(list(ids), SamplingParams(max_tokens=4), lambda out: None)


def _start_alone(sched, runner, req):
    """Admits the request and runs its prefill as the step's only request; its prompt is computed."""
    sched.add(req)
    batch = sched.schedule(can_retract=True)
    assert batch.requests == [req]
    runner.forward(batch)
    req.num_cached = req.total_len


def test_while_the_cache_misses_only_a_sample_of_finished_requests_is_cached(tiny_llama_dir):
    """Distinct prompts: once MISS_WINDOW first admissions in a row found nothing cached, a finished
    request's context goes into the tree only if it is the SAMPLE_EVERY-th (its slots otherwise go
    straight to the pool); the metrics say so, and every slot is accounted for. A hit files
    everything again: a request admitted while the cache missed and finishing after the hit is
    cached, and so is the next one. A retraction's context is always cached (its re-prefill
    matches it)."""
    from constrained_spec.engine.prefix_cache import MISS_WINDOW, SAMPLE_EVERY
    sched, runner = _scheduler(tiny_llama_dir)
    cache, tree, pool = runner.prefix_cache, runner.prefix_cache.tree, runner.pool
    new = _request
    start = lambda req: _start_alone(sched, runner, req)

    def finish(req, reason=FinishReason.LENGTH):
        req.finish_reason = reason
        sched.remove(req)

    def distinct(i):  # 40 tokens, no two sharing their first
        return new(range(1000 + 50 * i, 1040 + 50 * i))

    filed = []
    for i in range(MISS_WINDOW + 4 * SAMPLE_EVERY):
        req = distinct(i)
        start(req)
        size = tree.size
        finish(req)
        if tree.size > size:
            filed.append(i)
    # the first MISS_WINDOW - 1 were admitted while filing was on; then every SAMPLE_EVERY-th
    assert filed == list(range(MISS_WINDOW - 1)) + list(range(MISS_WINDOW - 2 + SAMPLE_EVERY,
                                                              MISS_WINDOW + 4 * SAMPLE_EVERY, SAMPLE_EVERY))
    assert tree.size == 40 * len(filed) and not cache.filing
    snap = cache.snapshot()
    assert snap["unfiled_requests"] == MISS_WINDOW + 4 * SAMPLE_EVERY - len(filed) and snap["filing"] is False
    assert snap["tree_tokens"] == tree.size and snap["hit_tokens"] == 0
    assert pool.num_unused + tree.size == pool.capacity

    # a retraction's context goes in whatever the mode
    retracted = distinct(500)
    start(retracted)
    size = tree.size
    sched.remove(retracted)  # finish_reason None: what `Scheduler._retract` releases
    assert tree.size == size + 40
    # an abort is a finished request: not filed (the counter is not at the sample)
    waiting = distinct(501)
    start(waiting)
    assert waiting.file_context is False
    size = tree.size
    finish(waiting, FinishReason.ABORT)
    assert tree.size == size and cache.unfiled_requests == snap["unfiled_requests"] + 1

    # a hit: a prompt that goes on from a sampled one
    late = distinct(502)
    start(late)  # admitted while the cache misses
    sampled = distinct(filed[-1])
    hit = new(sampled.prompt_ids + [7, 8, 9])
    start(hit)
    assert hit.cached_tokens == 40 and cache.filing
    for req in (late, hit, distinct(503)):
        if req.row < 0:
            start(req)
        size = tree.size
        finish(req)
        assert tree.size > size
    assert pool.num_unused + tree.size == pool.capacity
    assert tree.evictable_size == tree.size


def test_a_turn_that_starts_like_an_unfiled_context_turns_filing_back_on(tiny_llama_dir):
    """While the cache misses, a conversation's first turn is not filed (outside the sample); its
    next turn misses too, but starts like it, so filing resumes: that turn is filed and the turn
    after it finds it cached. A prompt sharing fewer than MIN_MATCH first tokens does not count."""
    from constrained_spec.engine.prefix_cache import MIN_MATCH, MISS_WINDOW, SAMPLE_EVERY
    sched, runner = _scheduler(tiny_llama_dir)
    cache, tree, pool = runner.prefix_cache, runner.prefix_cache.tree, runner.pool
    new = _request

    def serve(req):
        _start_alone(sched, runner, req)
        size = tree.size
        req.finish_reason = FinishReason.LENGTH
        sched.remove(req)
        return tree.size > size  # filed

    for i in range(MISS_WINDOW + 1):  # past the window, and the next request is not the sample's
        serve(new(range(1000 + 50 * i, 1040 + 50 * i)))
    assert not cache.filing and cache._passed % SAMPLE_EVERY
    near = list(range(20000, 20000 + MIN_MATCH - 1))
    assert not serve(new(near + [1, 2, 3]))  # turn 1 of an unrelated prompt, unfiled
    assert not serve(new(near + [4, 5, 6])) and not cache.filing  # 31 tokens in common: no recurrence
    turn1 = new(range(30000, 30040))
    assert not serve(turn1) and not cache.filing
    turn2 = new(turn1.prompt_ids + [7, 8, 9])
    assert serve(turn2) and turn2.cached_tokens == 0 and cache.filing
    turn3 = new(turn2.prompt_ids + [10, 11])
    assert serve(turn3) and turn3.cached_tokens == len(turn2.prompt_ids)
    assert pool.num_unused + tree.size == pool.capacity


def test_a_shared_system_prompt_is_cached_within_a_sample_while_the_cache_misses(tiny_llama_dir):
    """Through the engine: after MISS_WINDOW distinct requests, requests sharing a system prompt one
    after another (never overlapping, so the running-prompt sharing cannot help) find it cached from
    within SAMPLE_EVERY requests on, and the turns of a conversation then find their previous
    answers cached; the answers equal a cache-less engine's and every slot is accounted for."""
    from constrained_spec.engine.prefix_cache import MISS_WINDOW, SAMPLE_EVERY
    rng = np.random.default_rng(1)
    distinct = [rng.integers(100, 40000, size=40).tolist() for _ in range(MISS_WINDOW + 4)]
    system = rng.integers(100, 40000, size=60).tolist()
    shared = [system + [7, 8, 9 + k] for k in range(2 * SAMPLE_EVERY)]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kw = dict(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_slots=20000, max_running_requests=8)

    def serve(engine):
        engine.generate(distinct, sp)
        outs = [engine.generate([p], sp)[0] for p in shared]
        prompt = shared[0]
        for _ in range(3):  # a conversation: each turn continues the previous answer
            out = engine.generate([prompt], sp)[0]
            outs.append(out)
            prompt = prompt + out.token_ids + [11, 12]
        return outs

    ref = Engine(**kw, disable_prefix_cache=True)
    try:
        expected = [o.token_ids for o in serve(ref)]
    finally:
        ref.shutdown()
    eng = Engine(**kw)
    try:
        outs = serve(eng)
        assert [o.token_ids for o in outs] == expected
        cache = eng.runner.prefix_cache
        first_hit = next(i for i, o in enumerate(outs) if o.cached_tokens)
        assert first_hit <= SAMPLE_EVERY
        assert all(o.cached_tokens >= len(system) for o in outs[first_hit:])
        turns = outs[len(shared):]
        assert turns[1].cached_tokens >= len(shared[0]) + len(turns[0].token_ids) - 1
        assert turns[2].cached_tokens > turns[1].cached_tokens
        assert cache.filing and cache.unfiled_requests > 0
        _accounted(eng)
    finally:
        eng.shutdown()

def test_request_ids_array_is_all_ids():
    from constrained_spec.engine.request import Request

    req = Request(prompt_ids=[5, 6, 7], params=SamplingParams(), on_output=None)
    assert req.ids_array(2).tolist() == [5, 6] and req.ids_array(3).tolist() == [5, 6, 7]
    req.output_ids.extend([8, 9])
    assert req.ids_array(5).tolist() == req.all_ids and req.ids_array(4).tolist() == [5, 6, 7, 8]
    for start in range(6):
        for stop in range(start, 7):
            assert req.ids_range(start, stop) == req.all_ids[start:stop], (start, stop)
    assert req.ids_array(3).dtype == np.int64


def test_prompts_in_step_find_exactly_the_requests_sharing_uncached_tokens():
    """The scheduler's index of the prompts a step computes: a request is deferred only when its
    first cached + IN_STEP_SHARE tokens equal such a prompt's."""
    from constrained_spec.engine.request import Request
    from constrained_spec.engine.scheduler import IN_STEP_SHARE, _PromptsInStep

    def req(ids, cached):
        r = Request(list(ids), SamplingParams(max_tokens=4), lambda out: None)
        r.cache_len = cached
        return r

    base = list(range(10, 10 + 20 + IN_STEP_SHARE + 30))
    step = _PromptsInStep()
    assert not step.shares(req(base, 20))
    step.add(req(base, 20))
    assert step.shares(req(base[:20 + IN_STEP_SHARE], 20))  # exactly IN_STEP_SHARE shared past the cache
    assert not step.shares(req(base[:20 + IN_STEP_SHARE - 1], 20))  # too short to share that many
    assert not step.shares(req(base[:20 + IN_STEP_SHARE - 1] + [7] + base[20 + IN_STEP_SHARE:], 20))
    assert not step.shares(req([1] + base[1:], 20))  # same window, another cached prefix
    step.add(req(range(5000, 5000 + IN_STEP_SHARE - 1), 0))  # too little uncached to be indexed
    assert not step.shares(req(range(5000, 5000 + IN_STEP_SHARE - 1), 0))


@pytest.mark.parametrize("workload,pool,cached", [("distinct", 600, (0.0, 0.2)), ("multi-turn", 3000, (0.5, 1.0))])
def test_host_cost_replay_runs_both_arms(tiny_llama_dir, capsys, monkeypatch, workload, pool, cached):
    """benchmarks/prefix_cache_host.py at toy sizes: both arms finish their requests, the cache-on
    arm's timed calls include the releases into the tree, and the cache serves what the workload
    shares (distinct prompts their first tokens, a conversation's turns the turns before)."""
    import re
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import prefix_cache_host
    monkeypatch.setattr(sys, "argv", ["prefix_cache_host.py", "--model", tiny_llama_dir, "--requests", "40",
                                      "--rounds", "1", "--clients", "8", "--prompt", "48", "--shared", "4",
                                      "--max-tokens", "8", "--pool", str(pool), "--workload", workload])
    prefix_cache_host.main()
    out = capsys.readouterr().out
    assert "cache on" in out and "| PrefixCache.release |" in out and "| PrefixCache.admit |" in out
    share = float(re.search(rf"{workload}, ([0-9.]+) of prompt tokens cached", out).group(1))
    assert cached[0] <= share <= cached[1], out


def test_loop_cost_benchmark_runs_both_arms(tiny_llama_dir, capsys, monkeypatch):
    """benchmarks/prefix_cache_loop.py at toy sizes: both engines serve their rounds with the
    model's work stubbed out, and the stubs are gone afterwards."""
    import sys
    from pathlib import Path
    from constrained_spec.engine import model_runner
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import prefix_cache_loop
    saved = model_runner.ModelRunner.run_model, model_runner.sample
    monkeypatch.setattr(sys, "argv", ["prefix_cache_loop.py", "--model", tiny_llama_dir, "--requests", "12",
                                      "--rounds", "1", "--clients", "4", "--max-tokens", "6", "--pool", "2000"])
    prefix_cache_loop.main()
    out = capsys.readouterr().out
    assert "round 0: cache on" in out and "engine thread CPU us a step" in out, out
    assert (model_runner.ModelRunner.run_model, model_runner.sample) == saved

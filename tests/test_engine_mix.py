"""Everything at once against plain decoding: an engine with the prefix cache, speculation at every
step and a KV pool small enough (250 slots) that it evicts cached prefixes and
retracts running requests, fed rounds of concurrent requests whose prompts share system prompts,
with and without JSON schemas, greedy or seeded sampling, some aborted at random moments, must
answer token for token as a plain engine (no cache, no speculation, a large pool) does, and leave
no slot, reference or row behind. The pieces have tests of their own; this one is for how they meet."""
from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest

from constrained_spec import SamplingParams
from constrained_spec.engine import Engine
from constrained_spec.grammar import GrammarSpec
from grammar_pin import PINNED

CASES = [json.loads(line) for line in
         (Path(__file__).resolve().parent.parent / "schemas/handwritten/handwritten.jsonl").read_text().splitlines()
         if line.strip()]
SYSTEMS = ["You are a helpful assistant. " * k for k in range(1, 6)]


def _rounds(engine: Engine, rng: random.Random, rounds: int) -> list[list[tuple]]:
    out = []
    for _ in range(rounds):
        jobs = []
        for _ in range(rng.randint(1, 12)):
            case = rng.choice(CASES)
            messages = [{"role": "system", "content": rng.choice(SYSTEMS)},
                        {"role": "user", "content": case["prompt"] + rng.choice(["", " Be brief.", " Answer in JSON."])}]
            grammar = GrammarSpec.json_schema(case["schema"]) if rng.random() < 0.7 else None
            sampled = rng.random() < 0.3  # seeded: a speculative engine draws what plain decoding draws
            params = SamplingParams(max_tokens=rng.choice([8, 32, 64, 128]), temperature=0.8 if sampled else 0,
                                    seed=rng.randint(0, 1000))
            abort_after = rng.uniform(0, 0.2) if rng.random() < 0.2 else None  # the mixed engine's copy only
            jobs.append((engine.chat_prompt(messages), params, grammar, abort_after))
        out.append(jobs)
    return out


def _answers(engine: Engine, jobs: list[tuple], aborts: bool = False) -> list[tuple]:
    """The jobs sent at once, each from its own thread (so they share the engine's batches); with
    `aborts`, the jobs marked so are aborted after their delay instead (their answer: None)."""
    outs: list = [None] * len(jobs)

    def one(k: int) -> None:
        prompt, params, grammar, abort_after = jobs[k]
        if aborts and abort_after is not None:
            ended = threading.Event()
            req = engine.add_request(prompt, params, grammar, lambda out: out.finished and ended.set())
            time.sleep(abort_after)
            engine.abort(req.request_id)
            assert ended.wait(60)
            return
        o = engine.generate([prompt], params, grammar)[0]
        outs[k] = (o.token_ids, o.finish_reason, o.error)
    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return outs


DRAFTERS = {"ngram": dict(speculative_algorithm="ngram"),
            "eagle tree": dict(speculative_algorithm="eagle"),
            "eagle fused chain": dict(speculative_algorithm="eagle", eagle_topk=1, eagle_depth=7)}


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_cache_speculation_and_a_small_pool_answer_as_plain_decoding(drafter, tiny_llama_dir, tiny_head_dir):
    common = dict(model=tiny_llama_dir, device="cpu", dtype="float32", max_running_requests=8,
                  grammar_backend=PINNED)  # one backend: auto hands grammars over mid-run (grammar_pin.py)
    head = {"eagle_head": tiny_head_dir} if drafter.startswith("eagle") else {}
    plain = Engine(**common, kv_cache_slots=1 << 15, disable_prefix_cache=True)
    mixed = Engine(**common, kv_cache_slots=250, speculative_policy="always", speculative_min_accept=0.0,
                   **DRAFTERS[drafter], **head)
    try:
        for r, jobs in enumerate(_rounds(plain, random.Random(4), 12 if drafter == "ngram" else 8)):
            want = [a if job[3] is None else None for a, job in zip(_answers(plain, jobs), jobs)]
            assert _answers(mixed, jobs, aborts=True) == want, f"round {r}"
        # every part was exercised
        assert mixed.spec.stats.steps > 100 and mixed.scheduler.num_retractions > 0
        assert (mixed.spec.fused_steps > 0) == (drafter == "eagle fused chain")
        snap = mixed.runner.prefix_cache.snapshot()
        assert snap["hit_tokens"] > 0 and snap["evicted_tokens"] > 0
        # and nothing leaked: every slot is unused or the tree's, no reference or row left behind
        pool, tree = mixed.runner.pool, mixed.runner.prefix_cache.tree
        assert pool.num_unused + tree.size == pool.capacity and tree.evictable_size == tree.size
        assert mixed.runner.table.num_free_rows == mixed.config.max_running_requests
    finally:
        plain.shutdown()
        mixed.shutdown()

"""Speculative decoding through the engine on the real SmolLM2 (CPU): greedy output with speculation
equals output without it, token for token, with and without a JSON schema, chains and trees; the
KV pool is full again afterwards. An oracle drafter whose right answer is always a second sibling
makes every step move accepted K/V into place (compaction) and exercises grammar pruning."""
from __future__ import annotations

import json
import threading

import pytest

from constrained_spec import SamplingParams
from constrained_spec.engine import Engine, FinishReason
from constrained_spec.grammar import GrammarSpec
from constrained_spec.speculative.drafter import DraftBatch, Drafter
from grammar_pin import PINNED
from sizes import size

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
DOC = ("The Aurora-7 station sits 3,200 metres above sea level. It houses 14 researchers in winter and 31 in "
       "summer, and runs on a 420 kW solar array. Supplies arrive by helicopter every 12 days.")
QUESTIONS = [f"Document: {DOC}\nRepeat the document word for word.", "Give a JSON profile of a chef.",
             f"Document: {DOC}\nQuote the sentence about supplies.", "List three prime numbers."]
MAX_TOKENS = 40
# the acceptance set: 32 prompts (16 at the quick size), each question eight (four) times with a
# different tag, so the trie, shared across requests, drafts from the other requests' outputs as well
# as from the prompt
QUESTIONS_32 = [f"{q} (request {i})" for i in range(size(4, 8)) for q in QUESTIONS]


@pytest.fixture(scope="module")
def engines(smollm2_dir):
    made = {}

    def get(name, **kw):
        if name not in made:
            # 8,192 KV slots hold every test's requests; the CPU default (1 GiB a pool, zeroed) made
            # this module's engines ~10 GB, which beside another test file outgrew a 23 GiB machine
            made[name] = Engine(model=smollm2_dir, device="cpu", max_running_requests=8,
                                **{"grammar_backend": PINNED, "kv_cache_slots": 8192, **kw})
        return made[name]
    yield get
    for e in made.values():
        e.shutdown()


def spec_engine(engines, branches):
    return engines(f"spec{branches}", speculative_algorithm="ngram", speculative_num_draft_tokens=8,
                   ngram_branches=branches, speculative_min_accept=0.0, speculative_policy="always")


def prompts(engine, questions=QUESTIONS):
    return [engine.chat_prompt([{"role": "user", "content": q}]) for q in questions]


def greedy(engine, ps, grammar=None, n=MAX_TOKENS):
    return [o.token_ids for o in engine.generate(ps, SamplingParams(max_tokens=n, temperature=0), grammar)]


def assert_pool_full(engine):
    pool = engine.runner.pool
    assert pool.num_free == pool.capacity
    assert engine.runner.table.num_free_rows == engine.config.max_running_requests


@pytest.fixture(scope="module")
def reference(engines):
    plain = engines("plain")
    ps = prompts(plain)
    return ps, {None: greedy(plain, ps), "json": greedy(plain, ps, GrammarSpec.json_schema(SCHEMA))}


@pytest.fixture(scope="module")
def reference_32(engines):
    plain = engines("plain")
    ps = prompts(plain, QUESTIONS_32)
    return ps, {None: greedy(plain, ps), "json": greedy(plain, ps, GrammarSpec.json_schema(SCHEMA))}


@pytest.mark.parametrize("branches", [3])  # chains (1 branch): the 4-prompt tests below, under both backends
def test_ngram_speculation_is_lossless(engines, reference_32, branches):
    ps, ref = reference_32
    spec = spec_engine(engines, branches)
    st = spec.spec.stats
    assert greedy(spec, ps) == ref[None]
    assert st.steps > 0 and st.accepted_tokens > 0  # the repeated document gets drafted
    assert greedy(spec, ps, GrammarSpec.json_schema(SCHEMA)) == ref["json"]
    assert [greedy(spec, [p])[0] for p in ps[:2]] == ref[None][:2]  # alone (batch 1) too
    assert_pool_full(spec)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("branches", [1, 3])
def test_speculation_is_lossless_under_each_backend(engines, reference, backend, branches):
    ps, _ = reference
    grammar = GrammarSpec.json_schema(SCHEMA).with_backend(backend)
    spec = spec_engine(engines, branches)
    accepted = spec.spec.stats.accepted_tokens
    assert greedy(spec, ps, grammar) == greedy(engines("plain"), ps, grammar)
    assert spec.spec.stats.accepted_tokens > accepted
    assert_pool_full(spec)


class OracleDrafter(Drafter):
    """Knows the greedy continuation: drafts root -> {wrong, right -> {wrong, right -> ...}}, so
    the accepted path always takes second siblings (indices 2, 4, 6, ...) and must be compacted."""

    def __init__(self, width, references: dict[tuple, list[int]], vocab: int):
        self.num_draft_tokens = width
        self.references, self.vocab = references, vocab
        self.streams: dict = {}

    def add_request(self, request_id, prompt_tokens):
        self.streams[request_id] = (tuple(prompt_tokens), [])

    def observe(self, request_id, accepted_tokens):
        self.streams[request_id][1].extend(accepted_tokens)

    def propose(self, batch: DraftBatch):
        from constrained_spec.speculative.tree import DraftTrees
        trees = []
        for rid in batch.request_ids:
            prompt, out = self.streams[rid]
            ref = self.references.get(prompt, [])
            tokens, nxt, sib = [out[-1]], [-1], [-1]
            parent = 0
            for tok in ref[len(out):len(out) + (self.num_draft_tokens - 1) // 2]:
                wrong, right = len(tokens), len(tokens) + 1
                tokens += [(tok + 1) % self.vocab, tok]
                nxt += [-1, -1]
                sib += [right, -1]
                nxt[parent] = wrong
                parent = right
            trees.append((tokens, nxt, sib))
        return DraftTrees.from_lists(trees, width=self.num_draft_tokens)


@pytest.mark.parametrize("schema", [None, "json"])
def test_second_sibling_paths_are_compacted(engines, reference, schema):
    ps, ref = reference
    spec = spec_engine(engines, 3)
    grammar = GrammarSpec.json_schema(SCHEMA) if schema else None
    original = spec.spec.drafter
    spec.spec.drafter = OracleDrafter(8, {tuple(p): r for p, r in zip(ps, ref[schema])}, spec.runner.vocab_size)
    try:
        before = (spec.spec.stats.verified_requests, spec.spec.stats.accepted_tokens)
        assert greedy(spec, ps, grammar) == ref[schema]
        steps = spec.spec.stats.verified_requests - before[0]
        accepted = spec.spec.stats.accepted_tokens - before[1]
        assert accepted / steps > 2.0  # nearly every step accepts the three right nodes
    finally:
        spec.spec.drafter = original
        spec.spec._observed.clear()
    assert_pool_full(spec)


def test_sampled_and_greedy_in_one_batch(engines, reference):
    """Rejection sampling for the sampled rows; the greedy rows of the same batch stay exact."""
    ps, ref = reference
    spec = spec_engine(engines, 3)
    grammar = GrammarSpec.json_schema(SCHEMA)
    sampled = SamplingParams(max_tokens=120, temperature=0.8, seed=3)
    exact = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    outs = [None] * 4

    def run(i):  # concurrent generate calls share the engine's batches
        outs[i] = spec.generate([ps[i]], sampled if i % 2 else exact, grammar)[0]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, o in enumerate(outs):
        if i % 2 == 0:
            assert o.token_ids == ref["json"][i]
        elif o.finish_reason is FinishReason.STOP:
            v = json.loads(o.text)
            assert set(v) == {"name", "age", "tags"}
    assert_pool_full(spec)


def test_logit_bias_decodes_plainly_in_a_speculative_engine(engines, reference):
    """Verification does not apply logit biases: a batch with a biased request decodes plainly (as
    with penalties), so the request comes out as the plain engine's; the next batch speculates."""
    ps, ref = reference
    spec, plain = spec_engine(engines, 3), engines("plain")
    banned = {t: -100.0 for t in ref[None][0][:3]}
    biased = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logit_bias=banned)
    want = plain.generate([ps[0]], biased)[0].token_ids
    assert not set(want) & set(banned)
    steps = spec.spec.stats.steps
    assert spec.generate([ps[0]], biased)[0].token_ids == want
    assert spec.spec.stats.steps == steps
    assert greedy(spec, ps[1:2]) == ref[None][1:2]
    assert spec.spec.stats.steps > steps
    assert_pool_full(spec)


def test_a_predicted_output_is_drafted_and_changes_nothing_else(engines):
    """OpenAI's Predicted Outputs: an answer given as `prediction` is drafted from (far more tokens
    accepted a step than without it, as the trie has not seen the answer), and the output is the
    plain engine's whatever the prediction says."""
    spec, plain = spec_engine(engines, 1), engines("plain")
    p = prompts(plain, ["Write a four-line poem about a lighthouse keeper named Ida."])[0]
    want = plain.generate([p], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0].token_ids

    def accepted_per_step(prediction):
        st = spec.spec.stats
        steps, accepted = st.steps, st.accepted_tokens
        sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, prediction=prediction)
        assert spec.generate([p], sp)[0].token_ids == want
        return (st.accepted_tokens - accepted) / max(1, st.steps - steps)
    spec.spec.reset_drafter()  # a fresh trie: neither run drafts from the other's output
    without = accepted_per_step(None)
    spec.spec.reset_drafter()
    with_it = accepted_per_step(want)
    assert with_it > max(2 * without, 4.0)
    assert accepted_per_step(list(reversed(want))) >= 0  # a wrong prediction: slower, never wrong
    with pytest.raises(ValueError, match="prediction"):
        SamplingParams(prediction=[1, -2])
    assert_pool_full(spec)


def test_falls_back_when_the_pool_cannot_hold_the_trees(smollm2_dir, engines):
    """Near the end the pool has a slot per request but not a tree per request: plain steps follow
    speculative ones (reading the bonus token the verify step left in `last_token`). In float32:
    the pool is sized for where its drafts run out (bfloat16 counts differently). The four requests
    share one prompt: the prefix cache holds it once."""
    plain = engines("plain-float32", dtype="float32")
    p = plain.chat_prompt([{"role": "user", "content": "Count from one to twenty in words."}])
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = plain.generate([p], sp)[0].token_ids
    eng = Engine(model=smollm2_dir, device="cpu", dtype="float32", max_running_requests=4, grammar_backend=PINNED,
                 kv_cache_slots=len(p) + 4 * 24 + 12,
                 speculative_algorithm="ngram", speculative_num_draft_tokens=8, speculative_min_accept=0.0,
                 speculative_policy="always")
    try:
        outs = eng.generate([p] * 4, sp)
        assert [o.token_ids for o in outs] == [expected] * 4
        assert eng.spec.stats.steps > 0 and eng.stats.decode_steps > eng.spec.stats.steps
        assert_pool_full(eng)
    finally:
        eng.shutdown()


def test_always_policy_pauses_while_drafts_fail(tiny_llama_dir):
    """Random weights: the n-gram drafts are (nearly) never accepted. With `always`, after 32
    request-steps of acceptance below speculative_min_accept the engine decodes plainly for 16
    steps, then speculates again; the output is unchanged."""
    from constrained_spec.speculative.worker import PAUSE_STEPS
    kw = dict(model=tiny_llama_dir, device="cpu", max_running_requests=4)
    sp = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    prompt = [5, 9, 5, 9, 5, 9, 5, 9]
    plain = Engine(**kw)
    eng = Engine(**kw, speculative_algorithm="ngram", speculative_policy="always", speculative_min_accept=0.3)
    try:
        expected = plain.generate([prompt], sp)[0].token_ids
        assert eng.generate([prompt], sp)[0].token_ids == expected
        st = eng.spec.stats
        assert st.accepted_tokens / st.verified_requests < 0.3
        plain_steps = eng.stats.decode_steps - st.steps
        assert plain_steps >= PAUSE_STEPS and st.steps >= 32
    finally:
        plain.shutdown()
        eng.shutdown()


def test_failing_speculative_steps_switch_speculation_off(tiny_llama_dir):
    """A drafter that raises fails the requests of its step, as any failed step does; after
    MAX_FAILED_STEPS of them the engine stops speculating, and requests are served plainly (no more
    failures), the count on /metrics."""
    from constrained_spec.server.metrics import spec_snapshot
    from constrained_spec.speculative.worker import MAX_FAILED_STEPS
    eng = Engine(model=tiny_llama_dir, device="cpu", speculative_algorithm="ngram", speculative_policy="always",
                 speculative_min_accept=0.0)
    try:
        def broken(reqs):
            raise RuntimeError("injected drafter failure")
        eng.spec._draft = broken
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        outs = [eng.generate([[5, 9, 5, 9]], sp)[0] for _ in range(MAX_FAILED_STEPS + 2)]
        assert [o.finish_reason for o in outs] == [FinishReason.ERROR] * MAX_FAILED_STEPS + [FinishReason.LENGTH] * 2
        assert all(len(o.token_ids) == 8 for o in outs[MAX_FAILED_STEPS:])
        assert spec_snapshot(eng.spec.stats)["failed_steps"] == MAX_FAILED_STEPS
    finally:
        eng.shutdown()


def test_server_with_speculation(engines):
    """The OpenAI server on a speculative engine: concurrent JSON-schema requests, streamed and not,
    come back valid and equal to the plain engine's greedy answers; /metrics shows the verify steps."""
    import concurrent.futures
    import httpx
    import jsonschema
    openai = pytest.importorskip("openai")
    from constrained_spec.server.app import ServerConfig, create_app
    from constrained_spec.server.runner import start_server_thread
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                               "active": {"type": "boolean"}},
              "required": ["name", "age", "active"], "additionalProperties": False}
    spec = spec_engine(engines, 1)
    plain = engines("plain")
    questions = ["Give a JSON profile of a chef.", "Give a JSON profile of a pilot.", "Describe a nurse as JSON.",
                 "Give a JSON profile of a farmer."]
    expected = [o.text for o in plain.generate([plain.chat_prompt([{"role": "user", "content": q}]) for q in questions],
                                               SamplingParams(max_tokens=96, temperature=0),
                                               GrammarSpec.json_schema(schema))]
    handle = start_server_thread(create_app(spec, ServerConfig(served_model_name="m")))
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0, timeout=120)
    steps_before = spec.spec.stats.steps
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": schema}}

    def ask(i):
        kw = dict(model="m", messages=[{"role": "user", "content": questions[i]}], max_tokens=96,
                  temperature=0, response_format=fmt)
        if i % 2:
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))
        return client.chat.completions.create(**kw).choices[0].message.content
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(ask, range(4)))
        assert texts == expected
        for text in texts:
            jsonschema.validate(json.loads(text), schema)
        assert spec.spec.stats.steps > steps_before
        metrics = httpx.get(handle.url + "/metrics").text
        assert "constrained_spec_spec_verify_steps_total" in metrics
    finally:
        client.close()
        handle.stop()
    assert_pool_full(spec)


def test_reset_drafter_forgets_what_the_policy_measured(tiny_llama_dir):
    """A fresh drafter comes with a fresh measured policy: the old measurements were of the old
    drafter's acceptance (a benchmark's warm-up must not decide its timed run)."""
    eng = Engine(model=tiny_llama_dir, device="cpu", max_running_requests=4, speculative_algorithm="ngram",
                 grammar_backend=PINNED)
    try:
        eng.generate([[5, 9, 5, 9, 5, 9]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        assert eng.spec.policy.arms  # both ways measured at batch 1
        old_drafter = eng.spec.drafter
        eng.spec.reset_drafter()
        assert eng.spec.drafter is not old_drafter and not eng.spec.policy.arms
    finally:
        eng.shutdown()


def test_jump_forward_with_speculation(engines):
    """--jump-forward on a speculative engine is off: speculative steps draft forced strings and the
    model verifies them in its own tokenization, and plain steps jumping forward wrote them in the
    tokenizer's, so a greedy answer hung on whether its batch speculated (QA 1130c: beside a
    logprobs request it did not). Greedy JSON comes out as without either."""
    plain = engines("plain")
    ps = prompts(plain)[1:2] + [plain.chat_prompt([{"role": "user", "content": "Give a JSON profile of a pilot."}])]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    expected = [o.text for o in plain.generate(ps, sp, GrammarSpec.json_schema(SCHEMA))]
    eng = engines("spec-jump-forward", speculative_algorithm="ngram", speculative_policy="always", jump_forward=True)
    outs = eng.generate(ps, sp, GrammarSpec.json_schema(SCHEMA))
    assert [o.error for o in outs] == [None, None]
    assert [o.text for o in outs] == expected
    assert eng.spec.stats.steps > 0 and not eng.config.jump_forward and eng.stats.forced_tokens == 0


def test_seeded_sampling_with_speculation_equals_plain_sampling(engines, reference):
    """Temperature > 0: speculative steps draw each node's token with the plain sampler's noise for
    that position, so a seeded request emits the same tokens with speculation as without it, run
    after run (the n-gram trie learns in between, which changes every draft), chains and trees."""
    ps, _ = reference
    plain = engines("plain")
    sp = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=11 + i) for i in range(len(ps))]
    expected = [o.token_ids for o in plain.generate(ps, sp)]
    for branches in (1, 3):
        spec = spec_engine(engines, branches)
        before = spec.spec.stats.steps
        for _ in range(size(1, 2)):
            assert [o.token_ids for o in spec.generate(ps, sp)] == expected
        assert spec.spec.stats.steps > before


def test_limits_inside_a_verified_path(engines, reference):
    """A speculative step's tokens go into a request as one update unless one of them may end it;
    then token by token. A max_tokens, stop token id or stop string that falls inside a step's
    accepted path ends the output exactly where plain decoding ends it."""
    plain, spec = engines("plain"), spec_engine(engines, 1)
    ps, ref = reference
    prompt, base = ps[0], ref[None][0]  # "repeat the document": long accepted paths
    tok = plain.tokenizer
    updates = list(spec.stream(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0)))
    assert [t for u in updates for t in u.new_token_ids] == base
    assert any(len(u.new_token_ids) > 1 for u in updates)  # whole verified paths in one update
    stop_id = next(t for i, t in enumerate(base) if i >= 15 and t not in base[:i])
    head, tail = tok.decode(base[:18]), tok.decode(base)[len(tok.decode(base[:18])):]
    stop_text = tail[:5]
    assert stop_text.strip() and stop_text not in head
    cases = [SamplingParams(max_tokens=n, temperature=0) for n in (7, 13, 17, 23)]
    cases += [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[stop_id]),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=[stop_text])]
    for sp in cases:
        want, got = plain.generate([prompt], sp)[0], spec.generate([prompt], sp)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), sp
    assert spec.spec.stats.accepted_tokens > 0
    assert_pool_full(spec)

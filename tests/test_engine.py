"""Engine behaviour on the real SmolLM2 (CPU): batching, seeds, stops, abort, pool exhaustion."""
from __future__ import annotations

import threading
import time

import pytest

from constrained_spec import SamplingParams
from constrained_spec.engine import Engine, FinishReason, RequestError
from constrained_spec.engine.sampler import seed_word
from server_fixtures import exact_dtype
from grammar_pin import PINNED

TOPICS = ["the sea", "a red fox", "bread", "winter in Oslo", "prime numbers", "a violin", "trains", "the moon"]


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    eng = Engine(model=smollm2_dir, device="cpu", max_running_requests=32, grammar_backend=PINNED)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def exact_engine(engine, smollm2_dir):
    """`engine` where its dtype keeps token-for-token comparisons exact, else a float32 one."""
    if exact_dtype() == "auto":
        yield engine
        return
    eng = Engine(model=smollm2_dir, device="cpu", dtype="float32", max_running_requests=32, grammar_backend=PINNED)
    yield eng
    eng.shutdown()


def chat(engine, text):
    return engine.chat_prompt([{"role": "user", "content": text}])


def prompts_mixed(engine):
    """8 prompts of clearly different lengths."""
    return [chat(engine, f"Tell me about {t}." + " Please be detailed and precise." * (i % 4)) for i, t in enumerate(TOPICS)]


def test_batch_invariance_greedy(exact_engine):
    engine = exact_engine
    prompts = prompts_mixed(engine)
    assert len({len(p) for p in prompts}) >= 4
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [engine.generate([p], sp)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in engine.generate(prompts, sp)]
    assert batched == alone


def test_seeds(engine):
    p = chat(engine, "Invent a name for a cat.")
    sp = lambda seed: SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)
    a = engine.generate([p], sp(1))[0]
    b = engine.generate([p, chat(engine, "hello"), p], sp(1))
    assert a.token_ids == b[0].token_ids == b[2].token_ids  # same seed, alone or batched
    assert a.text == b[0].text
    c = engine.generate([p], sp(2))[0]
    assert c.token_ids != a.token_ids
    # the noise hashes 32 bits: seeds that differed only above them (-1 and 2**63 - 1, 1 and
    # 2**32 + 1) drew the same tokens; the high word is mixed in, a seed under 2**32 unchanged
    assert seed_word(1) == 1 and seed_word(2**32 - 1) == 2**32 - 1
    high = engine.generate([p, p], [sp(2**32 + 1), sp(2**63 - 1)])
    low = engine.generate([p], sp(-1))[0]
    assert len({tuple(x) for x in (a.token_ids, high[0].token_ids, high[1].token_ids, low.token_ids)}) == 4


def test_sampling_filters_and_penalties_run(exact_engine):
    engine = exact_engine
    p = chat(engine, "List some fruits.")
    for sp in (SamplingParams(max_tokens=16, temperature=0.7, top_k=5, seed=3),
               SamplingParams(max_tokens=16, temperature=0.7, min_p=0.2, seed=3),
               SamplingParams(max_tokens=16, temperature=0, frequency_penalty=1.5, presence_penalty=1.0)):
        out = engine.generate([p], sp)[0]
        assert out.completion_tokens >= 1 and out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    # top_k=1 is greedy whatever the temperature
    g = engine.generate([p], SamplingParams(max_tokens=16, temperature=0))[0]
    k1 = engine.generate([p], SamplingParams(max_tokens=16, temperature=1.3, top_k=1, seed=9))[0]
    assert g.token_ids == k1.token_ids
    # a strong repetition penalty changes a greedy continuation that repeats itself
    rep = engine.generate([p], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))[0]
    pen = engine.generate([p], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, frequency_penalty=2.0))[0]
    assert len(set(pen.token_ids)) >= len(set(rep.token_ids))


def test_a_row_without_top_p_keeps_its_tail_beside_one_with_it():
    """Filters run for the whole batch once any row asks for one: a float32 cumsum passes 1.0 before
    the last tokens, and `cum_before < 1.0` cut ~1,800 of 49,152 tokens from a row without top-p
    (random logits), which then drew otherwise beside a top-p request than alone."""
    import torch
    from constrained_spec.engine.sampler import SamplingBatch, filter_probs
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(2, 49152, generator=gen) * 3, -1)
    sb = SamplingBatch(temperature=torch.ones(2), top_k=torch.full((2,), 49152), top_p=torch.tensor([1.0, 0.5]),
                       min_p=torch.zeros(2), seeds=torch.zeros(2, dtype=torch.long),
                       steps=torch.zeros(2, dtype=torch.long), needs_filter=True)
    kept = filter_probs(probs, sb)
    assert torch.equal(kept[0], probs[0])
    assert kept[1].count_nonzero() < probs[1].count_nonzero()


def test_logit_bias(exact_engine):
    """OpenAI's logit_bias, per request: -100 bans a token, +100 forces one, a batch neighbour without a
    bias decodes as alone, and a grammar's mask still wins over any bias."""
    from constrained_spec.grammar import GrammarSpec
    engine = exact_engine
    p, q = chat(engine, "List some fruits."), chat(engine, "Name a colour.")
    sp = lambda **kw: SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **kw)
    plain = engine.generate([p], sp())[0].token_ids
    banned = engine.generate([p], sp(logit_bias={plain[0]: -100, plain[1]: -100}))[0].token_ids
    assert plain[0] not in banned and plain[1] not in banned
    forced = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    both = engine.generate([p, q], [sp(logit_bias={forced: 100}), sp()])
    assert both[0].token_ids == [forced] * 12
    assert both[1].token_ids == engine.generate([q], sp())[0].token_ids
    # sampled too: a banned token never comes, whatever the seed
    drawn = engine.generate([p] * 4, [SamplingParams(max_tokens=12, temperature=1.0, seed=s, logit_bias={t: -100 for t in plain})
                                      for s in range(4)])
    assert all(not set(o.token_ids) & set(plain) for o in drawn)
    # a grammar allows only true/false: a bias toward "{" cannot break it, one against "true" picks "false"
    boolean = GrammarSpec.json_schema({"type": "boolean"})
    true_id = engine.tokenizer.encode("true", add_special_tokens=False)[0]
    out = engine.generate([q], SamplingParams(max_tokens=8, temperature=0, logit_bias={
        engine.tokenizer.encode("{", add_special_tokens=False)[0]: 100, true_id: -100}), boolean)[0]
    assert out.text == "false" and out.finish_reason is FinishReason.STOP
    with pytest.raises(RequestError) as e:
        engine.add_request(p, SamplingParams(max_tokens=4, logit_bias={engine.runner.vocab_size: 1.0}))
    assert e.value.param == "logit_bias"
    for bad in ({1: 101.0}, {-1: 1.0}, {"7": 1.0}, {1: float("nan")}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_stop_conditions(engine):
    p = chat(engine, "Count from 1 to 20 separated by commas.")
    full = engine.generate([p], SamplingParams(max_tokens=40, temperature=0))[0]
    assert full.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    # a stop string that occurs in the greedy text cuts it there, excluded
    stop = full.text[10:13]
    cut = engine.generate([p], SamplingParams(max_tokens=40, temperature=0, stop=[stop]))[0]
    assert cut.finish_reason is FinishReason.STOP and cut.text == full.text[:full.text.find(stop)]
    # a stop token id
    tok = full.token_ids[5]
    st = engine.generate([p], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[tok]))[0]
    assert st.token_ids[-1] == tok and st.finish_reason is FinishReason.STOP
    ln = engine.generate([p], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert ln.finish_reason is FinishReason.LENGTH and ln.completion_tokens == 7
    # EOS ends a chat answer: the model stops by itself on a short question
    eos = engine.generate([chat(engine, "Say just: hi")], SamplingParams(max_tokens=64, temperature=0))[0]
    assert eos.finish_reason is FinishReason.STOP


def test_generate_takes_params_per_prompt(engine):
    ps = prompts_mixed(engine)[:3]
    outs = engine.generate(ps, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 9, 5)])
    assert [o.completion_tokens for o in outs] == [3, 9, 5]
    with pytest.raises(ValueError, match="3 prompts, but 2 sampling params"):
        engine.generate(ps, [SamplingParams(max_tokens=2)] * 2)


def test_streaming_matches_generate(engine):
    p = chat(engine, "Describe a sunset in one sentence.")
    sp = SamplingParams(max_tokens=32, temperature=0.8, seed=5)
    whole = engine.generate([p], sp)[0]
    parts = list(engine.stream(p, sp))
    assert parts[-1].finished
    assert "".join(o.new_text for o in parts) == whole.text
    assert sum(len(o.new_token_ids) for o in parts) == whole.completion_tokens


def test_an_answer_taken_whole_comes_in_two_updates(engine):
    """`each_step=False` (generate, and the engine process's non-streamed requests): the first token,
    then the rest at the end, with the same tokens, text and logprobs as the step-by-step updates."""
    p = chat(engine, "Name three colors.")
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    got = {}
    for each_step in (True, False):
        outs, done = [], threading.Event()
        engine.add_request(p, sp, None, lambda o, outs=outs, done=done: (outs.append(o), o.finished and done.set()),
                           each_step=each_step)
        assert done.wait(120)
        got[each_step] = outs
    steps, whole = got[True], got[False]
    assert len(steps) == 24 and len(whole) == 2 and whole[1].finished and not whole[0].finished
    assert [t for o in whole for t in o.new_token_ids] == [t for o in steps for t in o.new_token_ids]
    # the second run's prompt comes from the prefix cache: its sums may differ in the last bits
    lps_whole, lps_steps = [x for o in whole for x in o.logprobs], [x for o in steps for x in o.logprobs]
    assert [x["logprob"] for x in lps_whole] == pytest.approx([x["logprob"] for x in lps_steps], abs=1e-3)
    assert "".join(o.new_text for o in whole) == "".join(o.new_text for o in steps)
    assert whole[1].completion_tokens == 24


def test_step_tokens_only_for_streamed_token_ids(engine):
    """`step_tokens` entries carry token ids for a caller that detokenizes and streams: anything else
    is refused up front (its updates would lose their text, or contradict `each_step=False`)."""
    p = chat(engine, "Hi")
    for kw in ({"detokenize": True}, {"detokenize": False, "each_step": False}):
        with pytest.raises(ValueError, match="step_tokens"):
            engine.add_request(p, SamplingParams(max_tokens=2), step_tokens=[], **kw)


def test_abort_frees_slots(engine):
    pool = engine.runner.pool
    p = chat(engine, "Write a long story about a dragon.")
    got, done = [], threading.Event()

    def on_out(out):
        got.append(out)
        if out.finished:
            done.set()
    req = engine.add_request(p, SamplingParams(max_tokens=400, ignore_eos=True), on_output=on_out)
    deadline = time.time() + 60
    while len(got) < 5 and time.time() < deadline:
        time.sleep(0.01)
    assert pool.num_free < pool.capacity  # it holds KV mid-decode
    engine.abort(req.request_id)
    assert done.wait(30)
    assert got[-1].finish_reason is FinishReason.ABORT
    _wait_pool_full(engine)
    # aborting a queued request that never ran, and an unknown id, are harmless
    engine.abort("no-such-request")


def test_rejects_too_long_prompt(engine):
    with pytest.raises(RequestError) as e:
        engine.add_request(list(range(100)) * (engine.max_context // 100 + 1), SamplingParams(max_tokens=4))
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


def _wait_pool_full(engine, timeout=30):
    pool = engine.runner.pool
    deadline = time.time() + timeout
    while pool.num_free != pool.capacity and time.time() < deadline:
        time.sleep(0.01)
    assert pool.num_free == pool.capacity
    assert engine.runner.table.num_free_rows == engine.config.max_running_requests


def test_exhaustion_64_requests_small_pool(smollm2_dir, engine):
    prompts = [chat(engine, f"Name a color number {i}.") for i in range(64)]
    per_req = max(len(p) for p in prompts) + 16
    small = Engine(model=smollm2_dir, device="cpu", kv_cache_slots=8 * per_req, max_running_requests=64)
    try:
        sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        outs = small.generate(prompts, sp)
        assert all(o.finish_reason is FinishReason.LENGTH and o.completion_tokens == 16 for o in outs)
        # same tokens as an unconstrained engine (retraction and re-prefill are exact)
        ref = engine.generate(prompts[:4], sp)
        assert [o.token_ids for o in outs[:4]] == [o.token_ids for o in ref]
        _wait_pool_full(small)
        assert small.scheduler.num_retractions > 0 or small.runner.pool.capacity >= 64 * per_req
    finally:
        small.shutdown()
    _wait_pool_full(engine)


def test_an_engine_freezes_what_it_built(tiny_llama_dir):
    """The objects that live as long as the engine are out of the collector's way once it is built
    (`gc.freeze`): a full collection then walks only what requests created. Shut down, the engine
    is collectable again (a process building engines one after another does not keep them all)."""
    import gc
    import weakref
    gc.unfreeze()  # another engine of this test process froze its own
    eng = Engine(model=tiny_llama_dir, device="cpu")
    try:
        assert gc.get_freeze_count() > 10_000
        assert eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids
    finally:
        eng.shutdown()
    model = weakref.ref(eng.runner.model)
    del eng
    gc.collect()
    assert model() is None


def test_idle_engine_wakes_when_a_grammar_compiles(tiny_llama_dir):
    """An idle engine thread sleeps (50 ms at a time while a grammar compiles); the compile's
    completion wakes it, so a new schema's first token is not held back by that sleep."""
    import statistics
    from constrained_spec.grammar import GrammarSpec
    eng = Engine(model=tiny_llama_dir, device="cpu")
    try:
        p = [5, 6, 7, 8]
        eng.generate([p], SamplingParams(max_tokens=2))
        gaps = []
        for i in range(5):
            time.sleep(0.2)  # idle again
            schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
            compiled_before = eng.grammar.stats["compile_seconds_total"]
            t0 = time.perf_counter()
            first = next(iter(eng.stream(p, SamplingParams(max_tokens=1), GrammarSpec.json_schema(schema))))
            assert first.new_token_ids
            gaps.append(time.perf_counter() - t0 - (eng.grammar.stats["compile_seconds_total"] - compiled_before))
        assert statistics.median(gaps) < 0.03, gaps  # without the wake-up: ~0.05 s
    finally:
        eng.shutdown()


def test_jump_forward_keeps_the_models_tokenization(smollm2_dir, engine):
    """--jump-forward emits grammar-forced text without sampling, all but its last token: the
    model continues from its own tokenization (`"name` then `":`), so greedy JSON comes out as it
    does without jump-forward, in fewer steps. (Forcing `name"` whole made SmolLM2 write
    `"name"   : `.)"""
    from constrained_spec.grammar import GrammarSpec
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    ps = [chat(engine, f"Give a JSON profile of {t} with name, age and city.") for t in ("a chef", "a pilot")]
    sp = SamplingParams(max_tokens=60, temperature=0)
    plain = engine.generate(ps, sp, GrammarSpec.json_schema(schema))
    jf = Engine(model=smollm2_dir, device="cpu", jump_forward=True, grammar_backend=PINNED)
    try:
        forced = jf.generate(ps, sp, GrammarSpec.json_schema(schema))
        assert [o.text for o in forced] == [o.text for o in plain]
        assert jf.stats.forced_tokens > 0
        # a forced token has an entry of its own (probability 1): a whole answer's entries, held
        # step by step, had slid onto later tokens, each greedy token's entry topped by another
        # (QA 1130b spec D1)
        with_lps = jf.generate(ps, SamplingParams(max_tokens=60, temperature=0, logprobs=2),
                               GrammarSpec.json_schema(schema))
        for out in with_lps:
            assert len(out.logprobs) == len(out.token_ids)
            assert all(lp["top"][0][0] == t for t, lp in zip(out.token_ids, out.logprobs)), out.text
            assert sum(lp["logprob"] == 0.0 and len(lp["top"]) == 1 for lp in out.logprobs) > 0
    finally:
        jf.shutdown()


def test_a_shut_down_engine_refuses_requests(tiny_llama_dir):
    """A request after `shutdown()` would never run: it is refused at once, not left waiting."""
    eng = Engine(model=tiny_llama_dir, device="cpu", dtype="float32")
    assert eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
    eng.shutdown()
    with pytest.raises(RequestError, match="shut down"):
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    # a grammar not compiled yet: no worker takes it any more (QA 1130 D1: compile_grammar hung)
    from constrained_spec.grammar import GrammarError, GrammarSpec
    raised = []

    def check():
        try:
            eng.compile_grammar(GrammarSpec.regex("[a-q]{3}"))
        except GrammarError as e:
            raised.append(e)
    checker = threading.Thread(target=check, daemon=True)  # (daemon: a hang fails the test, not the run)
    checker.start()
    checker.join(10)
    assert raised and "closed" in str(raised[0])


def test_ctrl_c_in_generate_aborts_its_prompts(tiny_llama_dir):
    """QA 1130 D2: a KeyboardInterrupt while `generate` waited left its prompts decoding for nobody."""
    import os
    import signal
    eng = Engine(model=tiny_llama_dir, device="cpu", dtype="float32")
    # Python's own Ctrl-C handler (an xdist worker ignores SIGINT)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        long = SamplingParams(max_tokens=eng.max_context - 8, ignore_eos=True)
        # a real SIGINT (Ctrl-C): `_thread.interrupt_main` would wait for the blocked wait to end
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            eng.generate([[1, 2, 3], [4, 5, 6]], long)
        deadline = time.monotonic() + 5
        while eng.num_queued() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert eng.num_queued() == 0 and eng.kv_usage() == 0
    finally:
        signal.signal(signal.SIGINT, before)
        eng.shutdown()


def test_a_script_may_end_with_requests_in_flight(tiny_llama_dir, tmp_path):
    """QA 1130 D3: a script ending (or interrupted) with requests running and no `shutdown()`
    aborted the process ("terminate called without an active exception", SIGABRT)."""
    import subprocess
    import sys
    script = tmp_path / "ends.py"
    script.write_text(f"""
import threading
from constrained_spec import Engine, SamplingParams
eng = Engine(model={tiny_llama_dir!r}, device="cpu", dtype="float32")
long = SamplingParams(max_tokens=eng.max_context - 8, ignore_eos=True)
it = eng.stream([1, 2, 3], long)
next(it)
threading.Thread(target=lambda: eng.generate([[4, 5, 6]], long), daemon=True).start()
print("end of script", flush=True)
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "end of script" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_shutdown_ends_the_requests_in_flight(tiny_llama_dir):
    """A request running, one waiting for its grammar and one just queued when `shutdown()` comes
    end with finish_reason "error", streamed or taken whole: their callers waited forever."""
    from constrained_spec.grammar import GrammarSpec
    eng = Engine(model=tiny_llama_dir, device="cpu", dtype="float32")
    long = SamplingParams(max_tokens=eng.max_context - 8, ignore_eos=True)
    it = eng.stream([1, 2, 3], long)
    assert next(it).new_token_ids  # running
    whole = []
    caller = threading.Thread(target=lambda: whole.extend(eng.generate([[4, 5, 6], [7, 8, 9]], long, [
        None, GrammarSpec.regex("[a-z]{1,500}")])))
    caller.start()
    time.sleep(0.05)
    eng.shutdown()
    caller.join(timeout=10)
    assert not caller.is_alive() and [o.finish_reason for o in whole] == [FinishReason.ERROR] * 2
    assert all("shut down" in o.error for o in whole)
    rest = list(it)
    assert rest[-1].finished and rest[-1].finish_reason == FinishReason.ERROR


def test_a_refused_prompt_cancels_the_batch_queued_before_it(tiny_llama_dir):
    """`generate` raises for a prompt the engine refuses; the prompts it had queued before it are
    aborted, not left running for nobody."""
    eng = Engine(model=tiny_llama_dir, device="cpu", dtype="float32")
    try:
        with pytest.raises(RequestError):
            eng.generate([[1, 2, 3], [1] * (eng.max_context + 1)], SamplingParams(max_tokens=400, ignore_eos=True))
        deadline = time.time() + 10
        while not eng.stats.finished and time.time() < deadline:
            time.sleep(0.01)
        assert eng.stats.finished == {"abort": 1} and eng.num_queued() == 0
    finally:
        eng.shutdown()


def test_a_grammar_busy_in_the_compile_queue_fails_its_request(tiny_llama_dir, monkeypatch):
    """A grammar that waited too long for a compile thread (the compile queue's GrammarBusy) ends its
    request with that error, and the engine goes on serving: its loop took only a GrammarError for a
    failed compile, and failed its step over and over with the request left compiling."""
    from concurrent.futures import Future
    from constrained_spec.grammar import GrammarBusy, GrammarSpec
    eng = Engine(model=tiny_llama_dir, device="cpu", dtype="float32")
    try:
        def busy(spec, timeout_s=None, check_only=False):
            f = Future()
            f.set_exception(GrammarBusy("the grammar waited 60s for a compile thread; retry later"))
            return f
        monkeypatch.setattr(eng.grammar, "compile_async", busy)
        outs = []
        caller = threading.Thread(target=lambda: outs.extend(
            eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4), GrammarSpec.regex("[0-9]+"))))
        caller.start()
        caller.join(timeout=20)
        assert not caller.is_alive() and outs[0].finish_reason is FinishReason.ERROR
        assert "waited 60s" in outs[0].error
        monkeypatch.undo()
        ok = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4), GrammarSpec.regex("[0-9]+"))[0]
        assert ok.finish_reason is not FinishReason.ERROR
    finally:
        eng.shutdown()


def test_a_grammar_backend_failure_fails_its_request_with_its_cause(tiny_llama_dir, monkeypatch):
    """llguidance failing on a token its own mask allowed (its parser's row limit, here on a schema
    the up-front check would send elsewhere) fails that request as a grammar too complex for it,
    with llguidance's reason, not as a grammar violation; the next request is served."""
    from constrained_spec.engine import FinishReason
    from constrained_spec.grammar import GrammarBackend, GrammarSpec, llguidance_schema
    monkeypatch.setattr(llguidance_schema, "MAX_OPTIONAL_ONLY_PROPERTIES", 10**6)
    # the compile-time probe refuses it (it accepts a first token): these test the failure it misses
    monkeypatch.setattr(GrammarBackend, "_probe_llguidance", lambda self, compiled: None)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
    eng = Engine(model=tiny_llama_dir, device="cpu", grammar_backend="llguidance")
    try:
        # '{' forced: a random model may answer '{}' (one token that never opens the wide row), as it
        # did on CI's CPU, where its argmax differed from this machine's
        brace = eng.tokenizer.encode("{", add_special_tokens=False)[0]
        params = SamplingParams(max_tokens=8, logit_bias={brace: 100.0})
        out = eng.generate([[5, 6, 7]], params, GrammarSpec.json_schema(wide))[0]
        assert out.finish_reason is FinishReason.ERROR
        assert "too complex for the llguidance backend" in out.error and "max is 2000" in out.error, out.error
        assert "<state>" not in out.error and len(out.error) < 300, out.error  # its reason, not its parser's dump
        ok = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4), GrammarSpec.regex("[0-9]+"))[0]
        assert ok.finish_reason is not FinishReason.ERROR
    finally:
        eng.shutdown()


def test_the_queue_limit_counts_waiting_requests_only(tiny_llama_dir):
    """max_queued_requests bounds the requests waiting for a batch slot, beside the running ones: with
    none queued, an idle engine refused every request (it counted running ones too)."""
    eng = Engine(model=tiny_llama_dir, device="cpu", max_running_requests=2, max_queued_requests=0)
    try:
        assert eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids
        held = [eng.add_request([5, 6, 7 + i], SamplingParams(max_tokens=4000, ignore_eos=True)) for i in range(2)]
        deadline = time.monotonic() + 10
        while eng.num_queued() < 2:  # taken in by the engine thread
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(RequestError, match="queue is full"):
            eng.add_request([5, 6, 9], SamplingParams(max_tokens=2))
        for r in held:
            eng.abort(r.request_id)
    finally:
        eng.shutdown()


def test_running_requests_decode_between_a_long_prompt_s_chunks(tiny_llama_dir):
    """A prompt longer than the step's token budget is prefilled in chunks with a decode step
    between two of them: the running requests' next tokens wait for one chunk's step, not the whole
    prefill (QA 1129m D2: a 6,000-token prompt held 4 streams for 145 s on the CPU)."""
    from constrained_spec.attention.base import ForwardMode
    eng = Engine(model=tiny_llama_dir, device="cpu", max_prefill_tokens=32)
    steps = []
    schedule = eng.scheduler.schedule

    def recorded(can_retract):
        batch = schedule(can_retract)
        if batch is not None:
            steps.append("chunk" if batch.mode is ForwardMode.EXTEND and not all(batch.samples)
                         else batch.mode.name.lower())
        return batch
    eng.scheduler.schedule = recorded
    try:
        short = [SamplingParams(max_tokens=24, ignore_eos=True)] * 2
        outs = eng.generate([[5, 6, 7], [8, 9, 10], list(range(20, 340))],
                            short + [SamplingParams(max_tokens=2, ignore_eos=True)])
        assert [len(o.token_ids) for o in outs] == [24, 24, 2]
        chunks = [i for i, s in enumerate(steps) if s == "chunk"]
        assert len(chunks) >= 9, steps  # 320 tokens, 32 a step, the first beside the short prompts
        assert all(steps[i + 1] == "decode" for i in chunks), steps
    finally:
        eng.shutdown()


def test_the_loop_counts_its_waits_for_the_device(tiny_llama_dir, monkeypatch):
    """`stats.device_wait_seconds` sums the loop's waits for steps' results (`/metrics`'
    constrained_spec_engine_device_wait_seconds_total): where a step's results arrive late, the
    counter holds that time, and the loop's own work is not counted in it. On the CPU a step's
    results are ready when it returns, so the late results are made here by a slower read."""
    from constrained_spec.engine.model_runner import StepResult
    eng = Engine(model=tiny_llama_dir, device="cpu")
    try:
        eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
        assert eng.stats.device_wait_seconds < 0.05 * eng.stats.steps  # ready at once: ~nothing
        read = StepResult.wait

        def late(self):
            time.sleep(0.02)
            return read(self)
        monkeypatch.setattr(StepResult, "wait", late)
        before, steps = eng.stats.device_wait_seconds, eng.stats.steps
        eng.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))
        waited, stepped = eng.stats.device_wait_seconds - before, eng.stats.steps - steps
        assert stepped >= 6
        assert 0.02 * stepped * 0.9 <= waited <= 0.02 * stepped + 0.5, (waited, stepped)
    finally:
        eng.shutdown()


def test_a_failed_step_fails_its_requests_and_the_queue_goes_on(tiny_llama_dir):
    """A step that raises fails the running requests (with a message, not a hang), and only them:
    the waiting ones never entered it and are served after; nothing leaks."""
    from constrained_spec.engine import FinishReason
    from matcher_states import wait_pool_full
    eng = Engine(model=tiny_llama_dir, device="cpu", dtype="float32", max_running_requests=1)
    try:
        forward, calls = eng.runner.forward, []

        def failing_once(batch, *a, **kw):
            calls.append(len(calls))
            if len(calls) == 3:  # the running request's second decode step
                raise RuntimeError("injected step failure")
            return forward(batch, *a, **kw)
        eng.runner.forward = failing_once
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        first, second = eng.generate([[5, 6, 7], [8, 9, 10]], params)
        assert first.finish_reason is FinishReason.ERROR and "internal error" in first.error
        assert second.finish_reason is FinishReason.LENGTH and len(second.token_ids) == 6
        wait_pool_full(eng)
    finally:
        eng.shutdown()


def test_an_engine_leaves_its_callers_config_as_it_was(tiny_llama_dir):
    """`Engine(config, **overrides)` applies the overrides to its own copy: the caller's config,
    reused for a second engine, kept the first one's overrides."""
    from constrained_spec.engine.config import EngineConfig
    config = EngineConfig(model=tiny_llama_dir, device="cpu")
    eng = Engine(config, dtype="float32", max_running_requests=3)
    try:
        assert (eng.config.dtype, eng.config.max_running_requests) == ("float32", 3)
        assert (config.dtype, config.max_running_requests) == (EngineConfig().dtype, EngineConfig().max_running_requests)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("options", [{}, {"disable_prefix_cache": True}, {"speculative_algorithm": "ngram"}])
def test_requests_longer_than_the_kv_cache_end_at_its_size(tiny_llama_dir, options):
    """A request the model's context holds but the KV pool does not waited forever (alone past the
    pool's end it could neither grow nor be retracted): the pool is its context, as the model's is."""
    eng = Engine(model=tiny_llama_dir, device="cpu", kv_cache_slots=16, **options)
    try:
        assert eng.max_context == 16
        sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        outs = eng.generate([[5, 6, 7, 8], [9, 10, 11]], sp)
        assert [(o.finish_reason, o.completion_tokens) for o in outs] == [(FinishReason.LENGTH, 12),
                                                                          (FinishReason.LENGTH, 13)]
        with pytest.raises(RequestError, match="the KV cache holds 16"):
            eng.generate([list(range(5, 21))], sp)
        _wait_pool_full(eng)
    finally:
        eng.shutdown()


def test_bad_arguments_are_refused_up_front_and_fail_no_other_request(tiny_llama_dir):
    """A prompt token id past the vocabulary failed the engine step in its embedding lookup, and
    with it every request in the step; the Engine API checks ids as the server does."""
    from constrained_spec.grammar import GrammarSpec
    eng = Engine(model=tiny_llama_dir, device="cpu")
    try:
        vocab = eng.runner.vocab_size
        running = eng.stream([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
        first = next(running)
        for prompt, params, match in (([5, vocab], None, f"token id {vocab}, outside"),
                                      ([5, -1], None, "token id -1, outside"),
                                      ([5, 6], SamplingParams(stop_token_ids=[vocab + 7]), "stop_token_ids")):
            with pytest.raises(RequestError, match=match):
                eng.generate(prompt, params)
        with pytest.raises(TypeError, match="a string, a list of token ids"):
            eng.generate(123)
        for ids in ([5, "x"], [1.0, 2.0], [1.5]):  # a float or a str reached the detokenizer on the engine's
            with pytest.raises(TypeError, match="a string or a list of token ids"):  # thread and stopped it
                eng.generate([ids])
        with pytest.raises(TypeError, match="grammar must be a GrammarSpec"):
            eng.generate([5, 6], grammar={"type": "object"})
        for seed in (2**63, -2**63 - 1):  # past int64 it failed the step's seed array (OverflowError)
            with pytest.raises(ValueError, match="seed must be a 64-bit signed integer"):
                SamplingParams(seed=seed)
        # the largest seed and a top_k past the vocabulary (a float past int64 in the step's array) sample
        edge = eng.generate([5, 6], SamplingParams(max_tokens=4, seed=2**63 - 1, top_k=2**70, ignore_eos=True))
        assert edge[0].completion_tokens == 4, edge
        rest = list(running)
        assert rest[-1].finish_reason is FinishReason.LENGTH and rest[-1].completion_tokens == 30, rest[-1]
        assert eng.generate([5, 6], grammar=GrammarSpec.regex("[ab]{3}"),
                            params=SamplingParams(max_tokens=8))[0].finish_reason is FinishReason.STOP
        assert first is not None
    finally:
        eng.shutdown()


@pytest.mark.parametrize("option, value, says", [("max_running_requests", 0, "at least 1"),
                                                 ("device", "tpu", "cpu, cuda, cuda:N or auto"),
                                                 ("kv_cache_memory_gb", 0, "positive"),
                                                 ("ngram_max_match", 0, "at least 1"),
                                                 # wrong types failed inside, some after the model loaded
                                                 ("max_running_requests", "8", "an integer"),
                                                 ("max_running_requests", None, "an integer"),
                                                 ("kv_cache_memory_gb", float("inf"), "a positive number"),
                                                 ("speculative_policy", "bogus", "one of measured, always"),
                                                 ("ngram_min_match", 9, "not exceed ngram_max_match")])
def test_engine_options_out_of_range_are_refused_before_anything_loads(option, value, says):
    """max_running_requests 0 made an engine whose every generate waited forever; a device torch
    does not know failed inside torch. The CLI's flags are checked against the same ranges."""
    with pytest.raises(ValueError, match=f"engine option {option}.*{says}"):
        Engine(model="/nonexistent/model", **{option: value})


def test_a_cuda_device_without_cuda_is_a_value_error(monkeypatch):
    """QA 1130 D11: torch's bare AssertionError ("Torch not compiled with CUDA enabled")."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='cuda'.*CUDA is not available"):
        Engine(model="/nonexistent/model", device="cuda")

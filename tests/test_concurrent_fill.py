"""The overlapped step's grammar work: a step's tokens go into the matchers in one call, and the next
step's mask fill runs on the engine thread while its step thread finishes and streams requests.

The engine runs the overlapped loop on the CUDA device only; these tests force it on the CPU
(`_overlapped`), where the next step is launched (its forward computed) before the last step's
tokens are processed, exactly as on the GPU. The reference is the sequential path (no overlap:
every fill on the engine thread). Models are the suite's tiny random Llama."""
from __future__ import annotations

import json
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from constrained_spec import SamplingParams
from constrained_spec.engine import Engine, FinishReason
from constrained_spec.engine.engine import _Collector
from constrained_spec.engine.request import Status
from constrained_spec.engine.mask_filler import BACKGROUND_MIN_ROWS, MaskFiller
from constrained_spec.grammar import GrammarSpec
from matcher_states import backend, matchers_along, wait_pool_full  # noqa: F401 (backend: a fixture)
from grammar_pin import PINNED

PERSON = GrammarSpec.json_schema({
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False})
CHOICE = GrammarSpec.choice(["yes", "no", "maybe"])  # ends after a token or two: its stop token comes early
DIGITS = GrammarSpec.regex("[0-9]{1,3}")
PROMPTS = [[1, 17, 230, 4005, 88 + i, 9, 61 + 3 * i] for i in range(14)]


def build(tiny_llama_dir, **kw) -> Engine:
    return Engine(model=tiny_llama_dir, device="cpu", kv_cache_slots=4096, max_running_requests=16, grammar_backend=PINNED,
                  grammar_mask_threads=2, **kw)


def overlapped(engine: Engine) -> list[int]:
    """Forces the overlapped loop; returns a list that counts the fills made beside the processing."""
    started = [0]
    start = engine.masks.start

    def counted(reqs, *accepts):
        call = start(reqs, *accepts)
        started[0] += call is not None
        return call
    engine.masks.start = counted
    engine._overlapped = lambda: True
    return started


def workload():
    """Grammars and sampling settings that reach every finish: length, EOS, grammar end with
    `ignore_eos` (the matcher terminates), stop strings; greedy and seeded sampling. Both grammar
    backends in every step."""
    specs, params = [], []
    for i in range(len(PROMPTS)):
        kind = i % 7
        specs.append([PERSON.with_backend("llguidance"), PERSON.with_backend("xgrammar"),
                      CHOICE.with_backend("llguidance"), CHOICE.with_backend("xgrammar"), DIGITS,
                      None, None][kind])
        params.append(SamplingParams(
            max_tokens=[28, 20, 12, 12, 10, 24, 16][kind], temperature=0 if i % 2 else 0.9, seed=100 + i,
            ignore_eos=kind == 3 or kind == 4, stop=["e"] if kind == 6 else []))
    return specs, params


def beside_a_fill(engine: Engine) -> bool:
    """Whether the caller runs on the engine thread while a mask fill runs on the pool's threads."""
    started = engine.masks._started
    return (threading.current_thread().name == "constrained-spec-engine" and started is not None
            and not started.done)


def summary(outs):
    return [(o.token_ids, o.text, o.finish_reason, o.error) for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """The workload's outputs on the sequential path."""
    eng = build(tiny_llama_dir)
    try:
        specs, params = workload()
        outs = eng.generate(PROMPTS, params, specs)
        again = eng.generate(PROMPTS, params, specs)
    finally:
        eng.shutdown()
    assert summary(outs) == summary(again)
    reasons = {o.finish_reason for o in outs}
    assert FinishReason.LENGTH in reasons and FinishReason.STOP in reasons
    return summary(outs)


def test_concurrent_fill_equals_sequential(tiny_llama_dir, reference):
    eng = build(tiny_llama_dir)
    try:
        started = overlapped(eng)
        specs, params = workload()
        assert summary(eng.generate(PROMPTS, params, specs)) == reference
        assert started[0] >= 10  # the fills did run beside the processing
        # both halves of the grammar work are timed (bench_gpu's "grammar CPU ms/step", /metrics)
        assert eng.stats.grammar_accept_seconds > 0 and eng.stats.grammar_mask_seconds > 0
        # and again, with the batch arriving one request at a time (extend steps between decodes)
        collectors = [_Collector() for _ in PROMPTS]
        reqs = []
        for p, sp, g, c in zip(PROMPTS, params, specs, collectors):
            reqs.append(eng.add_request(p, sp, g, c))
            time.sleep(0.003)
        assert summary([c.result(r) for c, r in zip(collectors, reqs)]) == reference
        wait_pool_full(eng)
    finally:
        eng.shutdown()


def test_engine_thread_calls_no_matcher_beside_a_fill(tiny_llama_dir, reference, monkeypatch):
    """The ownership rule: the engine thread's Python that runs while a fill on the pool holds the
    batch's matchers must not call any matcher (a race xgrammar would not report)."""
    from constrained_spec.grammar.backend import RequestMatcher
    offenders = []
    for name in ("accept_token", "accept_tokens", "rollback", "fill_bitmask", "is_terminated", "can_terminate",
                 "reset", "fork", "jump_forward_string", "jump_forward_tokens", "traverse_draft_tree"):
        method = getattr(RequestMatcher, name)

        def guarded(self, *args, _method=method, _name=name, **kwargs):
            if beside_a_fill(eng):
                offenders.append(_name)
            return _method(self, *args, **kwargs)
        monkeypatch.setattr(RequestMatcher, name, guarded)
    eng = build(tiny_llama_dir)
    try:
        started = overlapped(eng)
        specs, params = workload()
        assert summary(eng.generate(PROMPTS, params, specs)) == reference
        assert started[0] >= 10 and offenders == []
    finally:
        eng.shutdown()


def illegal_token(matcher) -> int:
    """A text token the matcher refuses in its present state (not one of SmolLM2's 17 special
    tokens: those are never legal, and the EOS among them ends a request by another path)."""
    row = torch.zeros((1, 1536), dtype=torch.int32)
    matcher.fill_bitmask(row, 0)
    words = row[0].tolist()
    return next(t for t in range(17, 49152) if not (words[t >> 5] >> (t & 31)) & 1)


def inject(engine: Engine, when) -> None:
    """Replaces the sampled token of each request for which `when(request)` holds by a token its
    grammar refuses there. Runs on the engine thread as the step's results are read: before the
    step's tokens go into the matchers (a fill started in the last step is done by then)."""
    process = engine._process

    def injected(result, launched=None):
        wait = result.wait

        def wait_and_replace():
            tokens, logprobs = wait()
            for i, r in enumerate(result.batch.sampling_requests()):
                if not r.finished and not r.discard_inflight and when(r):
                    tokens[i] = illegal_token(r.matcher)
            return tokens, logprobs
        result.wait = wait_and_replace
        return process(result, launched)
    engine._process = injected


@pytest.mark.parametrize("overlap", [False, True])
def test_refused_token_fails_its_request_only(tiny_llama_dir, reference, overlap):
    """A token the grammar refuses (here injected: the sampler never picks one) fails its request
    with a clear error; the others finish as they would have, and the engine keeps serving."""
    eng = build(tiny_llama_dir)
    try:
        if overlap:
            overlapped(eng)
        specs, params = workload()
        victim = 0  # a JSON request
        inject(eng, lambda r: r.prompt_ids == PROMPTS[victim] and len(r.output_ids) == 5)
        outs = summary(eng.generate(PROMPTS, params, specs))
        ids, text, reason, error = outs[victim]
        assert reason is FinishReason.ERROR and "violates the grammar" in error
        # on the fill's pool (overlap) the step's tokens are streamed while their accepts run: the
        # refused one has gone out when the request fails
        assert ids[:5] == reference[victim][0][:5] and len(ids) <= 6
        assert outs[:victim] + outs[victim + 1:] == reference[:victim] + reference[victim + 1:]
        wait_pool_full(eng)
        del eng._process  # no more injections
        assert summary(eng.generate(PROMPTS, params, specs)) == reference
    finally:
        eng.shutdown()


def test_refused_tokens_in_one_step(tiny_llama_dir, reference):
    """Several refusals in one step (one batch call refuses several positions), next to stop tokens."""
    eng = build(tiny_llama_dir)
    try:
        overlapped(eng)
        specs, params = workload()
        victims = {0, 1, 7, 8}  # PERSON requests
        inject(eng, lambda r: PROMPTS.index(r.prompt_ids) in victims and len(r.output_ids) == 3)
        outs = summary(eng.generate(PROMPTS, params, specs))
        for i, (out, ref) in enumerate(zip(outs, reference)):
            if i in victims:
                assert out[2] is FinishReason.ERROR and out[0][:3] == ref[0][:3] and len(out[0]) <= 4
            else:
                assert out == ref
        wait_pool_full(eng)
    finally:
        eng.shutdown()


def test_abort_while_the_fill_runs(tiny_llama_dir, reference):
    """An abort that arrives while a step is processed (and the next step's fill runs) takes effect
    at the next step; everyone else is unaffected."""
    eng = build(tiny_llama_dir)
    try:
        overlapped(eng)
        specs, params = workload()
        collectors = [_Collector() for _ in PROMPTS]
        reqs: list = []
        victim = 7  # JSON, greedy
        in_fill = []

        def trigger(out):  # request 0's updates arrive on the step thread, beside a fill
            collectors[0](out)
            # from the fourth token on, at the first update that comes while a fill runs (on a
            # loaded machine a step's fill may be done before its updates go out)
            if len(collectors[0].ids) >= 4 and not in_fill and beside_a_fill(eng):
                in_fill.append(True)
                eng.abort(reqs[victim].request_id)
        callbacks = [trigger] + collectors[1:]
        for p, sp, g, c in zip(PROMPTS, params, specs, callbacks):
            reqs.append(eng.add_request(p, sp, g, c))
        outs = summary([c.result(r) for c, r in zip(collectors, reqs)])
        assert in_fill == [True]  # the abort came while a started fill was running
        assert outs[victim][2] is FinishReason.ABORT and len(outs[victim][0]) < len(reference[victim][0])
        assert outs[victim][0] == reference[victim][0][:len(outs[victim][0])]
        assert outs[:victim] + outs[victim + 1:] == reference[:victim] + reference[victim + 1:]
        wait_pool_full(eng)
    finally:
        eng.shutdown()


def test_failed_step_with_a_started_fill_keeps_serving(tiny_llama_dir, reference):
    """A step that fails beside its fill (an output callback raises on the step thread): the running
    requests fail, the prepared rows are dropped, and later requests are exact."""
    eng = build(tiny_llama_dir)
    try:
        overlapped(eng)
        specs, params = workload()
        raised = []
        collector = _Collector()

        def raising(out):
            collector(out)
            # from the third token on, at the first update that comes while a fill runs (on a loaded
            # machine a step's fill may be done before its updates go out)
            if len(collector.ids) >= 3 and not raised and beside_a_fill(eng):
                raised.append(True)
                raise RuntimeError("injected failure in an output callback")
        others = [_Collector() for _ in PROMPTS[1:]]
        reqs = [eng.add_request(PROMPTS[0], params[0], specs[0], raising)]
        reqs += [eng.add_request(p, sp, g, c) for p, sp, g, c in zip(PROMPTS[1:], params[1:], specs[1:], others)]
        outs = [collector.result(reqs[0])] + [c.result(r) for c, r in zip(others, reqs[1:])]
        assert raised == [True]
        assert outs[0].finish_reason is FinishReason.ERROR
        assert any(o.finish_reason is FinishReason.ERROR for o in outs[1:])
        assert eng.masks._started is None
        wait_pool_full(eng)
        assert summary(eng.generate(PROMPTS, params, specs)) == reference
    finally:
        eng.shutdown()


def test_speculative_steps_between_started_fills(tiny_llama_dir):
    """Speculative steps (drafting moves the matchers) follow overlapped plain steps whose fills
    started beside the processing (batches above `speculative_max_batch` decode plainly, and the
    batch shrinks as requests finish); the output is plain greedy's."""
    specs = [PERSON, PERSON, DIGITS, None] * 2
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0) for i in range(8)]
    plain = build(tiny_llama_dir)
    try:
        ref = summary(plain.generate(PROMPTS[:8], params, specs))
    finally:
        plain.shutdown()
    eng = build(tiny_llama_dir, speculative_algorithm="ngram", speculative_max_batch=4, speculative_policy="always")
    try:
        started = overlapped(eng)
        for _ in range(2):
            assert summary(eng.generate(PROMPTS[:8], params, specs)) == ref
        assert eng.spec.stats.steps > 0 and started[0] > 0
        wait_pool_full(eng)
    finally:
        eng.shutdown()


# -- the pieces on their own ---------------------------------------------------------------------------
def rows_of(matchers, width=1536) -> torch.Tensor:
    ref = torch.full((len(matchers), width), -1, dtype=torch.int32)
    for i, m in enumerate(matchers):
        if m is not None:
            m.fill_bitmask(ref, i)
    return ref


def test_pool_accept_refuses_and_leaves_refused_matchers_alone(backend):
    text = json.dumps({"name": "Ann", "age": 41})
    ms, ids = matchers_along(backend, PERSON, text, 6)
    tokens = [ids[k] for k in range(6)]
    tokens[2], tokens[4] = illegal_token(ms[2]), 60000  # a refused token, a token outside the vocabulary
    before = rows_of(ms)
    filler = MaskFiller(torch.zeros((1, 1536), dtype=torch.int32), threads=2, budget_ms=None, max_requests=1)
    try:
        assert filler.accept(ms, tokens) == [2, 4]
        after = rows_of(ms)
        assert torch.equal(after[2], before[2]) and torch.equal(after[4], before[4])
        for k in (0, 1, 3, 5):  # the others moved on by their token
            assert not torch.equal(after[k], before[k]) or ids[k] == ids[k + 1]
            fresh, _ = matchers_along(backend, PERSON, text, k + 2)
            assert torch.equal(after[k], rows_of([fresh[k + 1]])[0])
        assert filler.accept(ms[:1], [ids[1]]) == []
    finally:
        filler.close()


def test_matchers_terminate_only_on_stop_tokens(backend):
    """The overlapped step asks a matcher whether it terminated only after one of the grammar's stop
    tokens (xgrammar's rule when stop tokens are not overridden); walks random legal paths."""
    stop_ids = set(backend.grammar.tokenizer_info.stop_token_ids)
    rng = random.Random(0)
    buf = torch.zeros((1, 1536), dtype=torch.int32)
    for spec in (PERSON, CHOICE, DIGITS):
        compiled = backend.grammar.compile(spec)
        for _ in range(4):
            m = backend.grammar.matcher(compiled)
            for _ in range(40):
                m.fill_bitmask(buf, 0)
                words = buf[0].tolist()
                legal = [t for t in range(49152) if (words[t >> 5] >> (t & 31)) & 1]
                tok = rng.choice(legal)
                assert m.accept_token(tok)
                assert m.is_terminated() == (tok in stop_ids), (spec.kind, tok)
                if m.is_terminated():
                    break


class _Req(SimpleNamespace):
    @property
    def status(self):  # what `MaskFiller.start` reads (a Request's `finished` is its status)
        return Status.FINISHED if self.finished else Status.RUNNING


def fake_reqs(matchers):
    return [_Req(matcher=m, finished=False, discard_inflight=False, mask_job=None, mask_fill_seconds=0.0)
            for m in matchers]


@pytest.mark.parametrize("rows", [BACKGROUND_MIN_ROWS, 19])
def test_started_fill_gives_the_direct_rows(backend, rows):
    ms, _ = matchers_along(backend, PERSON, json.dumps({"name": "Bo Lee of the " * 8 + "Hills", "age": 7}), rows + 2)
    reqs = fake_reqs(ms)
    reqs[1].matcher = None  # no grammar
    reqs[2].finished = True  # finished before the start
    expected = rows_of([r.matcher if not r.finished else None for r in reqs])
    buf = torch.full((len(reqs), 1536), 0x5A5A5A5A, dtype=torch.int32)
    filler = MaskFiller(buf, threads=2, budget_ms=None, max_requests=len(reqs))
    try:
        started = filler.start(reqs)
        assert started is not None and filler.start(reqs) is None  # one at a time
        worker = threading.Thread(target=started.finish)  # any thread may finish it
        worker.start()
        worker.join()
        fill = filler.fill(reqs)
        assert fill.late == []
        assert torch.equal(fill.bitmask, expected)
        # a fill for other requests than the started ones fills anew
        buf.fill_(0x5A5A5A5A)
        filler.start(reqs).finish()
        other = reqs[::-1]
        assert torch.equal(filler.fill(other).bitmask, rows_of([r.matcher if not r.finished else None for r in other]))
        # never finished by the caller: `fill` finishes it
        buf.fill_(0x5A5A5A5A)
        assert filler.start(reqs) is not None
        assert torch.equal(filler.fill(reqs).bitmask, expected)
        # cancel: nothing pending afterwards (a fill on the pool is waited for)
        filler.start(reqs)
        filler.cancel()
        assert filler._started is None
        filler.start(reqs).finish()
        filler.cancel()
        assert filler._started is None
        buf.fill_(0x5A5A5A5A)
        assert torch.equal(filler.fill(reqs).bitmask, expected)
    finally:
        filler.close()


def test_started_fill_not_used_below_its_threshold_or_with_a_budget(backend):
    ms, _ = matchers_along(backend, PERSON, json.dumps({"name": "Al", "age": 3}), BACKGROUND_MIN_ROWS)
    buf = torch.zeros((len(ms), 1536), dtype=torch.int32)
    filler = MaskFiller(buf, threads=2, budget_ms=None, max_requests=len(ms))
    budgeted = MaskFiller(buf, threads=2, budget_ms=50.0, max_requests=len(ms))
    try:
        reqs = fake_reqs(ms)
        reqs[0].matcher = None
        assert filler.start(reqs) is None
        assert budgeted.start(fake_reqs(ms)) is None
        assert torch.equal(filler.fill(reqs).bitmask, rows_of([r.matcher for r in reqs]))
    finally:
        filler.close()
        budgeted.close()


@pytest.mark.parametrize("rows", [BACKGROUND_MIN_ROWS, 24])  # one thread, or several
def test_started_fill_error_reaches_the_engine_thread(backend, rows):
    """A fill call that fails does not raise (it runs beside the step's Python work); `fill` raises
    it (the engine fails that step), and the filler works on afterwards."""
    ms, _ = matchers_along(backend, CHOICE, "yes", 2)  # at the start, after "yes"
    ms = [backend.grammar.matcher(backend.grammar.compile(CHOICE)) for _ in range(rows - 1)] + ms[1:]
    done = ms[-1]
    stop = backend.grammar.tokenizer_info.stop_token_ids[0]
    assert done.accept_token(stop) and done.is_terminated()  # xgrammar refuses to fill a terminated matcher
    reqs = fake_reqs(ms)
    buf = torch.zeros((len(ms), 1536), dtype=torch.int32)
    filler = MaskFiller(buf, threads=2, budget_ms=None, max_requests=len(ms))
    try:
        filler.start(reqs).finish()
        with pytest.raises(Exception, match="terminated"):
            filler.fill(reqs)
        assert filler._started is None
        assert torch.equal(filler.fill(reqs[:-1]).bitmask, rows_of(ms[:-1]))
    finally:
        filler.close()


def test_fill_call_releases_the_gil(backend):
    """The prepared fill call drops the GIL (at once: its arguments are converted beforehand), so
    Python on another thread runs on while it fills. A thread that wakes from a sleep needs the
    GIL to go on; with the switch interval raised, a call holding the GIL would hold it back to
    the end."""
    import sys
    text = json.dumps({"name": "Bo Lee of the " * 8 + "Hills", "age": 7})
    ms, _ = matchers_along(backend, PERSON, text, 24)
    ms = ms * 160
    reqs = fake_reqs(ms)
    buf = torch.zeros((len(ms), 1536), dtype=torch.int32)
    filler = MaskFiller(buf, threads=1, budget_ms=None, max_requests=len(ms))
    interval = sys.getswitchinterval()
    try:
        worker = threading.Thread(target=filler.start(reqs).finish)
        sys.setswitchinterval(5.0)
        ticks = 0
        t0 = time.perf_counter()
        worker.start()
        while worker.is_alive() and time.perf_counter() - t0 < 10:
            time.sleep(0.0005)
            ticks += 1
        worker.join()
        assert ticks >= 3, ticks
        assert torch.equal(filler.fill(reqs).bitmask[:24], rows_of(ms[:24]))
    finally:
        sys.setswitchinterval(interval)
        filler.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_chain_fill_equals_the_tree_walk(backend, threads):
    """A speculative step's rows for grammar-guided chains (`MaskFiller.fill_chains`: a chain per
    thread on the pool) equal xgrammar's walk of each chain; a chain may end on the grammar's stop token (the row after it allows nothing); the
    matchers are where they were."""
    import numpy as np
    text = json.dumps({"name": "Bo Lee of the " * 4 + "Hills", "age": 7})
    ms, ids = matchers_along(backend, PERSON, text, 24)
    chains = [[ids[k - 1]] + ids[k:k + 1 + k % 7] for k in range(1, 24)]  # root (accepted) + 1..7 drafts
    ms = ms[1:]
    stop = backend.grammar.tokenizer_info.stop_token_ids[0]
    yes = backend.tokenizer.encode("yes", add_special_tokens=False)
    choice = backend.grammar.matcher(backend.grammar.compile(CHOICE))
    ms.append(choice)
    chains.append([0] + yes + [stop])  # the root stands for a token the matcher has taken
    N = 8
    before = rows_of(ms)
    expected = torch.full((len(ms) * N, 1536), 0x5A5A5A5A, dtype=torch.int32)
    for b, (m, chain) in enumerate(zip(ms, chains)):
        n = len(chain)
        nxt = torch.tensor([i + 1 for i in range(n - 1)] + [-1])
        m.traverse_draft_tree(nxt, torch.full((n,), -1), torch.tensor(chain), expected[b * N:b * N + n])
    expected[(len(ms) - 1) * N + len(chains[-1]) - 1] = 0  # after the stop token: nothing
    buf = torch.full_like(expected, 0x5A5A5A5A)
    filler = MaskFiller(torch.zeros((1, 1536), dtype=torch.int32), threads=threads, budget_ms=None, max_requests=1)
    try:
        filler.fill_chains(ms, [np.array(c) for c in chains], buf, [b * N for b in range(len(ms))],
                           frozenset(backend.grammar.tokenizer_info.stop_token_ids))
        assert torch.equal(buf, expected)
        assert torch.equal(rows_of(ms), before) and not choice.is_terminated()
    finally:
        filler.close()


def test_started_fill_accepts_the_last_tokens_first(backend):
    """`start(reqs, accept_reqs, accept_tokens)`: each accepting request takes its token before its row is filled (a
    request not among `reqs` only takes it); a refused token is reported once finished and leaves
    its matcher where it was."""
    text = json.dumps({"name": "Bo Lee of the " * 8 + "Hills", "age": 7})
    n = 12
    ms, ids = matchers_along(backend, PERSON, text, n)  # ms[k] has taken ids[:k]
    reqs = fake_reqs(ms)
    sampling, outside = reqs[:n - 1], reqs[n - 1]  # the last request does not sample this step
    zebra = backend.tokenizer.encode("zebra", add_special_tokens=False)[0]
    accepts = [(r, ids[k]) for k, r in enumerate(reqs) if k != 3]  # reqs[3] has no token this step
    accepts[1] = (reqs[1], zebra)  # refused after '{'
    buf = torch.full((len(sampling), 1536), 0x5A5A5A5A, dtype=torch.int32)
    filler = MaskFiller(buf, threads=2, budget_ms=None, max_requests=len(reqs))
    try:
        started = filler.start(sampling, [r for r, _ in accepts], [t for _, t in accepts])
        started.finish()
        assert started.refused == [(reqs[1], zebra)]
        after, _ = matchers_along(backend, PERSON, text, n + 1)
        expected = rows_of([after[k] if k in (1, 3) else after[k + 1] for k in range(len(sampling))])
        expected[1] = rows_of([ms[1]])[0]  # refused: filled from where it was
        expected[3] = rows_of([after[3]])[0]  # no token: filled from where it was
        assert torch.equal(filler.fill(sampling).bitmask, expected)
        assert torch.equal(rows_of([outside.matcher]), rows_of([after[n]]))  # took its token, no row
    finally:
        filler.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_grammar_complete_at_the_token_limit_ends_stop(tiny_llama_dir, overlap):
    """An answer whose grammar is complete on the last token max_tokens allows (a choice made, a
    JSON object closed) ends "stop", not "length": the answer is whole (the openai package's `parse`
    refused it as cut); one the limit cuts ends "length". On the sequential path, and beside a fill
    (where the matchers are looked at only after it: `test_engine_thread_calls_no_matcher_beside_a_fill`)."""
    eng = build(tiny_llama_dir, dtype="float32")
    try:
        started = overlapped(eng) if overlap else [1]
        specs = [GrammarSpec.choice(["maybe"]).with_backend("xgrammar"),
                 GrammarSpec.choice(["alpha beta gamma delta"]).with_backend("llguidance"),
                 GrammarSpec.choice(["alpha beta gamma delta"]).with_backend("xgrammar"), DIGITS.with_backend("xgrammar")]
        prompts = PROMPTS[:len(specs)]
        free = eng.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), specs)
        assert [o.finish_reason for o in free] == [FinishReason.STOP] * len(specs)
        lengths = [len(o.token_ids) - 1 for o in free]  # the grammar's stop token ends each
        at = eng.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in lengths], specs)
        assert [(o.text, o.finish_reason) for o in at] == [(o.text, FinishReason.STOP) for o in free]
        cut = [i for i, n in enumerate(lengths) if n > 1]
        assert cut
        short = eng.generate([prompts[i] for i in cut], [SamplingParams(max_tokens=lengths[i] - 1, temperature=0)
                                                         for i in cut], [specs[i] for i in cut])
        assert [o.finish_reason for o in short] == [FinishReason.LENGTH] * len(cut)
        assert started[0] > 0
    finally:
        eng.shutdown()

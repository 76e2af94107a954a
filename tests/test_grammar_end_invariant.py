"""The end-of-request invariant: a request with a grammar finishes "stop" only where its grammar may
end. An end anywhere else is an engine bug: counted, logged, and answered as an error (HTTP 500 with
an OpenAI-shaped body, or an error event in a stream), never as a 200 carrying invalid text.

No correct engine path reaches it (samples are masked; special tokens are never text), so the tests
make one: every token the grammar allows first is declared an EOS of the model."""
from __future__ import annotations

import json

import pytest
import torch

from constrained_spec.engine import Engine, EngineConfig
from constrained_spec.engine.request import FinishReason
from constrained_spec.grammar import GrammarSpec
from constrained_spec.sampling_params import SamplingParams

GRAMMAR = GrammarSpec.regex("[a-z]{40}")


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def broken_eos_engine(tiny_llama_dir, request):
    """An engine whose EOS set holds every token the grammar allows first (under either backend)."""
    engine = Engine(EngineConfig(model=tiny_llama_dir, device="cpu", dtype=torch.float32, max_running_requests=8,
                                 grammar_backend=request.param))
    matcher = engine.grammar.matcher(engine.grammar.compile(GRAMMAR))
    bitmask = engine.grammar.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    words = bitmask[0].numpy().view("uint32")
    allowed = [t for t in range(engine.grammar.vocab_size) if (int(words[t >> 5]) >> (t & 31)) & 1]
    assert allowed and not set(allowed) & engine.grammar_stop_ids
    engine.eos_token_ids |= set(allowed)
    yield engine
    engine.shutdown()


def test_an_end_the_grammar_refuses_is_an_error(broken_eos_engine):
    engine = broken_eos_engine
    before = engine.stats.grammar_end_violations
    out = engine.generate("Say something.", SamplingParams(max_tokens=8, temperature=0.0), GRAMMAR)[0]
    assert out.finish_reason is FinishReason.ERROR, (out.finish_reason, out.text)
    assert "before the grammar was complete" in out.error
    assert engine.stats.grammar_end_violations == before + 1
    # the same end without a grammar is an ordinary stop
    plain = engine.generate([out.token_ids[0]], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert plain.finish_reason is not FinishReason.ERROR
    assert engine.stats.grammar_end_violations == before + 1


def test_the_server_answers_it_as_an_error(broken_eos_engine):
    from fastapi.testclient import TestClient

    from constrained_spec.server.app import create_app

    engine = broken_eos_engine
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "temperature": 0, "regex": GRAMMAR.value}
    with TestClient(create_app(engine)) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "engine_error"
        assert "before the grammar was complete" in r.json()["error"]["message"]

        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
        assert finishes == []  # the error event ends the choice ("error" is no finish_reason of OpenAI's)
        assert events[-1]["error"]["code"] == "engine_error"

        metrics = client.get("/metrics").text
    count = [line for line in metrics.splitlines() if line.startswith("constrained_spec_grammar_end_violations")]
    assert count and float(count[0].split()[-1]) == engine.stats.grammar_end_violations >= 2

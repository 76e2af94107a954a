"""The mask audit (CONSTRAINED_SPEC_AUDIT_MASKS=1): sampled tokens checked against their host rows,
every grammar answer replayed on a fresh matcher; and each check catches what it is for."""
from __future__ import annotations

import json

import pytest
import torch

from constrained_spec.engine import Engine, EngineConfig
from constrained_spec.engine.mask_audit import ENV, outside_rows
from constrained_spec.grammar import GrammarSpec
from constrained_spec.sampling_params import SamplingParams

SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                     "required": ["name", "n"]})


def test_outside_rows_reads_the_bit_of_each_token():
    bitmask = torch.zeros(3, 4, dtype=torch.int32)
    bitmask[0, 1] = 1 << 5  # token 37
    bitmask[1, 3] = -(1 << 31)  # token 127 (the sign bit)
    bitmask[2].fill_(-1)
    assert outside_rows(bitmask, [0, 1, 2], [37, 127, 100]) == []
    assert outside_rows(bitmask, [0, 1, 2], [36, 126, 5]) == [0, 1]
    assert outside_rows(bitmask, [1], [37, 126]) == [1]
    assert outside_rows(bitmask, [], []) == []


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def audited(tiny_llama_dir, request):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, "1")
        engine = Engine(EngineConfig(model=tiny_llama_dir, device="cpu", dtype=torch.float32, max_running_requests=8,
                                     grammar_backend=request.param))
    yield engine
    engine.shutdown()


def test_audit_passes_masked_answers_and_catches_a_drifted_one(audited, caplog):
    engine, audit = audited, audited.audit
    assert audit is not None
    outs = engine.generate(["Name one thing.", "Count.", "A person:", "Hi"],
                           SamplingParams(max_tokens=24, temperature=0.9, seed=1), GrammarSpec.json_schema(SCHEMA))
    assert all(o.finish_reason.value in ("stop", "length") for o in outs)
    assert audit.steps_checked > 0 and audit.outside == 0
    assert audit.replays >= 4 and audit.diverged == 0
    # an output the grammar refuses (as a drifted matcher would let through) is reported
    req = type("R", (), {})()
    req.request_id, req.matcher = "r-bad", engine.grammar.matcher(engine.grammar.compile(GrammarSpec.json_schema(SCHEMA)))
    req.output_ids = engine.tokenizer.encode('{"name": "a\nb"', add_special_tokens=False)
    with caplog.at_level("ERROR"):
        audit.replay(req, "length")
    assert audit.diverged == 1 and "r-bad" in caplog.text

"""One request with an edge or bad value beside an ordinary running one (the Engine API, tiny random
model, CPU): the edge request is refused up front or served, and the ordinary request completes.
A value that passed validation and then failed on the engine's thread (the step's sampler, the
detokenizer) ended every request of that step with "internal error in the engine step" (QA 1129k:
a seed past int64 did; these are the rest of that class)."""
from __future__ import annotations

import pytest

from constrained_spec import Engine, GrammarSpec, SamplingParams
from constrained_spec.engine.engine import RequestError
from constrained_spec.engine.request import FinishReason

CONTEXT = 64  # short, so that requests run to the context's end quickly
ORDINARY = 12  # tokens the ordinary request makes


@pytest.fixture(scope="module", params=["plain", "ngram"])
def engine(request, tiny_llama_dir):
    spec = {"speculative_algorithm": "ngram", "speculative_policy": "always"} if request.param == "ngram" else {}
    eng = Engine(model=tiny_llama_dir, device="cpu", max_model_len=CONTEXT, **spec)
    yield eng
    eng.shutdown()


def _beside(eng: Engine, edge):
    """Runs `edge()` while an ordinary request is mid-answer; asserts that one completes normally.
    Returns what `edge()` returned."""
    running = eng.stream([5, 6, 7, 8], SamplingParams(max_tokens=ORDINARY, temperature=0, ignore_eos=True))
    assert not next(running).finished
    try:
        return edge()
    finally:
        last = list(running)[-1]
        assert (last.finish_reason, last.completion_tokens, last.error) == (FinishReason.LENGTH, ORDINARY, None), last


def _one(eng: Engine, params: SamplingParams, grammar=None, prompt=(5, 6, 7)):
    return _beside(eng, lambda: eng.generate([list(prompt)], params, grammar)[0])


# -- refused up front (each failed the step of every request batched with it) --------------------

@pytest.mark.parametrize("fields, says", [
    ({"logprobs": 2.5}, "logprobs must be an integer"),  # torch's topk took no float
    ({"logprobs": True}, "logprobs must be an integer"),  # nor a bool
    ({"stop": [b"}"]}, "stop must be a string or a list of strings"),  # the detokenizer's str.find
    ({"stop": ["a", ["b"]]}, "stop must be a string or a list of strings"),
    ({"stop_token_ids": 2}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": [2.5]}, "stop_token_ids must be a list of token ids"),
    # QA 1130 D8: a TypeError from the comparison, or taken and run
    ({"temperature": "0.5"}, "temperature must be a number"), ({"temperature": None}, "temperature must be a number"),
    ({"top_p": "x"}, "top_p must be a number"), ({"min_p": True}, "min_p must be a number"),
    ({"presence_penalty": "1"}, "presence_penalty must be a number"),
    ({"top_k": 2.5}, "top_k must be -1"),
    ({"top_k": True}, "top_k must be -1"), ({"prediction": [True]}, "prediction must be a list of token ids"),
    ({"ignore_eos": "yes"}, "ignore_eos must be True or False"), ({"stop": [""]}, "stop strings must not be empty"),
])
def test_values_the_step_cannot_take_are_refused_up_front(engine, fields, says):
    with pytest.raises(ValueError, match=says):
        SamplingParams(max_tokens=3, **fields)
    # set after construction: the engine checks again when the request is queued
    params = SamplingParams(max_tokens=3)
    for name, value in fields.items():
        setattr(params, name, value)
    with pytest.raises(ValueError, match=says):
        _beside(engine, lambda: engine.generate([[5, 6, 7]], params))


def test_a_boolean_max_tokens_is_refused():
    with pytest.raises(ValueError, match="max_tokens must be an integer"):  # (it ran 1 token)
        SamplingParams(max_tokens=True)


def test_params_of_another_type_are_refused_up_front(engine):
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        _beside(engine, lambda: engine.generate([[5, 6, 7]], {"max_tokens": 3}))


def test_none_for_stop_and_stop_token_ids_is_none(engine):
    """stop_token_ids=None passed and failed the step (`token in None`); stop=None was refused
    with "object of type 'NoneType' has no len()". Both are the field's default, as over HTTP."""
    out = _one(engine, SamplingParams(max_tokens=4, ignore_eos=True, stop=None, stop_token_ids=None))
    assert (out.finish_reason, out.completion_tokens) == (FinishReason.LENGTH, 4), out
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    params.stop_token_ids = None  # set after construction
    out = _one(engine, params)
    assert (out.finish_reason, out.completion_tokens) == (FinishReason.LENGTH, 4), out


# -- edge values that are served ------------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    {"temperature": 2e-5, "seed": -2**63},  # just past greedy; the smallest seed
    {"temperature": 2.0, "seed": 2**63 - 1, "top_p": 0.0},
    {"temperature": 1.0, "min_p": 1.0, "top_k": 1},
    {"temperature": 1.0, "top_k": 2**70},
    {"frequency_penalty": 2.0, "presence_penalty": -2.0},
    {"logit_bias": {t: 100.0 if t % 2 else -100.0 for t in range(1024)}},
    {"logprobs": 0}, {"logprobs": 20},
    {"stop": [("\u00e9\U0001F600" * 40) + str(i) for i in range(16)]},  # 16 long unicode strings
    {"stop": ["\ud800", "ab", "abc", "b"]},  # a lone surrogate, overlapping strings
    {"stop_token_ids": [2, 0, 5]},
    {"prediction": []},
    {"prediction": [(7 * i) % 49000 + 10 for i in range(20000)]},  # far longer than the context
])
def test_edge_sampling_values_are_served(engine, fields):
    out = _one(engine, SamplingParams(max_tokens=6, ignore_eos=True, **fields))
    assert out.error is None and out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP), out
    assert 1 <= out.completion_tokens <= 6, out
    if fields.get("logprobs") is not None:
        assert len(out.logprobs) == len(out.token_ids), out


@pytest.mark.parametrize("prompt_len, max_tokens", [(CONTEXT - 1, 5), (CONTEXT - 2, 10**30), (CONTEXT - 9, 50)])
def test_prompts_at_the_context_end_end_at_it(engine, prompt_len, max_tokens):
    out = _one(engine, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
               prompt=[5, 6, 7] * (prompt_len // 3) + [5] * (prompt_len % 3))
    assert (out.finish_reason, out.completion_tokens) == (FinishReason.LENGTH, CONTEXT - prompt_len), out
    with pytest.raises(RequestError, match="context"):
        _one(engine, SamplingParams(max_tokens=1), prompt=[5] * CONTEXT)


@pytest.mark.parametrize("grammar, texts", [
    (GrammarSpec.regex("a{0}"), {""}),  # only the empty string
    (GrammarSpec.ebnf('root ::= ""'), {""}),
    (GrammarSpec.regex("a"), {"a"}),  # a single token
    (GrammarSpec.choice(["<|im_end|>", "x"]), {"<|im_end|>", "x"}),  # a special token's text, as text
    (GrammarSpec.ebnf('root ::= "<|im_end|>"'), {"<|im_end|>"}),
])
def test_grammars_of_one_string_or_none_are_served(engine, grammar, texts):
    out = _one(engine, SamplingParams(max_tokens=16), grammar)
    assert (out.finish_reason, out.error) == (FinishReason.STOP, None) and out.text in texts, out


def test_n16_with_a_grammar_and_max_tokens_1(engine):
    def edge():
        many = engine.generate([[5, 6, 7]] * 16, [SamplingParams(max_tokens=20, seed=i) for i in range(16)],
                               GrammarSpec.json_object())
        one = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=1), GrammarSpec.regex("[a-z]{5}"))[0]
        return many, one
    many, one = _beside(engine, edge)
    assert all(o.error is None and o.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) for o in many), many
    assert one.error is None and one.completion_tokens == 1, one

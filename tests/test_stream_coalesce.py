"""A stream whose front-end fell behind sends a choice's updates of several steps as one event."""
from constrained_spec.engine.request import FinishReason, RequestOutput
from constrained_spec.server.generation import coalesce


def _out(text, ids, finished=False, logprobs=None, n=0):
    return RequestOutput("r", text, ids, finished, FinishReason.LENGTH if finished else None, None, 3, n, logprobs)


def test_updates_of_one_choice_join_in_order():
    items = [(0, _out("a", [1], logprobs=[{"logprob": -1.0}], n=1)), (1, _out("x", [7], n=1)),
             (0, _out("b", [2], logprobs=[{"logprob": -2.0}], n=2)), (0, _out("c", [3], True, [{"logprob": -3.0}], 3))]
    joined = dict(coalesce(items))
    assert list(joined) == [0, 1]
    a = joined[0]
    assert (a.new_text, a.new_token_ids, a.finished, a.finish_reason, a.completion_tokens) == \
        ("abc", [1, 2, 3], True, FinishReason.LENGTH, 3)
    assert [lp["logprob"] for lp in a.logprobs] == [-1.0, -2.0, -3.0]
    assert joined[1].new_text == "x" and joined[1].logprobs is None


def test_an_update_alone_is_kept_as_it_is():
    out = _out("a", [1])
    assert coalesce([(0, out)]) == [(0, out)]

"""What the server's refusals say, checked without a model: the 503's pending limit (the server's,
not a front-end's share), the `param` of the functions and best_of 400s, and the Responses routes'
params in the dotted form the rest of the API uses (docs/api.md, Errors)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from constrained_spec.server import responses
from constrained_spec.server.app import ServerConfig
from constrained_spec.server.errors import APIError
from constrained_spec.server.json_io import parse
from constrained_spec.server.protocol import ChatCompletionRequest, CompletionRequest
from constrained_spec.server.service import Service


class _Tokenizer:
    vocab_size = 100

    def __len__(self):
        return 100

    def get_vocab(self):
        return {f"t{i}": i for i in range(100)}


def _service(**server) -> Service:
    """A Service over an engine stand-in (all admit() reads: its model name and limits)."""
    engine = SimpleNamespace(model_name="m", tokenizer=_Tokenizer(), max_context=64,
                             config=SimpleNamespace(max_held_requests=8))
    return Service(engine, ServerConfig(**server))


def _busy(service: Service) -> str:
    with pytest.raises(APIError) as e:
        while True:
            service.admit(1)
    assert e.value.status == 503 and e.value.code == "server_busy"
    return e.value.message


def test_busy_names_the_servers_limit_split_over_front_ends():
    """--max-pending-requests 2 --frontends 2: it said 'its limit of 1 pending requests'."""
    service = _service(max_pending_requests=2, frontends=2)
    service.admit(1)
    message = _busy(service)
    assert service.state.pending == 1  # each front-end admits its share
    assert message == ("the server is at its limit of 2 pending requests (1 in each of its 2 front-end "
                       "processes); retry later"), message


def test_busy_default_limit_with_front_ends():
    service = _service(frontends=3)  # the engine's 8 running + queued, 3 each
    assert "its limit of 8 pending requests (3 in each of its 3 front-end processes)" in _busy(service)
    assert service.state.pending == 3


def test_busy_one_front_end():
    service = _service(max_pending_requests=2)
    assert _busy(service) == "the server is at its limit of 2 pending requests; retry later"
    assert service.state.pending == 2


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("cls, body, param, code", [
    (ChatCompletionRequest, {"messages": HI, "functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    (CompletionRequest, {"prompt": "hi", "best_of": 3}, "best_of", "unsupported_parameter"),
    (CompletionRequest, {"prompt": "hi", "best_of": 3, "n": 2}, "best_of", "unsupported_parameter"),
    (CompletionRequest, {"prompt": "hi", "echo": True}, "echo", "unsupported_parameter"),
    # answered in text alone, they got no error and no audio
    (ChatCompletionRequest, {"messages": HI, "modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
    (ChatCompletionRequest, {"messages": HI, "audio": {"voice": "alloy", "format": "wav"}}, "audio",
     "unsupported_parameter"),
    # matched nothing, silently (OpenAI refuses it)
    (ChatCompletionRequest, {"messages": HI, "stop": ["\n", ""]}, "stop", "invalid_value"),
    (CompletionRequest, {"prompt": "hi", "stop": ""}, "stop", "invalid_value"),
])
def test_refused_fields_are_named(cls, body, param, code):
    with pytest.raises(APIError) as e:
        parse(cls, body)
    assert e.value.status == 400 and (e.value.param, e.value.code) == (param, code), e.value.body()


def test_text_is_a_modality_taken():
    assert parse(ChatCompletionRequest, {"messages": HI, "modalities": ["text"]}).modalities == ["text"]


@pytest.mark.parametrize("field, value", [("background", True), ("conversation", "conv_1"),
                                          ("conversation", {"id": "conv_1"})])
def test_responses_fields_that_would_change_the_answer_are_refused(field, value):
    """Ignored, a background request ran in the foreground and a conversation's state was dropped."""
    with pytest.raises(APIError) as e:
        responses.parse({"model": "m", "input": "hi", field: value})
    assert (e.value.status, e.value.param, e.value.code) == (400, field, "unsupported_parameter"), e.value.body()
    assert responses.parse({"model": "m", "input": "hi", "background": False}).input == "hi"


def test_best_of_up_to_n_is_taken():
    assert parse(CompletionRequest, {"prompt": "hi", "best_of": 2, "n": 2}).best_of == 2


@pytest.mark.parametrize("data, param, code", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content",
     "unsupported_parameter"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "reasoning"}]}, "input.1", "unsupported_parameter"),
    ({"input": [{"role": "wizard", "content": "a"}]}, "input.0", "invalid_request"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}, {"type": "web_search"}]}, "tools.1",
     "unsupported_parameter"),
])
def test_responses_params_are_dotted(data, param, code):
    """They were `input[0]` and `tools[0]`, where errors elsewhere say `tools.0.name`."""
    req = responses.parse({"model": "m", **data})
    with pytest.raises(APIError) as e:
        responses.chat_request(req, data)
    assert (e.value.param, e.value.code) == (param, code), e.value.body()
    assert e.value.message.startswith(param + " ") or e.value.message.startswith(param + "."), e.value.message


def test_seeds_are_int64_whatever_n():
    """A seed past int64 (or int64's last with n = 2: the second choice's seed + 1) passed, then
    failed the engine step's seed array: a 500 for the request and every request batched with it."""
    from constrained_spec.server.request_params import RequestParams
    params = RequestParams(vocab=100, max_context=64, default_max_tokens=None)
    chat = lambda **kw: parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **kw})
    seeds = [p.seed for p in params.sampling(chat(seed=2**63 - 1, n=3), 4, None)]
    assert seeds == [2**63 - 1, -2**63, -2**63 + 1]
    for seed in (2**63, -2**63 - 1, 2**64):
        with pytest.raises(APIError) as e:
            params.sampling(chat(seed=seed), 4, None)
        assert e.value.status == 400 and e.value.param == "seed", e.value.body()


@pytest.mark.parametrize("cls, body, param", [
    (ChatCompletionRequest, {"temperature": True}, "temperature"), (ChatCompletionRequest, {"top_p": "0.5"}, "top_p"),
    (ChatCompletionRequest, {"min_p": "0.1"}, "min_p"), (ChatCompletionRequest, {"presence_penalty": False}, "presence_penalty"),
    (ChatCompletionRequest, {"logit_bias": {"5": True}}, "logit_bias.5"),
    (ChatCompletionRequest, {"stop_token_ids": [True]}, "stop_token_ids.0"),
    (CompletionRequest, {"prompt": [True]}, "prompt.0"), (CompletionRequest, {"prompt": [[1, 2.0]]}, "prompt.0.1"),
    (CompletionRequest, {"prompt": "x", "best_of": 0}, "best_of")])
def test_numbers_are_numbers(cls, body, param):
    """true, "0.5" or 2.0 where a number or a token id goes were read as 1, 0.5 and 2 (pydantic's lax
    mode); OpenAI answers a 400 for them."""
    base = {"messages": [{"role": "user", "content": "hi"}]} if cls is ChatCompletionRequest else {}
    with pytest.raises(APIError) as e:
        parse(cls, {**base, **body})
    assert e.value.status == 400 and e.value.param == param, e.value.body()
    assert parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "temperature": 1,
                                         "logit_bias": {"5": 10}}).temperature == 1.0


def test_logit_bias_keys_are_token_ids_in_digits():
    from constrained_spec.server.request_params import RequestParams
    params = RequestParams(vocab=100, max_context=64, default_max_tokens=None)
    assert params.logit_bias({"5": 1.0, "0": -2}) == {5: 1.0, 0: -2}
    for key in ("+1", "1_0", "\u0661", " 1", "-1", "100"):  # int() read the first four as ids
        with pytest.raises(APIError, match="is not a token id"):
            params.logit_bias({key: 1.0})


def test_stop_strings_have_a_length_limit():
    """Each token's text is searched for every stop string over the last (longest - 1) characters:
    16 stops of 500 KB made every token of the answer a search of megabytes on a front-end's
    reader thread, which serves all its requests."""
    from constrained_spec.server.request_params import RequestParams
    params = RequestParams(vocab=100, max_context=64, default_max_tokens=None)
    chat = lambda stop: parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "stop": stop})
    assert params.sampling(chat(["x" * 4096]), 4, None)[0].stop == ["x" * 4096]
    with pytest.raises(APIError) as e:
        params.sampling(chat(["a", "x" * 4097]), 4, None)
    assert e.value.status == 400 and e.value.param == "stop" and "4096 characters" in e.value.message

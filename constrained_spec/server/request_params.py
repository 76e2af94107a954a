"""What a validated request asks of the engine: its sampling parameters (one per choice, each with
its own seed) and its token budget. A value the engine would refuse is a 400 naming the field."""
from __future__ import annotations

from ..sampling_params import SamplingParams, choice_seed
from .errors import APIError, bad_request
from .protocol import _GenerationRequest

_SAMPLING_FIELDS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "top_k", "min_p")


class RequestParams:
    def __init__(self, vocab: int, max_context: int, default_max_tokens: int | None):
        self.vocab = vocab  # token ids lie below this
        self.max_context = max_context
        self.default_max_tokens = default_max_tokens

    def sampling(self, req: _GenerationRequest, max_tokens: int, logprobs: int | None,
                 prediction: list[int] | None = None) -> list[SamplingParams]:
        """One SamplingParams per choice (`n`): choice i samples with seed + i (random seeds when the
        request sets none). `prediction`: the tokens of the request's predicted output."""
        kw = dict(max_tokens=max_tokens, stop=req.stop_list(), logprobs=logprobs, ignore_eos=req.ignore_eos,
                  stop_token_ids=list(req.stop_token_ids or []), prediction=prediction or None)
        kw.update((name, getattr(req, name)) for name in _SAMPLING_FIELDS if getattr(req, name) is not None)
        if req.logit_bias:
            kw["logit_bias"] = self.logit_bias(req.logit_bias)
        self.check_token_ids(kw["stop_token_ids"], "stop_token_ids")
        try:
            return [SamplingParams(**kw, seed=None if req.seed is None else choice_seed(req.seed, i)) for i in range(req.n)]
        except ValueError as e:
            raise bad_request(str(e), param=str(e).split(" ", 1)[0], code="invalid_value")

    def logit_bias(self, bias: dict[str, float]) -> dict[int, float]:
        """OpenAI's logit_bias (token ids as JSON object keys) with integer keys, each a token id."""
        out = {}
        for key, value in bias.items():
            # digits only: int() also reads "+1", "1_0", " 1" and other scripts' digits ("١")
            token = int(key) if key.isascii() and key.isdigit() else -1
            if not 0 <= token < self.vocab:
                raise bad_request(f"logit_bias key {key!r} is not a token id (0 to {self.vocab - 1})",
                                  param="logit_bias", code="invalid_value")
            out[token] = value
        return out

    def token_budget(self, prompt_len: int, requested: int | None, param: str) -> int:
        """The completion's token limit: what the request asks (else the server's default, else the
        rest of the context), clamped to the context left after the prompt."""
        if prompt_len >= self.max_context:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context holds {self.max_context} "
                                f"tokens (prompt plus completion)", param=param, code="context_length_exceeded")
        room = self.max_context - prompt_len
        if requested is None:
            requested = self.default_max_tokens or room
        return max(1, min(requested, room))

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if t < 0 or t >= self.vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary", param=param, code="invalid_value")

"""Per-request decoding parameters (OpenAI names where OpenAI has one)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_CHARS = 4096
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1  # a seed's range: the sampler hashes it as an int64


def choice_seed(seed: int, choice: int) -> int:
    """Choice `choice` of a request with `seed` samples with seed + choice, wrapped into int64 (a
    seed of 2**63 - 1 and n = 2 is two valid seeds)."""
    return (seed + choice - INT64_MIN) % 2**64 + INT64_MIN


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token; None: none
    # added to the logits of these token ids before sampling (OpenAI's logit_bias: -100 all but bans
    # a token, 100 all but forces it); a grammar's mask still decides which tokens may come at all
    logit_bias: dict[int, float] | None = None
    # OpenAI's Predicted Outputs, as token ids: text the answer is expected to repeat (a document
    # being edited). It changes only speed: the n-gram drafter drafts from it as from the prompt.
    prediction: list[int] | None = None

    def __post_init__(self):
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether the request changes its logits before sampling (penalties, logit biases): steps
        that cannot apply that (graphed sampling, speculative verification) leave it out."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)

    def validate(self) -> None:
        """Refuses (ValueError) what the engine's step could not take. The engine calls it again for
        every request it queues (a field set after construction, params unpickled): a value that
        passed and then failed on the engine's thread failed every request of the step with it.
        A stop string alone becomes a list of one; None for `stop` or `stop_token_ids`, none."""
        def need(ok: bool, name: str, what: str):
            if not ok:
                raise ValueError(f"{name} {what}")

        if self.stop is None or isinstance(self.stop, str):
            self.stop = [] if self.stop is None else [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []

        need(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        # numbers, not strings or None (a TypeError from the comparison, QA 1130) nor booleans
        need(_is_number(self.temperature) and 0.0 <= self.temperature <= 2.0, "temperature", "must be a number in [0, 2]")
        need(_is_number(self.top_p) and 0.0 <= self.top_p <= 1.0, "top_p",
             "must be a number in [0, 1]")  # 0 keeps the most likely token alone
        need(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", "must be -1 (off) or an integer >= 1")
        need(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be a number in [0, 1]")
        need(_is_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             "must be a number in [-2, 2]")
        need(_is_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             "must be a number in [-2, 2]")
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be True or False")
        need(self.logprobs is None or _is_int(self.logprobs) and 0 <= self.logprobs <= 20, "logprobs",
             "must be an integer in [0, 20]")  # (a float or a bool failed the step's topk)
        need(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop), "stop",
             "must be a string or a list of strings")  # (bytes failed the detokenizer's search)
        need(all(self.stop), "stop", "strings must not be empty")  # (matched nothing; the HTTP API refuses them)
        need(len(self.stop) <= 16, "stop", "may hold at most 16 strings")
        # every token's text is searched for each of them over the last (longest - 1) characters
        need(all(len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
             f"strings may be at most {MAX_STOP_CHARS} characters long")
        need(isinstance(self.stop_token_ids, (list, tuple, set, frozenset))
             and all(_is_int(t) for t in self.stop_token_ids), "stop_token_ids", "must be a list of token ids")
        need(self.seed is None or _is_int(self.seed)
             and INT64_MIN <= self.seed <= INT64_MAX, "seed", "must be a 64-bit signed integer")
        if self.logit_bias is not None:
            self._validate_logit_bias(need)
        if self.prediction is not None:
            need(isinstance(self.prediction, list) and all(_is_int(t) and t >= 0 for t in self.prediction),
                 "prediction", "must be a list of token ids")

    def _validate_logit_bias(self, need) -> None:
        bias = self.logit_bias
        need(isinstance(bias, dict), "logit_bias", "must map token ids to biases")
        need(len(bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias", f"may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens")
        for token, value in bias.items():  # (the messages built only for a refusal: 1,024 of them took 1.3 ms)
            if not (_is_int(token) and token >= 0):
                need(False, "logit_bias", f"keys must be token ids (integers >= 0), not {token!r}")
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and -100.0 <= value <= 100.0):
                need(False, "logit_bias", f"values must be in [-100, 100], not {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

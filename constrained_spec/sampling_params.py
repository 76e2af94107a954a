"""Per-request decoding parameters (OpenAI names where OpenAI has one)."""
from __future__ import annotations

from dataclasses import dataclass, field


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

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5 or self.top_k == 1

    def validate(self) -> None:
        def need(ok: bool, name: str, what: str):
            if not ok:
                raise ValueError(f"{name} {what}")

        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        need(0.0 <= self.temperature <= 2.0, "temperature", "must be in [0, 2]")
        need(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        need(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1")
        need(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        need(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]")
        need(len(self.stop) <= 16, "stop", "may hold at most 16 strings")

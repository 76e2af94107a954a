"""What the scheduler hands the model runner for one step."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..attention.base import ForwardMode
from .request import Request


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    requests: list[Request]
    num_new_tokens: list[int]  # per request: prompt-chunk length (EXTEND) or 1 (DECODE)
    samples: list[bool]  # per request: does this step produce its next token?
    # filled by the runner:
    sample_index: list[int] = field(default_factory=list)  # positions in `requests` that sample
    _sampling: tuple | None = field(default=None, repr=False)  # (requests, sample_index, their list)

    @property
    def size(self) -> int:
        return len(self.requests)

    def sampling_requests(self) -> list[Request]:
        """The requests that sample this step, in order: one list per step (several parts of a step
        ask for it, and the grammar fill recognizes its requests by this list's identity); made
        anew when `requests` or `sample_index` are replaced. Do not modify it."""
        cached = self._sampling
        if cached is None or cached[0] is not self.requests or cached[1] is not self.sample_index:
            cached = (self.requests, self.sample_index, [self.requests[i] for i in self.sample_index])
            self._sampling = cached
        return cached[2]

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

    @property
    def size(self) -> int:
        return len(self.requests)

    def sampling_requests(self) -> list[Request]:
        return [self.requests[i] for i in self.sample_index]

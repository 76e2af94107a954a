"""Counters the engine keeps for /metrics and benchmarks (read from other threads: plain numbers)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    steps: int = 0
    extend_steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    forced_tokens: int = 0
    finished: dict = field(default_factory=dict)  # finish reason -> count
    grammar_mask_seconds: float = 0.0  # engine-thread time in bitmask fills (beside other work or not)
    grammar_accept_seconds: float = 0.0  # engine-thread time accepting decode steps' tokens into matchers
    grammar_end_violations: int = 0  # requests that ended where their grammar could not (engine bugs)
    grammar_late_rows: int = 0  # rows whose mask missed the step's budget (their request sat the step out)
    step_seconds: float = 0.0
    decode_requests: int = 0  # requests summed over decode steps: / decode_steps = the mean decode batch
    idle_seconds: float = 0.0  # the loop waiting for work (no request could run), waits ended so far
    # the loop blocked on a step's results from the device: near none a step, the host's work is what
    # paces the steps (more of it makes every step longer); a large share, the device's is
    device_wait_seconds: float = 0.0
    # a request's time to its first token in two parts, summed over `first_tokens` requests: waiting
    # to be admitted (queue), then from admission to its first token (its prefill, and the step
    # in flight when it was admitted)
    first_tokens: int = 0
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    idle_since: float | None = None  # perf_counter() when the wait in progress began
    ttft: deque = field(default_factory=lambda: deque(maxlen=4096))  # recent time-to-first-token samples
    tpot: deque = field(default_factory=lambda: deque(maxlen=4096))  # recent time-per-output-token samples
    listeners: list = field(default_factory=list)  # callables(event, request) for /metrics

    def wait_for_device(self, wait):
        """`wait()` (a step's results read, or an event waited for), its time counted as the loop's
        wait for the device."""
        t0 = time.perf_counter()
        out = wait()
        self.device_wait_seconds += time.perf_counter() - t0
        return out

    def on_step(self, batch, seconds: float) -> None:
        self.steps += 1
        self.step_seconds += seconds
        if batch.mode.value == "decode":
            self.decode_steps += 1
            self.decode_requests += len(batch.requests)
        else:
            self.extend_steps += 1

    def idle_total(self) -> float:
        """Seconds the loop has waited for work, the wait in progress included (a reader between
        two snapshots counts only the time between them)."""
        since = self.idle_since
        return self.idle_seconds + (time.perf_counter() - since if since is not None else 0.0)

    def on_first_token(self, req) -> None:
        self.ttft.append(req.first_token_time - req.arrival)
        admitted = req.admitted_time if req.admitted_time is not None else req.arrival
        self.first_tokens += 1
        self.queue_seconds += admitted - req.arrival
        self.prefill_seconds += req.first_token_time - admitted
        for fn in self.listeners:
            fn("first_token", req)

    def on_finish(self, req) -> None:
        reason = req.finish_reason.value
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.prompt_tokens += len(req.prompt_ids)
        self.generated_tokens += len(req.output_ids)
        if req.first_token_time is not None and len(req.output_ids) > 1:
            self.tpot.append((time.monotonic() - req.first_token_time) / (len(req.output_ids) - 1))
        for fn in self.listeners:
            fn("finish", req)

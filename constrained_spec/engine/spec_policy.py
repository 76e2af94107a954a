"""Speculate or decode plainly: the engine's default speculative policy, per batch-size bucket, by
measured throughput (docs/architecture.md, "Speculative decoding")."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MeasuredPolicy"]


@dataclass
class _Arm:
    """Measured throughput of one way of decoding a batch-size bucket (exponential moving averages)."""
    step_tokens: float = 0.0
    step_seconds: float = 0.0
    samples: int = 0  # timed steps
    token_samples: int = 0  # steps whose tokens were counted (every step that ran as decided)

    @property
    def tokens_per_s(self) -> float:
        return self.step_tokens / self.step_seconds if self.step_seconds > 0 else 0.0


class MeasuredPolicy:
    """Speculate or decode plainly, per batch-size bucket, by measured throughput.

    A decode step is timed from its decision to the next decision, kept only when the engine ran
    exactly that one step in between and the step before it was of the same arm and bucket; its
    tokens/s (B for a plain step, B + accepted drafts for a speculative one) go into the bucket's
    average for that arm. This measures what speculation really costs at that batch size, the
    CPU's drafting and grammar work included. An arm's throughput is the ratio of two moving
    averages, tokens per step over seconds per step; tokens move more slowly (`token_smoothing`):
    acceptance comes in phases (a JSON key's tokens are drafted right, a free-text value's are
    not) and a short re-measurement lands in one phase, so a fast average of it flips the decision
    on whichever phase was sampled last. Steps right after a switch are not samples: with the
    overlap scheduler a plain step's interval ends before its device work does, so the step after
    it absorbs the rest (a speculative step after a plain one looks slow, a plain one after a
    speculative one looks fast); their tokens still count (what a speculative step emits does not
    depend on what ran before it, and re-measurements are short: measured on the H100, counting
    only clean steps left a cold start's low acceptance in the average for whole requests). Once
    an arm is measured, a timed step counts as at most `outlier` times its average (a host hiccup
    is not the arm's cost). Each arm is first measured for `min_samples` samples (the first
    speculative step of a request also feeds its prompt to the drafter); then the faster arm runs,
    and the slower one is measured again for `explore_steps` steps once the bucket has run
    `explore_ratio` times as long as that takes, so re-measuring costs about 1/explore_ratio of the time.
    """

    def __init__(self, explore_ratio: float = 20.0, smoothing: float = 0.25, min_samples: int = 4,
                 explore_steps: int = 3, token_smoothing: float = 0.03, outlier: float = 2.0):
        self.explore_ratio, self.smoothing, self.min_samples = explore_ratio, smoothing, min_samples
        self.token_smoothing = token_smoothing
        self.explore_steps = explore_steps
        self.outlier = outlier
        self.arms: dict[tuple[int, bool], _Arm] = {}  # (bucket, speculative) -> measurements
        self._elapsed: dict[int, float] = {}  # bucket -> seconds run since its slower arm was measured
        self._streak: dict[int, tuple[bool, int]] = {}  # bucket -> (arm being re-measured, steps left)
        self._last: tuple[int, bool] | None = None  # the (bucket, arm) of the step decided last
        self._open: list | None = None  # [(bucket, speculative), start, engine step count, tokens, clean]

    def choose(self, batch_size: int, now: float, engine_steps: int) -> bool:
        self._close(now, engine_steps)
        bucket = 1 << (batch_size - 1).bit_length()
        spec, plain = self.arms.get((bucket, True)), self.arms.get((bucket, False))
        streak = self._streak.pop(bucket, None)
        if streak is not None:
            speculate, left = streak
            if left > 1:
                self._streak[bucket] = (speculate, left - 1)
        elif spec is None or spec.samples < self.min_samples:
            speculate = True  # measure speculation first, then plain decoding
        elif plain is None or plain.samples < self.min_samples:
            speculate = False
        else:
            faster = spec.tokens_per_s >= plain.tokens_per_s
            slower = plain if faster else spec
            speculate = faster
            if self._elapsed.get(bucket, 0.0) >= self.explore_ratio * self.explore_steps * slower.step_seconds:
                speculate = not faster
                self._elapsed[bucket] = 0.0
                if self.explore_steps > 1:
                    self._streak[bucket] = (speculate, self.explore_steps - 1)
        key = (bucket, speculate)
        self._open = [key, now, engine_steps, 0 if speculate else batch_size, self._last == key]
        self._last = key
        return speculate

    def add_tokens(self, n: int) -> None:
        """What the speculative step just run emitted."""
        if self._open is not None:
            self._open[3] += n

    def forget_open(self) -> None:
        """The step decided last did not run as decided (e.g. another rule overruled it)."""
        self._open = self._last = None

    def _close(self, now: float, engine_steps: int) -> None:
        if self._open is None:
            return
        key, start, steps, tokens, clean = self._open
        self._open = None
        if tokens <= 0:
            return  # nothing was emitted (the batch finished before the step ran)
        arm = self.arms.get(key)
        if arm is None:
            arm = self.arms[key] = _Arm()
        # plain means over the first samples, then EMAs
        arm.token_samples += 1
        arm.step_tokens += max(self.token_smoothing, 1.0 / arm.token_samples) * (tokens - arm.step_tokens)
        if not clean or engine_steps != steps + 1 or now <= start:
            return  # after a switch, or another step ran in between (a prefill): not a timing
        seconds = now - start
        if arm.samples >= self.min_samples:
            # A step far slower than its arm's average is a hiccup of the host (a garbage
            # collection, a grammar compile holding the GIL), not the arm's cost: unclipped, one
            # 20 ms pause quadrupled the speculative arm's average on the H100 and sent the
            # bucket to plain decoding for hundreds of steps.
            seconds = min(seconds, self.outlier * arm.step_seconds)
        arm.samples += 1
        arm.step_seconds += max(self.smoothing, 1.0 / arm.samples) * (seconds - arm.step_seconds)
        self._elapsed[key[0]] = self._elapsed.get(key[0], 0.0) + seconds

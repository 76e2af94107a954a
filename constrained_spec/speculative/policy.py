"""Speculate or decode plainly: the engine's default speculative policy, per batch-size bucket, by
measured throughput (docs/architecture.md, "Speculative decoding")."""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["MeasuredPolicy"]


@dataclass
class _Arm:
    """Measured seconds per step of one way of decoding a batch-size bucket: the median of its
    recent timings."""
    step_seconds: float = 0.0
    samples: int = 0  # timed steps (a borrowed arm counts as measured: `MeasuredPolicy._borrow`)
    borrowed: bool = False  # an estimate from another bucket until this bucket's first timing
    recent: deque = field(default_factory=deque)  # the last timings, oldest first

    def add(self, seconds: float, window: int) -> None:
        if self.borrowed:  # the bucket's own first timing replaces the borrowed estimate
            self.recent.clear()
            self.borrowed = False
        else:
            self.samples += 1
        self.recent.append(seconds)
        if len(self.recent) > window:
            self.recent.popleft()
        self.step_seconds = statistics.median(self.recent)


class MeasuredPolicy:
    """Speculate or decode plainly, per batch-size bucket, by measured throughput.

    Per bucket two things are measured. Acceptance: the tokens a speculative step emits per request
    (accepted drafts + the bonus token), a moving average that moves slowly (`token_smoothing`):
    acceptance comes in phases (a JSON key's tokens are drafted right, a free-text value's are not)
    and a short re-measurement lands in one phase, so a fast average would flip the decision on
    whichever phase was sampled last. And step time per arm (what speculation really costs at that
    batch size, the CPU's drafting and grammar work included): a decode step is timed from its
    decision to the next decision, kept only when the engine ran exactly that one step in between
    and the step before it was of the same arm and bucket. Steps right after a switch are not
    timings: with the overlap scheduler a plain step's interval ends before its device work does,
    so the step after it absorbs the rest (a speculative step after a plain one looks slow, a plain
    one after a speculative one fast); their tokens still count. An arm's step time is the median of
    its last `window` timings, not an average: step timings have a long tail (host hiccups) that pulls
    an average up faster than normal steps pull it back, and a hiccup is not the arm's cost.

    Per request, speculation gives `acceptance / spec seconds` tokens/s against `1 / plain seconds`.
    A bucket measures each arm for `min_samples` timings first (speculation first: its first step
    also feeds the prompt to the drafter), unless its decision follows from a bucket measured
    already: speculation's cost grows with the batch faster than plain decoding's (drafts and
    grammar masks per request on the host), so where a smaller bucket decodes plainly a larger one
    does too, and where a larger bucket speculates a smaller one does too. Such a bucket starts
    from that bucket's measurements, and each arm's first own timing replaces the borrowed one.

    Then the faster arm runs, and the slower one is re-measured for `explore_steps` steps once the
    bucket has run long enough that doing so costs about `explore_cost` of its throughput: an
    explored step loses (1 - slower/faster) of a step, so arms that are close are re-measured
    often and a clear loser rarely; and, while speculation is the slower arm, as soon as allowed while
    the acceptance speculation needs to break even is within two standard errors of the measured one (a
    cold start's few steps of low acceptance are soon corrected; re-measuring plain decoding adds no
    acceptance samples, so a close call the other way waits its turn): after the
    bucket has run `min_explore_ratio` to `max_explore_ratio` times as long as the re-measurement
    takes (a re-measurement's first step is no timing, so back to back ones would measure little).

    Switching arms costs time of its own: an EAGLE head catches up over every position decoded
    plainly since it last drafted (on the H100 at batch 64, 4 ms of catch-up per speculative step
    against a 2.4 ms plain step), and the overlap pipeline drains. The first step after a switch is timed against its arm's
    step time; summed over both directions the pipeline's share cancels (the speculative step after
    a plain one absorbs what the plain one's interval left out) and what remains is the round trip's
    cost, a moving average per bucket. A re-measurement waits that much longer: until the switches'
    cost too is about `explore_cost` of the bucket's time (at most `max_explore_ratio` re-measurement
    lengths more). Without it, buckets near break-even re-measured every few dozen milliseconds and
    paid a catch-up each time.
    """

    def __init__(self, explore_cost: float = 0.01, min_explore_ratio: float = 3.0,
                 max_explore_ratio: float = 40.0, window: int = 15, min_samples: int = 4,
                 explore_steps: int = 3, token_smoothing: float = 0.03, switch_smoothing: float = 0.25):
        self.explore_cost, self.min_explore_ratio = explore_cost, min_explore_ratio
        self.max_explore_ratio = max_explore_ratio
        self.window, self.min_samples = window, min_samples
        self.token_smoothing, self.switch_smoothing = token_smoothing, switch_smoothing
        self.explore_steps = explore_steps
        self.acceptance: dict[int, float] = {}  # bucket -> tokens per request per speculative step
        self.token_samples: dict[int, int] = {}  # bucket -> speculative steps whose tokens were counted
        self.spread: dict[int, float] = {}  # bucket -> variance of those tokens per request (same average)
        self.arms: dict[tuple[int, bool], _Arm] = {}  # (bucket, speculative) -> measurements
        self._elapsed: dict[int, float] = {}  # bucket -> seconds run since its slower arm was measured
        self._streak: dict[int, tuple[bool, int]] = {}  # bucket -> (arm being re-measured, steps left)
        self._switch: dict[tuple[int, bool], float] = {}  # (bucket, arm) -> extra seconds of its first step after a switch
        self._last: tuple[int, bool] | None = None  # the (bucket, arm) of the step decided last
        self._open: list | None = None  # [(bucket, speculative), start, engine step count, batch, tokens, clean]
        self.decided: dict[tuple[int, bool], int] = {}  # (bucket, speculative) -> steps decided so (benchmarks)

    def choose(self, batch_size: int, now: float, engine_steps: int) -> bool:
        self._close(now, engine_steps)
        bucket = 1 << (batch_size - 1).bit_length()
        if (bucket, True) not in self.arms and (bucket, False) not in self.arms:
            self._borrow(bucket)
        spec, plain = self._measured(bucket, True), self._measured(bucket, False)
        streak = self._streak.pop(bucket, None)
        if streak is not None:
            speculate, left = streak
            if left > 1:
                self._streak[bucket] = (speculate, left - 1)
        elif spec is None:
            speculate = True  # measure speculation first, then plain decoding
        elif plain is None:
            speculate = False
        else:
            spec_rate, plain_rate = self.rates(bucket)
            faster = spec_rate >= plain_rate
            slower = plain if faster else spec
            speculate = faster
            loss = 1.0 - min(spec_rate, plain_rate) / max(spec_rate, plain_rate)
            if not faster and self._undecided(bucket, spec.step_seconds / plain.step_seconds):
                # speculation measures slower, but on too few or too scattered tokens to be sure: its
                # re-measurement adds acceptance samples (plain steps would add none)
                ratio = self.min_explore_ratio
            else:
                ratio = min(max(loss / self.explore_cost, self.min_explore_ratio), self.max_explore_ratio)
            span = self.explore_steps * slower.step_seconds  # what a re-measurement takes
            wait = ratio * span + min(self.switch_seconds(bucket) / self.explore_cost, self.max_explore_ratio * span)
            if self._elapsed.get(bucket, 0.0) >= wait:
                speculate = not faster
                self._elapsed[bucket] = 0.0
                if self.explore_steps > 1:
                    self._streak[bucket] = (speculate, self.explore_steps - 1)
        key = (bucket, speculate)
        self.decided[key] = self.decided.get(key, 0) + 1
        self._open = [key, now, engine_steps, batch_size, 0, self._last]
        self._last = key
        return speculate

    def add_tokens(self, n: int) -> None:
        """What the speculative step just run emitted (all its requests together)."""
        if self._open is not None:
            self._open[4] += n

    def forget_open(self) -> None:
        """The step decided last did not run as decided (e.g. another rule overruled it)."""
        self._open = self._last = None

    def switch_seconds(self, bucket: int) -> float:
        """What a round trip between the arms costs in a bucket beyond their steps (class docstring),
        once both directions were timed."""
        to_spec, to_plain = self._switch.get((bucket, True)), self._switch.get((bucket, False))
        return 0.0 if to_spec is None or to_plain is None else max(to_spec + to_plain, 0.0)

    def rates(self, bucket: int) -> tuple[float, float] | None:
        """(speculative, plain) tokens/s per request in a bucket, once both are measured."""
        spec, plain = self._measured(bucket, True), self._measured(bucket, False)
        if spec is None or plain is None:
            return None
        return self.acceptance[bucket] / spec.step_seconds, 1.0 / plain.step_seconds

    def _undecided(self, bucket: int, break_even: float) -> bool:
        """Whether the acceptance speculation needs to break even lies within two standard errors
        of the bucket's average (the average of few steps, a cold start's, may be far off)."""
        n = min(self.token_samples[bucket], 1.0 / self.token_smoothing)
        return abs(break_even - self.acceptance[bucket]) < 2.0 * (self.spread[bucket] / n) ** 0.5

    def _measured(self, bucket: int, speculative: bool) -> _Arm | None:
        arm = self.arms.get((bucket, speculative))
        if arm is None or arm.samples < self.min_samples:
            return None
        if speculative and not self.token_samples.get(bucket):
            return None
        return arm

    def _borrow(self, bucket: int) -> None:
        """Starts a new bucket from the nearest measured bucket whose decision implies its own (the
        class docstring): a smaller one that decodes plainly, or a larger one that speculates."""
        implied = []
        for b in {b for b, _ in self.arms}:
            rates = self.rates(b)
            if rates is not None and (b < bucket) == (rates[1] > rates[0]):
                implied.append(b)
        if not implied:
            return
        near = min(implied, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
        for speculative in (True, False):
            self.arms[(bucket, speculative)] = _Arm(self.arms[(near, speculative)].step_seconds,
                                                    self.min_samples, borrowed=True)
        self.acceptance[bucket] = self.acceptance[near]
        self.token_samples[bucket] = self.token_samples[near]
        self.spread[bucket] = self.spread[near]

    def _close(self, now: float, engine_steps: int) -> None:
        if self._open is None:
            return
        key, start, steps, batch, tokens, before = self._open
        self._open = None
        clean = before == key
        speculative = key[1]
        if speculative:
            if tokens <= 0:
                return  # nothing was emitted (the batch finished before the step ran)
            # plain means over the first samples, then an EMA
            n = self.token_samples[key[0]] = self.token_samples.get(key[0], 0) + 1
            weight, x = max(self.token_smoothing, 1.0 / n), tokens / batch
            mean, spread = self.acceptance.get(key[0], 0.0), self.spread.get(key[0], 0.0)
            self.acceptance[key[0]] = mean + weight * (x - mean)
            self.spread[key[0]] = spread + weight * ((x - mean) ** 2 - spread)
        if engine_steps != steps + 1 or now <= start:
            return  # another step ran in between (a prefill): not a timing
        arm = self.arms.get(key)
        if not clean:  # the first step after a switch: not a timing, but what the switch cost
            if before is not None and before[0] == key[0] and arm is not None and arm.samples and not arm.borrowed:
                extra, old = now - start - arm.step_seconds, self._switch.get(key)
                self._switch[key] = extra if old is None else old + self.switch_smoothing * (extra - old)
            return
        if arm is None:
            arm = self.arms[key] = _Arm()
        seconds = now - start
        arm.add(seconds, self.window)
        self._elapsed[key[0]] = self._elapsed.get(key[0], 0.0) + seconds

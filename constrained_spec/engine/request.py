"""A request's life inside the engine: tokens, grammar matcher, KV row, and where its output goes."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import numpy as np

from ..sampling_params import SamplingParams


class Status(Enum):
    COMPILING = "compiling"  # waiting for its grammar to compile
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, stop string, stop token id, or grammar end
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    ERROR = "error"

    def __str__(self) -> str:  # "stop", as the HTTP API says it (Python 3.11 printed "FinishReason.STOP")
        return self.value


# What kind of failure a request that ended "error" had (`RequestOutput.error_kind`), for the server
# to answer it as it answers the same failure caught before the request was queued; None: the
# engine's own failure (a 500)
ERROR_BUSY = "busy"  # its grammar waited too long for a compile thread (GrammarBusy): retry later
ERROR_GRAMMAR = "grammar"  # its grammar was refused (GrammarError): the request's fault
ERROR_GRAMMAR_TOO_COMPLEX = "grammar_too_complex"  # its grammar compiled past the timeout (GrammarTooComplex)

_ids = itertools.count()


@dataclass(slots=True)  # built per request per step for streamed requests: slots make that cheaper
class RequestOutput:
    """One update for a caller: the text and tokens added since the last update."""
    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[dict] | None = None  # per new token: {"token_id", "logprob", "top": [(id, logprob)]}
    matched_stop: str | int | None = None
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (usage.prompt_tokens_details)
    error_kind: str | None = None  # with finish_reason ERROR: ERROR_BUSY, ERROR_GRAMMAR..., or None


@dataclass(eq=False)  # identity: `req in running`, `running.remove(req)` must not compare every field
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    grammar_future: Any = None  # Future[CompiledGrammar] while compiling
    matcher: Any = None  # RequestMatcher once compiled
    seed: int = 0
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    row: int = -1  # row in the RequestSlotTable while it holds KV
    num_cached: int = 0  # tokens whose K/V are in the cache (or being written by a launched step)
    needs_extend: bool = True  # host-known tokens past num_cached must go through an EXTEND step
    discard_inflight: bool = False  # ignore the sample of the step in flight (jump-forward replaced it,
    #   or its grammar mask missed the step's budget)
    mask_job: Any = None  # its grammar-mask fill while that runs off the engine thread (MaskFiller)
    mask_fill_seconds: float = 0.0  # how long its last off-thread mask fill took
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_kind: str | None = None  # `RequestOutput.error_kind`
    arrival: float = field(default_factory=time.monotonic)
    admitted_time: float | None = None  # first admission into the running batch
    first_token_time: float | None = None
    num_forced_tokens: int = 0  # jump-forward tokens emitted without sampling
    spec_steps: int = 0  # speculative verify steps this request took part in
    spec_accepted: int = 0  # draft tokens of this request accepted
    detok: Any = None
    aborted: bool = False
    # prefix cache (engine/prefix_cache.py): the locked tree node whose path is the start of the
    # row, its length, the matched slots until the first step places them in the row
    cache_node: Any = None
    cache_len: int = 0
    prefix_slots: Any = None
    uncached_key: Any = None  # where its computed prompt waits to be cached (`PrefixCache.cache_prompts`)
    cached_tokens: int | None = None  # prompt tokens served from the cache at first admission
    # its context goes into the tree at release even while the cache misses (filing was on when it
    # was first admitted: `PrefixCache.admitted`)
    file_context: bool = True
    skips: int = 0  # times a request with a longer cached prefix was admitted before this one
    # a request its caller takes whole (`add_request(each_step=False)`): after its first update, its
    # tokens (and logprobs) wait here and go out with its last update. None: every step's go out
    held_ids: list[int] | None = None
    held_logprobs: list | None = None
    each_step: bool = True
    # a streamed request whose caller collects a step's tokens in one list (`add_request(step_tokens=)`):
    # an update that is one more token and not the end goes there as (stream_key, token, logprob, n)
    step_tokens: list | None = None
    stream_key: Any = None
    # an empty update once its grammar compiled (`add_request(announce=True)`): a server holding a
    # stream's status until its grammar is known good sends its headers then, not at the first token
    announce: bool = False
    _prompt_array: np.ndarray = field(init=False, repr=False)  # prompt_ids as int64 (`__post_init__`)

    def __post_init__(self):
        # made once, by the thread that queues the request: the prefix cache walks a request's ids
        # several times on the engine's thread, where converting a 1,500-token list costs ~60 us
        ids = np.asarray(self.prompt_ids)
        if ids.dtype.kind not in "iub" and len(self.prompt_ids):  # 1.0 or "2" as int64 would pass, then fail
            raise TypeError("prompt token ids must be integers")   # the detokenizer on the engine's thread
        self._prompt_array = ids.astype(np.int64, copy=False)

    def ids_array(self, stop: int, start: int = 0) -> np.ndarray:
        """`all_ids[start:stop]` as int64."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self._prompt_array[start:stop]
        answer = np.asarray(self.output_ids[max(start - p, 0):stop - p], dtype=np.int64)
        return answer if start >= p else np.concatenate([self._prompt_array[start:], answer])

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_range(self, start: int, stop: int) -> list[int]:
        """`all_ids[start:stop]` without building `all_ids` (a prefill step takes a few tokens past
        a cached prefix: copying a 1,500-token prompt for them cost ~3.5 us a request)."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        if start >= n:
            return self.output_ids[start - n:stop - n]
        return self.prompt_ids[start:] + self.output_ids[:stop - n]

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

"""The engine: a background thread that runs the scheduler/model-runner loop, and the
thread-safe entry points (`add_request`, `generate`, `stream`, `astream`, `abort`) on top.

Step timeline (design notes, "Overlap"): launch batch N on the device; while it runs, read batch
N-1's tokens, start one job on the grammar pool that accepts them into the matchers and fills
batch N's bitmask rows (`mask_filler.py`), finish and stream batch N-1's requests on this thread
meanwhile, wait for the job; then sample. With `disable_overlap`, batch N's results are processed
right after its own sampling instead (and every fill is made before or after the processing, not
beside it).

Matcher ownership: a request's matcher is used by one thread at a time. The engine thread owns all
of them; while the fill beside the step's Python work runs (from `MaskFiller.start` until the call
it returns has returned) the rows' matchers are the fill call's, and the Python work must not call
them. So `_process` accepts the step's tokens before it prepares the fill, deals first with every
request whose matcher it must look at again (a refused token, a grammar stop token on which the
matcher may have terminated), and the rest is done without a matcher call
(`_append_token(..., accepted=True)`).

With `grammar_mask_budget_ms`, a request whose bitmask row is not ready within the budget sits the
step out instead of holding the batch (`mask_filler.py`): its sample is void (`discard_inflight`),
the runner undoes the step for it (input token, penalty count, KV slot), and it rejoins the next
step at the same position, so its output is exactly what it would have been.
"""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

import torch

from .. import long_lived
from ..grammar import GrammarBackend, GrammarBusy, GrammarError, GrammarSpec
from ..grammar.disk_cache import resolve_dir as resolve_cache_dir
from ..grammar.errors import GrammarTooComplex
from ..models import load_model
from ..sampling_params import SamplingParams
from ..speculative.grammar_draft import stable_forced_tokens
from .chat_prompt import ChatPromptEncoder
from .config import EngineConfig, default_mask_threads
from .delivery import LoopDelivery
from .detokenizer import IncrementalDetokenizer, NO_TEXT
from . import mask_audit
from .mask_filler import MaskFill, MaskFiller
from .model_runner import ModelRunner, StepResult
from .omp_pool import on_fresh_thread
from .request import (ERROR_BUSY, ERROR_GRAMMAR, ERROR_GRAMMAR_TOO_COMPLEX, FinishReason, Request, RequestOutput,
                      Status)
from .sampler import seed_word
from .scheduler import Scheduler
from ..speculative.worker import SpeculativeWorker, make_drafter
from ..attention import ForwardMode
from ..cpus import name_os_thread
from .stats import EngineStats

log = logging.getLogger(__name__)

# a server's stop: how long grammar compiles still running may take to end (xgrammar's cannot be
# stopped: a 40,000-string enum takes tens of seconds) before the process leaves without them
EXIT_COMPILE_WAIT_S = 1.0


class RequestError(ValueError):
    """A request the engine refuses up front (too long, bad grammar, queue full)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class GenerationOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    logprobs: list[dict] | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():  # (torch's own: a bare AssertionError)
        raise ValueError(f"engine option device={device!r}: CUDA is not available here (torch {torch.__version__})")
    return torch.device(device)



_OPEN_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _shut_down_open_engines() -> None:
    """A script that ends, or is interrupted (Ctrl-C), with requests in flight and no `shutdown()`:
    its engine's loop was inside torch or native code when the interpreter stopped its daemon
    threads, and the process aborted ("terminate called without an active exception", QA 1130 D3).
    atexit runs before that (and before the compile queues' own handler, registered earlier)."""
    for engine in list(_OPEN_ENGINES):
        engine.shutdown()

class Engine:
    def __init__(self, config: EngineConfig | None = None, *, loaded=None, **overrides):
        """`loaded`: an already built `models.LoadedModel` (benchmarks with random weights); by
        default the model named by `config.model` is loaded."""
        config = dataclasses.replace(config) if config is not None else EngineConfig()  # the caller's stays as it was
        for k, v in overrides.items():
            if not hasattr(config, k):
                raise TypeError(f"unknown engine option {k!r}")
            setattr(config, k, v)
        problem = config.problem()
        if problem is not None:
            raise ValueError(f"engine option {problem}")
        self.config = config
        self.device = resolve_device(config.device)
        # On CPU the tensor work of start-up runs on a short-lived thread, so that this (the
        # caller's) thread keeps no OpenMP pool beside the engine thread's (omp_pool.py)
        setup = on_fresh_thread if self.device.type == "cpu" else (lambda fn: fn())
        loaded = loaded or setup(lambda: load_model(config.model, dtype=config.dtype, device=str(self.device)))
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.chat_prompt = ChatPromptEncoder(self.tokenizer)  # (messages, add_generation_prompt=True) -> ids
        self.eos_token_ids = set(loaded.eos_token_ids)
        dtype = next(loaded.model.parameters()).dtype
        self.runner = setup(lambda: ModelRunner(loaded, config, self.device, dtype))
        # the most tokens one request holds: the model's context, or the KV pool where that is smaller
        # (a request alone past the pool's end could neither grow nor be retracted: it waited forever)
        self.max_context = min(self.runner.max_context, self.runner.pool.capacity)
        self.grammar = GrammarBackend(self.tokenizer, loaded.config.vocab_size, compile_workers=config.grammar_threads,
                                      compile_timeout_s=config.grammar_compile_timeout_s,
                                      max_whitespace_cnt=config.grammar_max_whitespace,
                                      cache_dir=resolve_cache_dir(config.grammar_cache_dir),
                                      disk_cache_bytes=config.grammar_disk_cache_mb << 20,
                                      cache_bytes=config.grammar_cache_mb << 20,
                                      default_backend=config.grammar_backend)
        self.scheduler = Scheduler(self.runner, config)
        mask_threads = config.grammar_mask_threads or default_mask_threads()
        self.masks = setup(lambda: MaskFiller(self.runner.bitmask_host, threads=mask_threads,
                                              budget_ms=config.grammar_mask_budget_ms,
                                              max_requests=config.max_running_requests,
                                              stop_ids=self.grammar.stop_token_ids,
                                              paths_per_walk=config.grammar_paths_per_walk))
        self.stats = EngineStats()  # before the speculative worker: its drafter counts its device reads here
        drafter = setup(lambda: make_drafter(config, self.runner))
        self.spec = setup(lambda: SpeculativeWorker(self, drafter)) if drafter is not None else None
        if self.spec is not None and config.jump_forward:
            # a speculative step drafts forced text and the model verifies it, in its own tokenization;
            # plain steps jumping forward would write it in the tokenizer's, so a greedy answer would
            # hang on whether its batch speculated (beside a logprobs request, or a large batch, not)
            log.warning("--jump-forward is off with --speculative-algorithm: forced text is drafted and verified")
            config.jump_forward = False
        if self.spec is not None and self.runner.graphs is not None:
            self.runner.graphs.capture_verify(self.spec.width, max_batch=config.speculative_max_batch)
            self.runner.graphs.capture_draft(self.spec.drafter, max_batch=config.speculative_max_batch)
            self.runner.graphs.capture_chain(self.spec.drafter, self.spec.width, max_batch=config.speculative_max_batch)
        self.audit = mask_audit.MaskAudit(self.grammar, self.tokenizer) if mask_audit.enabled() else None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._compiling: list[Request] = []
        self._by_id: dict[str, Request] = {}
        self._stopped = False
        # called by the engine thread once per loop iteration, after the outputs of the iteration's
        # step were emitted, and before it sleeps: the engine process ships a step's outputs then
        self.step_hook: Callable[[], None] | None = None
        self._launched = None  # the batch whose forward is on the device now
        # tokens on which a matcher can terminate (either backend: a matcher terminates only by
        # accepting one of its stop tokens; the engine's matchers do not override them)
        self.grammar_stop_ids = self.grammar.stop_token_ids
        # tokens that may end a request whatever its parameters (EOS, or the end of its grammar)
        self._stop_ids = self.grammar_stop_ids | frozenset(self.eos_token_ids)
        self._end_row = self.grammar.allocate_bitmask(1)  # `_limit_reason`'s
        # requests at their token limit whose matcher a running mask fill may hold (`_fill_beside`)
        self._limit_ends: list | None = None
        long_lived.freeze()  # the engine's objects, for the process's life (`long_lived.py`)
        self._thread = threading.Thread(target=self._loop, name="constrained-spec-engine", daemon=True)
        self._thread.start()
        _OPEN_ENGINES.add(self)
        log.info("engine ready: model %s on %s (%s), %d KV slots, max context %d", self.model_name, self.device,
                 dtype, self.runner.pool.capacity, self.max_context)

    # -- public API ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    grammar: GrammarSpec | None = None, on_output: Callable[[RequestOutput], None] | None = None,
                    request_id: str | None = None, detokenize: bool = True, each_step: bool = True,
                    step_tokens: list | None = None, stream_key=None, announce: bool = False) -> Request:
        """Queues a request; `on_output` is called with each update from the engine thread (or its
        step thread, which runs while the engine thread fills grammar masks: never both at once).
        `detokenize=False`: updates carry token ids only, no text, and stop strings are the caller's
        to find (the HTTP front-end process detokenizes, off the engine's process).
        `each_step=False`: the caller takes the answer whole, so two updates: the first token (its
        time to first token), then everything since at the end; the steps between build no update.
        `step_tokens` (a list; with `detokenize=False`): the most common update of a streamed request,
        one more token that does not end it, is not a `RequestOutput` to `on_output` but an entry
        (stream_key, token, logprob or None, tokens so far) appended to this list, which the caller
        empties in `step_hook` (the engine thread, once per loop iteration: a step's entries come before
        its other updates). The engine process streams that way: ~0.1 µs a request a step instead of
        an update object and a callback on the engine's thread.
        `announce` (a request with a grammar, `each_step`): one empty update once the grammar has
        compiled and the request is queued, before its first token; a failed compile is the usual
        finished "error" update instead."""
        if self._stopped:  # nothing would ever run it: a caller waiting on it would wait forever
            raise RequestError("the engine is shut down", code="engine_shut_down")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams; got {type(params).__name__}")
        # again here: a field set after construction (or params unpickled) was never checked, and a
        # value the step cannot take failed every request of the step with it
        params.validate()
        if grammar is not None and not isinstance(grammar, GrammarSpec):
            raise TypeError(f"grammar must be a GrammarSpec (GrammarSpec.json_schema(schema), .regex(...), ...); "
                            f"got {type(grammar).__name__}")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise TypeError(f"a prompt is a string or a list of token ids; got {type(prompt).__name__}")
        self._check_request(ids, params)
        if self.num_queued() >= self.config.max_held_requests:
            raise RequestError("the engine's queue is full; retry later", code="queue_full")
        if step_tokens is not None and (detokenize or not each_step):
            raise ValueError("step_tokens is for streamed requests without detokenization")
        try:
            req = Request(ids, params, on_output or (lambda out: None), each_step=each_step, step_tokens=step_tokens,
                          stream_key=stream_key, announce=announce and grammar is not None and each_step)
        except (TypeError, ValueError, OverflowError):  # its ids as int64 (`Request.__post_init__`)
            raise TypeError("a prompt is a string or a list of token ids") from None
        self._check_vocabulary(req.ids_array(len(ids)))
        if request_id:
            req.request_id = request_id
        req.seed = seed_word(params.seed) if params.seed is not None else hash((self.config.seed, req.request_id)) & 0x7FFFFFFF
        req.detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop) if detokenize else NO_TEXT
        if grammar is not None:
            req.grammar_future = self.grammar.compile_async(grammar)
            # an idle engine thread sleeps until woken: a compile finishing must wake it
            req.grammar_future.add_done_callback(lambda _: self._wake.set())
        self._inbox.put(("add", req))
        self._wake.set()
        return req

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def compile_grammar(self, grammar: GrammarSpec):
        """Compiles (or fetches from cache) synchronously; raises GrammarError. Lets a server
        refuse a bad schema before it queues anything (a check: under `auto` only a request's own
        compile counts as a use of the grammar)."""
        return self.grammar.compile_async(grammar, check_only=True).result()

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams | None] | None = None,
                 grammar: GrammarSpec | list[GrammarSpec | None] | None = None) -> list[GenerationOutput]:
        """Blocking batch generation; all prompts run concurrently. `params` and `grammar` are one
        for all prompts, or lists with one entry per prompt."""
        if not isinstance(prompts, (str, list, tuple)):
            raise TypeError(f"prompts: a string, a list of token ids, or a list of those; got {type(prompts).__name__}")
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        plist = [prompts] if single else list(prompts)
        grammars = grammar if isinstance(grammar, list) else [grammar] * len(plist)
        params_list = params if isinstance(params, list) else [params] * len(plist)
        if len(grammars) != len(plist) or len(params_list) != len(plist):
            raise ValueError(f"{len(plist)} prompts, but {len(params_list)} sampling params and {len(grammars)} grammars")
        collectors = [_Collector() for _ in plist]
        reqs = []
        try:
            for p, sp, g, c in zip(plist, params_list, grammars, collectors):
                reqs.append(self.add_request(p, sp, g, c, each_step=False))
        except Exception:  # a refused prompt: the ones queued before it have nobody to answer
            for r in reqs:
                self.abort(r.request_id)
            raise
        try:
            return [c.result(r) for c, r in zip(collectors, reqs)]
        except BaseException:  # Ctrl-C in a notebook or a shell: nobody waits for them any more
            for r in reqs:
                if not r.finished:
                    self.abort(r.request_id)
            raise

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               grammar: GrammarSpec | None = None) -> Iterator[RequestOutput]:
        q: queue.SimpleQueue = queue.SimpleQueue()
        req = self.add_request(prompt, params, grammar, q.put)
        try:
            while True:
                out = q.get()
                yield out
                if out.finished:
                    return
        finally:
            if not req.finished:
                self.abort(req.request_id)

    async def astream(self, prompt: str | list[int], params: SamplingParams | None = None,
                      grammar: GrammarSpec | None = None, request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        delivery = LoopDelivery.for_loop(asyncio.get_running_loop())
        q: asyncio.Queue = asyncio.Queue()
        req = self.add_request(prompt, params, grammar, lambda out: delivery.put(q.put_nowait, out),
                               request_id=request_id)
        try:
            while True:
                out = await q.get()
                yield out
                if out.finished:
                    return
        finally:
            if not req.finished:  # the consumer went away (client disconnect): free its KV now
                self.abort(req.request_id)

    def num_queued(self) -> int:
        """Requests the engine holds: running, waiting for a batch slot or for their grammar."""
        return len(self._by_id)

    def num_compiling(self) -> int:
        """Requests waiting for their grammar's compile (not yet in the scheduler's queue)."""
        return len(self._compiling)

    def kv_usage(self) -> float:
        pool = self.runner.pool
        return 1.0 - pool.num_free / pool.capacity

    def shutdown(self, compile_wait_s: float | None = None) -> bool:
        """Stops the loop; requests still held end with finish_reason "error" (their callers waited
        for an end that would never come). Waits up to `compile_wait_s` (the compile timeout by
        default) for grammar compiles still running, and says whether they ended: a process that
        exits with one inside native code aborts, unless it leaves by `os._exit`, as the servers
        do (`EXIT_COMPILE_WAIT_S`)."""
        _OPEN_ENGINES.discard(self)
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._end_held("the engine was shut down")
        self.masks.close()
        ended = self.grammar.close(compile_wait_s)
        long_lived.unfreeze()
        return ended

    def _end_held(self, error: str) -> None:
        """Ends every request queued, compiling or running with `error` (the loop has stopped)."""
        self._drain_inbox()
        for req in list(self._by_id.values()):
            if not req.finished:
                req.status, req.finish_reason, req.error = Status.FINISHED, FinishReason.ERROR, error
                self._emit(req, [], None, finished=True, reason=FinishReason.ERROR)
        self._by_id.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def _check_request(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        if len(ids) >= self.max_context:
            holds = "this model's context" if self.max_context == self.runner.max_context else "the KV cache"
            raise RequestError(f"the prompt has {len(ids)} tokens; {holds} holds {self.max_context}",
                               param="messages", code="context_length_exceeded")
        vocab = self.runner.model.text_vocab_size
        for name, tokens in (("logit_bias", params.logit_bias), ("prediction", params.prediction),
                             ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in tokens or () if not 0 <= t < vocab]
            if outside:
                raise RequestError(f"{name} names token id {outside[0]}, outside the model's vocabulary of {vocab}",
                                   param=name, code="invalid_value")

    def _check_vocabulary(self, ids) -> None:
        """A prompt's ids (int64 array) are the model's: an embedding lookup past its table failed
        the whole step, every request in it; ids past the tokenizer's are no text either."""
        vocab = self.runner.model.text_vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise RequestError(f"the prompt has token id {bad}, outside the model's vocabulary of {vocab}",
                               param="prompt", code="invalid_value")

    # -- the loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        name_os_thread("cs-engine")
        inflight: StepResult | None = None
        while not self._stopped:
            try:
                if self.step_hook is not None:
                    self.step_hook()
                self._wake.clear()  # before looking for work: a wake-up from here on is not lost
                self._drain_inbox()
                self._check_compiles()
                batch = self.scheduler.schedule(can_retract=inflight is None)
                if batch is None and inflight is not None:
                    self._process(inflight)
                    inflight = None
                    continue
                if batch is None:
                    self._idle_wait()
                    continue
                t0 = time.perf_counter()
                if self.spec is not None and batch.mode is ForwardMode.DECODE and self._can_speculate(batch):
                    if inflight is not None:  # drafting reads the tokens of the step in flight
                        self._process(inflight)
                        inflight = None
                        batch.requests = [r for r in batch.requests if not r.finished]
                        if not batch.requests:
                            continue
                    self.masks.settle(batch.requests)  # drafting moves the matchers: no fill may run on them
                    self.spec.step(batch)
                    self.stats.on_step(batch, time.perf_counter() - t0)
                    continue
                logits = self.runner.forward(batch)
                self._launched = batch
                if inflight is not None:
                    self._process(inflight, launched=batch)
                    inflight = None
                fill = self._fill_bitmask(batch)
                result = self.runner.sample(batch, logits, fill.bitmask, self.grammar.apply_bitmask, skip=fill.late)
                result.masked = fill.bitmask is not None
                if not self._overlapped():
                    self._launched = None
                    self._process(result)
                else:
                    inflight = result
                self.stats.on_step(batch, time.perf_counter() - t0)
            except Exception:  # keep serving: fail the requests of this step, not the engine
                log.exception("engine step failed")
                inflight = self._launched = None
                self.masks.cancel()  # a fill prepared for the failed step: drop it
                self._fail_running("internal error in the engine step; see the server log")

    def _can_speculate(self, batch) -> bool:
        # Drafting starts from each request's last sampled token. A request whose first sample was
        # void (its mask missed the budget in the prefill step) has none yet: decode plainly first.
        return all(r.output_ids for r in batch.requests) and self.spec.should_speculate(batch)

    def _overlapped(self) -> bool:
        """Whether a step's results are processed after the next step is launched (CUDA only: on
        the CPU the forward runs synchronously, so there is nothing to overlap)."""
        return not self.config.disable_overlap and self.device.type == "cuda"

    def _idle_wait(self) -> None:
        if self.step_hook is not None:
            self.step_hook()
        self.stats.idle_since = t0 = time.perf_counter()
        self._wake.wait(timeout=0.05 if self._compiling else 1.0)
        self.stats.idle_seconds += time.perf_counter() - t0
        self.stats.idle_since = None

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._by_id[item.request_id] = item
                if item.grammar_future is not None:
                    item.status = Status.COMPILING
                    self._compiling.append(item)
                else:
                    self.scheduler.add(item)
            elif kind == "abort":
                req = self._by_id.get(item)
                if req is not None and not req.finished:
                    req.aborted = True
                    self._finish(req, FinishReason.ABORT)

    def _check_compiles(self) -> None:
        still = []
        for req in self._compiling:
            if req.finished:  # aborted: a compile still queued for it alone leaves the queue
                req.grammar_future.cancel()
                continue
            fut = req.grammar_future
            if not fut.done():
                still.append(req)
                continue
            try:
                req.matcher = self.grammar.matcher(fut.result())
            except (GrammarError, GrammarBusy) as e:  # busy: its grammar waited too long for a compile thread
                self._finish(req, FinishReason.ERROR, error=str(e), error_kind=refusal_kind(e))
                continue
            self.scheduler.add(req)
            if req.announce:
                self._emit(req, [], None, finished=False)
        self._compiling = still

    def _fill_bitmask(self, batch) -> MaskFill:
        """Fills the step's bitmask rows; requests whose row missed the budget sit the step out:
        their sample will be discarded (the runner undoes the step for them when it samples)."""
        reqs = batch.sampling_requests()
        t0 = time.perf_counter()
        fill = self.masks.fill(reqs)
        if fill.bitmask is not None:
            self.stats.grammar_mask_seconds += time.perf_counter() - t0
        for i in fill.late:
            reqs[i].discard_inflight = True
        self.stats.grammar_late_rows += len(fill.late)
        return fill

    def _process(self, result: StepResult, launched=None) -> None:
        """The step's tokens into its requests. `launched`: the batch on the device now (overlap
        mode); its mask fill runs beside this step's Python work, in one job with the accepts of
        this step's tokens (ownership: module docstring). A token the grammar refuses (a bug: the
        sample was masked) then fails its request after it was streamed."""
        # from here the device is done with the bitmask buffer
        tokens, logprobs = self.stats.wait_for_device(result.wait)
        reqs = result.batch.sampling_requests()
        live: list[int] = []
        for i, req in enumerate(reqs):
            if req.status is Status.FINISHED:
                continue  # finished while this step was in flight; its sample is moot
            if req.discard_inflight:
                req.discard_inflight = False
                continue
            live.append(i)
        if self.audit is not None and result.masked:
            self.audit.check_step(reqs, [i for i in live if reqs[i].matcher is not None], tokens,
                                  self.runner.bitmask_host, "overlapped" if launched is not None else "decode")
        if self.config.jump_forward:
            # forced strings move the matchers request by request: the plain sequential path
            for i in live:
                self._append_token(reqs[i], tokens[i], None if logprobs is None else logprobs[i])
            return
        grammar = [i for i in live if reqs[i].matcher is not None]
        stop_ids = self.grammar_stop_ids
        ending = [i for i in grammar if tokens[i] in stop_ids]  # their matchers may terminate: accepted here
        rest = [i for i in grammar if tokens[i] not in stop_ids] if launched is not None else []
        live = self._accept_now(reqs, live, ending if launched is not None else grammar, tokens)
        for i in ending:
            if not reqs[i].finished:
                self._append_token(reqs[i], tokens[i], None if logprobs is None else logprobs[i], accepted=True)
        if ending:
            done = set(ending)
            live = [i for i in live if i not in done and not reqs[i].finished]
        # the other tokens ride along with the next step's fill, if one starts: its job accepts each
        # request's token before filling its row
        fill = None
        if launched is not None:
            if len(rest) == len(reqs):  # every request of the step: the lists as they are
                accept_reqs, accept_tokens = reqs, tokens
            else:
                accept_reqs, accept_tokens = [reqs[i] for i in rest], [tokens[i] for i in rest]
            fill = self.masks.start(launched.sampling_requests(), accept_reqs, accept_tokens)
        if fill is None:
            live = self._accept_now(reqs, live, rest, tokens)
            self._append_accepted(reqs, live, tokens, logprobs)
            return
        self._fill_beside(fill, reqs, live, tokens, logprobs)
        for req, token in fill.refused:  # appended already: the request ends with the error
            if not req.finished:
                self._fail_refused(req, token, "overlapped accept")

    def _accept_now(self, reqs, live: list[int], positions: list[int], tokens) -> list[int]:
        """reqs[i] accepts tokens[i] for i in `positions`; a refused token fails its request.
        Returns `live` without the failed positions."""
        if not positions:
            return live
        t0 = time.perf_counter()
        refused = self.masks.accept([reqs[i].matcher for i in positions], [tokens[i] for i in positions])
        self.stats.grammar_accept_seconds += time.perf_counter() - t0
        if not refused:
            return live
        for j in refused:
            i = positions[j]
            self._fail_refused(reqs[i], tokens[i], "accept")
        return [i for i in live if not reqs[i].finished]

    def _fill_beside(self, fill, reqs, live, tokens, logprobs) -> None:
        """Appends the step's tokens while the mask fill runs on the pool's threads, then waits for
        it. `grammar_mask_seconds` counts what the fill holds this thread up. Requests that reach
        their token limit end after the fill, which may hold their matchers (`_limit_reason`)."""
        self._limit_ends = []
        try:
            self._append_accepted(reqs, live, tokens, logprobs)
        finally:
            self._finish_fill(fill)
            ends, self._limit_ends = self._limit_ends, None
        for req, new_ids, lps in ends:
            self._finish(req, self._limit_reason(req), new_ids=new_ids, logprobs=lps)

    def _finish_fill(self, fill) -> None:
        t0 = time.perf_counter()
        fill.finish()  # never raises: `masks.fill` raises what it raised
        self.stats.grammar_mask_seconds += time.perf_counter() - t0

    def _append_accepted(self, reqs, live, tokens, logprobs) -> None:
        """`_append_token(..., accepted=True)` for the live positions, whose tokens are in their
        matchers already and are no grammar stop token (`_process` dealt with those): calls no
        matcher (a fill may be running on them). The common case, a request that goes on, is
        inlined (the same steps as `_append_token` and `_emit`); anything else takes
        `_append_token`. This runs for every request of every step: keep it lean."""
        eos = self.eos_token_ids
        general = self._append_token
        for i in live:
            req = reqs[i]
            token = tokens[i]
            lp = None if logprobs is None else logprobs[i]
            if token in eos or self._may_end_within(req, 1):
                general(req, token, lp, accepted=True)  # first token, a stop, or the last token
                continue
            out = req.output_ids
            out.append(token)
            n = len(out)
            if req.step_tokens is not None:  # streamed, collected a step at a time by the caller
                req.step_tokens.append((req.stream_key, token, lp, n))  # (no text: no stop string here)
                continue
            new_ids = [token]
            detok = req.detok
            stop = detok.add(new_ids)
            lps = [lp] if lp else None
            if stop is not None:
                self._finish(req, FinishReason.STOP, matched=stop, new_ids=new_ids, logprobs=lps)
                continue
            if req.held_ids is not None:  # taken whole: goes out with its last update
                req.held_ids.append(token)
                if lp:
                    req.held_logprobs.append(lp)
                continue
            text = detok.take(False)
            if detok.stop:  # the tokens go out with their text
                new_ids, lps = detok.release(new_ids, lps, False)
            req.on_output(RequestOutput(req.request_id, text, new_ids, False, None, req.error,
                                        len(req.prompt_ids), n, lps, None, req.cached_tokens or 0))

    def _append_token(self, req: Request, token: int, logprob: dict | None, accepted: bool = False) -> None:
        """One sampled or verified token into the request: grammar, stop conditions, stream (and
        under --jump-forward, which a speculative engine turns off, the forced string after it).
        `accepted`: the caller accepted the token into the matcher already; the matcher is then
        looked at again only if the token is one of the grammar's stop tokens (it may have
        terminated on it), so that a matcher a running fill holds is not called."""
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
            self.stats.on_first_token(req)
        params = req.params
        matcher = req.matcher
        if matcher is not None and not accepted and not matcher.accept_token(token):
            self._fail_refused(req, token, "sequential accept")
            return
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            req.output_ids.append(token)
            lps = [logprob] if logprob else None
            if matcher is not None and token not in params.stop_token_ids and token not in self.grammar_stop_ids:
                self._grammar_end_violation(req, token, new_ids=[token], logprobs=lps)
                return
            self._finish(req, FinishReason.STOP, matched=token, new_ids=[token], logprobs=lps)
            return
        new_ids = [token]
        req.output_ids.append(token)
        lps = [logprob] if logprob else None
        if self.config.jump_forward:
            forced = self._jump_forward(req)
            new_ids += forced
            if lps:  # a forced token is the only one the grammar allows: probability 1 (an entry
                # each, or a whole answer's entries, held step after step, slid onto later tokens)
                lps += [{"logprob": 0.0, "top": [(t, 0.0)]} for t in forced]
        stop = req.detok.add(new_ids)
        if stop is not None:
            self._finish(req, FinishReason.STOP, matched=stop, new_ids=new_ids, logprobs=lps)
        elif (matcher is not None and (not accepted or token in self.grammar_stop_ids)
              and matcher.is_terminated()):
            self._finish(req, FinishReason.STOP, new_ids=new_ids, logprobs=lps)
        elif len(req.output_ids) >= params.max_tokens or req.total_len >= self.max_context:
            if matcher is not None and self._limit_ends is not None:  # a fill may hold the matcher
                self._limit_ends.append((req, new_ids, lps))
            else:
                self._finish(req, self._limit_reason(req), new_ids=new_ids, logprobs=lps)
        else:
            self._emit(req, new_ids, lps, finished=False)

    def _limit_reason(self, req: Request) -> FinishReason:
        """How a request that reached max_tokens or the context's end ended: "length", but "stop"
        where its grammar is complete and allows nothing more (a JSON object closed, a choice made,
        on the last token allowed): the answer is whole, and "length" would call it cut (the
        `openai` package's `parse` refuses a "length" answer)."""
        m = req.matcher
        if m is None or not m.can_terminate():
            return FinishReason.LENGTH
        m.fill_bitmask(self._end_row, 0)
        allowed = self.grammar.allowed_tokens(self._end_row[0])
        return FinishReason.STOP if self.grammar_stop_ids.issuperset(allowed.tolist()) else FinishReason.LENGTH

    def append_verified(self, req: Request, tokens: list[int]) -> None:
        """A speculative step's tokens for one request: what `_append_token` token by token does,
        with one update (and one detokenizer call) for the lot where no token can end the request:
        none is a stop token, the request has no stop strings, and the limits lie beyond the last. Otherwise, or if the grammar refuses one, token by token (which token
        ends the request decides what is emitted)."""
        matcher, n = req.matcher, len(tokens)
        if req.detok.stop or not self._stop_ids.isdisjoint(tokens) or self._may_end_within(req, n):
            self._append_each(req, tokens)
            return
        if matcher is not None:
            taken = matcher.accept_tokens(tokens)
            if taken < n:  # a refused token: the token-by-token path fails the request there
                matcher.rollback(taken)
                self._append_each(req, tokens)
                return
        req.output_ids.extend(tokens)
        req.detok.add(tokens)  # no stop strings: nothing to find
        self._emit(req, tokens, None, finished=False)

    def _may_end_within(self, req: Request, n: int) -> bool:
        """Whether the request's next `n` tokens may end it by its parameters or limits, or are its
        first (`_append_token` stamps that): the batched appends (`_append_accepted`,
        `append_verified`) leave such tokens to `_append_token`. Stop strings and stop tokens are
        the callers' to check."""
        params = req.params
        return (req.first_token_time is None or bool(params.stop_token_ids)
                or len(req.output_ids) + n >= params.max_tokens or req.total_len + n >= self.max_context)

    def _append_each(self, req: Request, tokens: list[int]) -> None:
        for tok in tokens:
            if req.finished:
                return
            self._append_token(req, tok, None)

    def _jump_forward(self, req: Request) -> list[int]:
        if not self.config.jump_forward or req.matcher is None:
            return []
        room = min(req.params.max_tokens - len(req.output_ids), self.max_context - req.total_len)
        # all but the forced string's last token: the model would merge that one with what follows
        # (`"` + `:` is `":`), and handing it the split form derails it (`"name"   : `)
        forced = stable_forced_tokens(req.matcher, self.tokenizer)[0][:max(room - 1, 0)]
        forced = forced[:req.matcher.accept_tokens(forced)]
        if forced:
            req.output_ids.extend(forced)
            req.num_forced_tokens += len(forced)
            self.stats.forced_tokens += len(forced)
            req.needs_extend = True
            req.discard_inflight = req.status is Status.RUNNING and self._in_flight(req)
        return forced

    def _in_flight(self, req: Request) -> bool:
        # In overlap mode the next batch was launched before this result was processed.
        launched = self._launched
        return launched is not None and launched.mode.value == "decode" and req in launched.requests

    def _emit(self, req: Request, new_ids: list[int], logprobs, finished: bool,
              reason: FinishReason | None = None, matched=None) -> None:
        if not req.each_step:
            held = req.held_ids
            if held is None:  # its first update goes out; from here on they wait
                req.held_ids, req.held_logprobs = [], []
            elif not finished:
                held.extend(new_ids)
                if logprobs:
                    req.held_logprobs.extend(logprobs)
                return
            else:
                new_ids = held + new_ids
                if req.held_logprobs:
                    logprobs = req.held_logprobs + (logprobs or [])
        detok = req.detok
        text = ""
        if detok:
            text = detok.take(final=finished)
            if detok.late_stop is not None and reason is FinishReason.LENGTH:
                # the limit's last tokens completed a stop string only once the final take read them
                reason, matched = FinishReason.STOP, detok.late_stop
                req.finish_reason = reason
            if detok.stop:  # the tokens go out with their text (a stop string's never)
                new_ids, logprobs = detok.release(new_ids, logprobs, finished)
        req.on_output(RequestOutput(
            request_id=req.request_id, new_text=text, new_token_ids=new_ids, finished=finished,
            finish_reason=reason, error=req.error, prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids), logprobs=logprobs, matched_stop=matched,
            cached_tokens=req.cached_tokens or 0, error_kind=req.error_kind))

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None, matched=None,
                new_ids: list[int] | None = None, logprobs=None, error_kind: str | None = None) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
        req.error_kind = error_kind
        self.scheduler.remove(req)
        if self.spec is not None:
            self.spec.forget(req)
        self._by_id.pop(req.request_id, None)
        self.stats.on_finish(req)
        if self.audit is not None:
            self.audit.replay(req, reason.value)
        self._emit(req, new_ids or [], logprobs, finished=True, reason=reason, matched=matched)

    def _fail_refused(self, req: Request, token: int, where: str) -> None:
        """A sampled token the request's grammar refuses fails the request: a bug (the sample was
        masked), or the grammar backend failing on a token its mask allowed (one of its limits: the
        request's grammar is too complex for it, a 400 `grammar_too_complex`, and under auto the
        grammar's next requests go to xgrammar); the log says enough to replay it."""
        m = req.matcher
        failed = m.error() if m is not None else None
        log.error("request %s: %s refused token %d %r (%s grammar, %s backend%s) after %d tokens ending %r",
                  req.request_id, where, token, self.tokenizer.decode([token]),
                  m.compiled.spec.kind if m is not None else "-", getattr(m, "backend", "-"),
                  f": {failed}" if failed else "", len(req.output_ids), self.tokenizer.decode(req.output_ids[-40:]))
        if not failed:
            self._finish(req, FinishReason.ERROR, error=_violation(token))
            return
        self.grammar.runtime_failure(m.compiled)
        self._finish(req, FinishReason.ERROR, error=f"the grammar is too complex for the {m.backend} backend: {failed}",
                     error_kind=ERROR_GRAMMAR_TOO_COMPLEX)

    def _grammar_end_violation(self, req: Request, token: int, new_ids: list[int], logprobs) -> None:
        """An end of generation the request's grammar does not accept there: an engine bug (samples
        are masked, and no special token is text in a grammar), never an answer. A grammar request
        may end "stop" only on its grammar's stop token, having accepted it (the matcher then
        terminated), or on the user's own stop strings and stop token ids."""
        self.stats.grammar_end_violations += 1
        tail = self.tokenizer.decode(req.output_ids[-40:])
        log.error("request %s ended on token %d before its %s grammar did (%d tokens; text ends %r)",
                  req.request_id, token, req.matcher.compiled.spec.kind,
                  len(req.output_ids), tail)
        self._finish(req, FinishReason.ERROR, error=f"internal error: generation ended on token {token} "
                     "before the grammar was complete", new_ids=new_ids, logprobs=logprobs)

    def _fail_running(self, message: str) -> None:
        """After a failed step: the running requests, whose state the step may have left half
        changed, end with `message`; the waiting ones hold nothing the step touched and go on."""
        for req in list(self.scheduler.running):
            try:
                self._finish(req, FinishReason.ERROR, error=message)
            except Exception:  # what failed was this request's own state: it ends without its text
                log.exception("request %s could not be ended cleanly", req.request_id)
                self._drop(req, message)

    def _drop(self, req: Request, message: str) -> None:
        """Ends a request whose update could not be built: out of the scheduler (its KV freed), and
        one bare error update to its caller, so that nobody waits for it."""
        req.status, req.finish_reason, req.error = Status.FINISHED, FinishReason.ERROR, message
        self.scheduler.remove(req)
        self._by_id.pop(req.request_id, None)
        try:
            req.on_output(RequestOutput(req.request_id, "", [], True, FinishReason.ERROR, message,
                                        len(req.prompt_ids), len(req.output_ids)))
        except Exception:
            log.exception("request %s: its caller's callback failed", req.request_id)


def refusal_kind(e: BaseException) -> str | None:
    """The `RequestOutput.error_kind` of a request refused for load (the engine's queue full, its
    grammar waiting too long for a compile thread) or for its grammar (None: neither)."""
    if isinstance(e, GrammarBusy) or (isinstance(e, RequestError) and e.code == "queue_full"):
        return ERROR_BUSY
    if isinstance(e, GrammarTooComplex):
        return ERROR_GRAMMAR_TOO_COMPLEX
    if isinstance(e, GrammarError):
        return ERROR_GRAMMAR
    return None


def _violation(token: int) -> str:
    return f"internal error: token {token} violates the grammar"


class _Collector:
    """Gathers a request's updates into one GenerationOutput."""

    def __init__(self):
        self.text, self.ids, self.lps = [], [], []
        self.done = threading.Event()
        self.final: RequestOutput | None = None

    def __call__(self, out: RequestOutput) -> None:
        self.text.append(out.new_text)
        self.ids.extend(out.new_token_ids)
        if out.logprobs:
            self.lps.extend(out.logprobs)
        if out.finished:
            self.final = out
            self.done.set()

    def result(self, req: Request) -> GenerationOutput:
        self.done.wait()
        f = self.final
        return GenerationOutput(req.request_id, "".join(self.text), self.ids, f.finish_reason, f.prompt_tokens,
                                f.completion_tokens, f.error, self.lps or None, f.cached_tokens)

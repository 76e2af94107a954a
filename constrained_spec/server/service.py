"""What the routes share: `Service`, built once per app over the engine and the `ServerConfig`, holds
the pending-request count, the metrics and the served model's name, and runs the steps every
generation route takes (resolve the model, compile the grammar, build a chat prompt, admit, queue,
collect, count usage, turn engine failures into API errors). Below it, the steps that need none of
its state: running a generation to its end, and the answer's usage and message."""
from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from ..engine.request import ERROR_BUSY, ERROR_GRAMMAR, ERROR_GRAMMAR_TOO_COMPLEX
from ..models import id_limit
from ..models.registry import names_of
from .constraints import CheckedGrammars, constraint_param, grammar_error, grammar_spec_for
from .engine_client import EngineClient
from .errors import APIError, bad_request
from .generation import Generation, finish_str
from .metrics import ServerMetrics, engine_snapshot
from .protocol import ChatCompletionRequest, _GenerationRequest
from .request_params import RequestParams
from .response_store import ResponseStore
from .tokens import TokenTexts, logprob_chunk
from .tools import ToolCallPlan, grammar_complete, history_text, tool_call_plan

log = logging.getLogger("constrained_spec.server")

INLINE_PROMPT_CHARS = 8000  # chat prompts up to this many characters are encoded on the event loop

SHUTTING_DOWN = "server_shutting_down"  # the error code (and error kind) of a request the shutdown ended


@dataclass
class ChatRun:
    """A validated chat request made ready to queue (`Service.prepare_chat`)."""
    prompt: list[int]
    plan: ToolCallPlan | None
    grammar: Any
    params_list: list
    top_n: int


class _ServerState:
    def __init__(self, limit: int, server_limit: int | None = None):
        self.pending = 0
        self.limit = limit  # this front-end's share
        self.server_limit = limit if server_limit is None else server_limit  # all front-ends'


def _pending_limits(engine, config) -> tuple[int, int]:
    """Admitted generation requests: the configured limit, else the engine's running + queued
    requests, for the whole server; and this front-end's share of it."""
    limit = config.max_pending_requests
    if limit is None:
        limit = engine.config.max_held_requests
    return -(-limit // max(1, config.frontends)), limit


# how long /health, /metrics and stored Responses wait for the engine process's answer
ENGINE_CALL_TIMEOUT_S = 10.0


class Service:
    """The engine behind the routes, and the steps they share."""

    def __init__(self, engine, config):
        self.engine = engine
        self.config = config
        self.state = _ServerState(*_pending_limits(engine, config))
        self.metrics = ServerMetrics(engine, self.state)
        self.served = config.served_model_name or engine.model_name
        # what a request's `model` may be, in lower case: a client set up with the `--model` string the
        # server started with (an HF id, a GGUF file's name) is served, not refused with a 404
        self.model_names = {n.lower() for n in (self.served, engine.model_name,
                                                os.path.basename(str(engine.model_name).rstrip("/")))}
        self.model_names |= names_of(engine.model_name)
        self.texts = TokenTexts(engine.tokenizer)
        self.max_context = int(engine.max_context)
        self.started = int(time.time())  # a model card's `created` (0 read as 1970 in UIs)
        self.params = RequestParams(id_limit(engine.tokenizer), self.max_context, config.default_max_tokens)
        self.checked = CheckedGrammars()  # grammars seen to compile: no check for them again
        # stored Responses: the engine process's (shared by every front-end), or this process's own
        self._responses = (None if isinstance(engine, EngineClient)
                           else ResponseStore(path=getattr(config, "response_store", None)))
        # the generations running (`start`), and the waits a request may be in before its generation
        # starts (`wait`): what `end_requests` ends at the shutdown drain's deadline
        self._generations: "weakref.WeakSet[Generation]" = weakref.WeakSet()
        self._waits: set[asyncio.Future] = set()
        self.ending = False

    def end_requests(self) -> None:
        """At the shutdown drain's deadline (`runner.Server`), on the event loop, just before uvicorn
        would cancel the requests still running (a plain-text 500 and an ASGI traceback, a stream
        cut with no end): each one ends here, as a 503 `server_shutting_down` (JSON), or in a
        stream, its error event and the stream's end. Requests after this are refused the same way."""
        self.ending = True
        generations, waits = list(self._generations), list(self._waits)
        if generations or waits:
            log.warning("shutting down: ending %d requests still running", len(generations) + len(waits))
        for gen in generations:
            gen.end("the server is shutting down; the request was ended", SHUTTING_DOWN)
        for wait in waits:
            if not wait.done():
                wait.set_result(None)

    def shutting_down(self) -> APIError:
        return APIError(503, "the server is shutting down; retry later (with another server)", code=SHUTTING_DOWN,
                        headers={"Retry-After": str(self.config.retry_after_s)})

    async def wait(self, request: Request | None, awaitable):
        """`await awaitable`, unless the client leaves first (ClientGone, with `request`), or the
        shutdown ends the requests (the 503 `shutting_down`); either way it is cancelled."""
        if self.ending:
            raise self.shutting_down()
        ended = asyncio.get_running_loop().create_future()
        self._waits.add(ended)
        try:
            return await until_disconnect(request, awaitable, ended)
        except _Ended:
            raise self.shutting_down() from None
        finally:
            self._waits.discard(ended)

    def close(self) -> None:
        """At the app's shutdown: the stored Responses' file written and closed (if this process has it)."""
        if self._responses is not None:
            self._responses.close()

    # -- the engine's state ---------------------------------------------------------------------------

    def healthy(self) -> bool:
        return getattr(self.engine, "healthy", True)

    def unavailable(self) -> APIError:
        # a dead engine process is started again (`EngineProcess.supervise`), which takes as long as
        # its first start did (seconds to minutes): retrying sooner finds it still down
        given_up = getattr(self.engine, "given_up", None)
        if given_up:  # nothing to wait for: a Retry-After would send the clients' retries to the same 503
            return APIError(503, f"the engine is not running; {given_up}", code="engine_unavailable")
        info = getattr(self.engine, "info", None)
        retry = max(self.config.retry_after_s, math.ceil(getattr(info, "start_s", 0.0)))
        return APIError(503, "the engine is not running; the server cannot generate", code="engine_unavailable",
                        headers={"Retry-After": str(retry)})

    def busy(self, message: str) -> APIError:
        return APIError(503, message, code="server_busy", headers={"Retry-After": str(self.config.retry_after_s)})

    async def snapshot(self) -> dict:
        """The engine's state: asked of the engine process, or read in this one."""
        if isinstance(self.engine, EngineClient):
            return await asyncio.wait_for(asyncio.wrap_future(self.engine.snapshot_async()),
                                          timeout=ENGINE_CALL_TIMEOUT_S)
        return {**engine_snapshot(self.engine), "stored_responses": self._responses.snapshot()}

    async def stored_responses(self, op: str, response_id: str, value=None):
        """`ResponseStore.call` on the stored Responses, wherever they live."""
        if self._responses is not None:
            return self._responses.call(op, response_id, value)
        return await asyncio.wait_for(asyncio.wrap_future(self.engine.responses_async(op, response_id, value)),
                                      timeout=ENGINE_CALL_TIMEOUT_S)

    def check_model(self, name: str | None) -> None:
        if name is not None and name.strip().lower() not in self.model_names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.served}'",
                           param="model", code="model_not_found")

    def model_card(self) -> dict:
        return {"id": self.served, "object": "model", "created": self.started, "owned_by": "constrained-spec",
                "max_model_len": self.max_context}

    # -- a request made ready to queue ----------------------------------------------------------------

    async def compile_grammar(self, req: _GenerationRequest, plan: ToolCallPlan | None = None,
                              request: Request | None = None):
        """The request's GrammarSpec, seen to compile (the up-front check). With `request`, a client
        that disconnects meanwhile stops the wait (ClientGone): its compile future is cancelled, so
        the compile queue (in the engine process too: `EngineClient` tells it) has no waiter left
        on the job, which leaves the queue as one nobody waits for."""
        try:
            spec = grammar_spec_for(req, plan)  # a schema too deep or not JSON is refused here
        except Exception as e:
            if _is_grammar_error(e):
                raise _refusal(e, constraint_param(req), plan)
            raise
        if spec is None or spec in self.checked:
            return spec
        if plan is not None:
            await self._check_tool_parameters(req, plan, request)
        try:
            await self._checked(spec, constraint_param(req), request, plan)
        except APIError as e:
            if plan is not None and e.param == "tools":  # the compiler said what, not where (llguidance):
                await self._check_tool_parameters(req, plan, request, every=True)  # the function, alone
            raise
        return spec

    async def _checked(self, spec, param: str | None, request: Request | None,
                       plan: ToolCallPlan | None = None) -> None:
        """Waits for the grammar's up-front compile; its refusal is the 400 naming `param` (for the
        calls' grammar of a tool-call `plan`, the function's parameters it found fault with)."""
        try:
            # the thread normalizes the schema (prepare_schema); the compile is awaited here, so a
            # request waiting in the compile queue holds no thread
            future = await run_in_threadpool(lambda: self.engine.grammar.compile_async(spec, check_only=True))
            await self.wait(request, asyncio.wrap_future(future))
            self.checked.add(spec)
        except Exception as e:
            if _is_grammar_busy(e):
                raise self.busy(str(e))
            if _is_grammar_error(e):
                raise _refusal(e, param, plan)
            raise

    async def _check_tool_parameters(self, req: _GenerationRequest, plan: ToolCallPlan,
                                     request: Request | None, every: bool = False) -> None:
        """Each function the calls may name whose parameters could accept no arguments object
        (`may_accept_nothing`) is compiled alone first: one that accepts none is the 400 naming its parameters. Among the
        calls it is a dead branch, which llguidance drops from its masks and xgrammar's check
        prunes: that function was silently never called. So is the answer format beside them
        (`auto` with a JSON `response_format`), which names `response_format.json_schema.schema`.
        With `every`, each is compiled alone (the calls' grammar was refused without a path)."""
        from ..grammar import GrammarSpec  # deferred, as in constraints.py
        from ..grammar.backend import may_accept_nothing
        alone = [(plan.parameters(f), f"tools.{i}.function.parameters", f.parameters)
                 for i, f in enumerate(plan.functions) if plan.allowed is None or f.name in plan.allowed]
        if plan.forced is None and plan.answer_schema is not None:
            alone.append((plan.answer_schema, "response_format.json_schema.schema", plan.answer_schema))
        for schema, param, given in alone:
            try:  # (the calls' grammar, built first, holds these parameters: refused there already)
                spec = GrammarSpec.json_schema(schema, strict=plan.strict)
            except Exception as e:
                if _is_grammar_error(e):
                    raise grammar_error(e, param)
                raise
            if not every and not may_accept_nothing(spec) and not _object_by_us(given):
                continue
            if req.grammar_backend is not None:
                spec = spec.with_backend(req.grammar_backend)
            if spec not in self.checked:
                await self._checked(spec, param, request)

    async def prediction_ids(self, req: _GenerationRequest) -> list[int] | None:
        """The predicted output's tokens (no more than the context holds: the rest could not be
        repeated anyway); a long text is encoded off the event loop, as a long prompt is."""
        if req.prediction is None:
            return None
        text = req.prediction.text()
        encode = lambda: self.engine.tokenizer.encode(text, add_special_tokens=False)[:self.max_context]
        return encode() if len(text) <= INLINE_PROMPT_CHARS else await run_in_threadpool(encode)

    async def prepare_chat(self, req: ChatCompletionRequest, request: Request | None = None) -> ChatRun:
        """A chat request's prompt, tool-call plan, compiled grammar and sampling parameters (the
        400s of a bad request come from here, before anything is queued). `request`: the HTTP
        request, whose client leaving stops the grammar's compile wait (ClientGone)."""
        self.check_model(req.model)
        plan = tool_call_plan(req)
        if plan is not None and req.logprobs:
            raise bad_request("logprobs are not returned with tool calls", param="logprobs")
        messages = [_template_message(m) for m in req.messages]
        engine = self.engine
        tools_arg = None
        if plan is not None:  # the tools listed by the template if it takes them, else in the system prompt
            if getattr(engine.chat_prompt, "takes_tools", False):
                tools_arg = plan.tools_for_template()
            messages = plan.with_instructions(messages, list_tools=tools_arg is None)
        encode = engine.chat_prompt if tools_arg is None else functools.partial(engine.chat_prompt, tools=tools_arg)
        try:
            # a short prompt costs less than a thread hand-off (~0.1 ms of a front-end's time); a
            # long one would hold up the event loop's other requests
            if sum(len(m["content"]) for m in messages) <= INLINE_PROMPT_CHARS:
                prompt = encode(messages)
            else:
                prompt = await run_in_threadpool(encode, messages)
        except Exception as e:
            raise bad_request(f"cannot apply the chat template to these messages: {e}", param="messages")
        budget = self.params.token_budget(len(prompt), req.token_limit(), "messages")
        grammar = await self.compile_grammar(req, plan, request)
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
        params_list = self.params.sampling(req, budget, top_n if req.logprobs else None,
                                           await self.prediction_ids(req))
        return ChatRun(prompt, plan, grammar, params_list, top_n)

    # -- admission and the engine's requests ----------------------------------------------------------

    def admit(self, n: int) -> None:
        state = self.state
        if not self.healthy():
            raise self.unavailable()
        if self.ending:
            raise self.shutting_down()
        if state.pending + n > state.limit:
            frontends = max(1, self.config.frontends)
            split = (f" ({state.limit} in each of its {frontends} front-end processes)" if frontends > 1 else "")
            raise self.busy(f"the server is at its limit of {state.server_limit} pending requests{split}; "
                            "retry later")
        state.pending += n
        self.metrics.in_flight.set(state.pending)

    def release(self, n: int) -> None:
        self.state.pending -= n
        self.metrics.in_flight.set(self.state.pending)

    def start(self, prompts, params_list, grammar, base_id, stream: bool) -> Generation:
        try:
            gen = Generation(self.engine, prompts, params_list, grammar, base_id, stream)
            self._generations.add(gen)
            return gen
        except Exception as e:
            code = getattr(e, "code", None)
            if e.__class__.__name__ == "RequestError":
                if code == "queue_full":
                    raise self.busy(str(e))
                raise bad_request(str(e), param=getattr(e, "param", None), code=code or "invalid_request")
            if _is_grammar_busy(e):
                raise self.busy(str(e))
            if _is_grammar_error(e):
                raise grammar_error(e, None)
            raise

    def generation_error(self, out, param: str | None = None) -> APIError:
        """What a request that ended in an error answers: as its grammar's failure in the engine's
        compile is answered up front (`compile_grammar`), 503 with Retry-After when it waited too
        long for a compile thread or the engine's queue was full (the engine process's own check,
        past this front-end's share) and 400 (naming `param`, the constraint's field) when it was
        refused; else 503 if the engine is gone, else 500."""
        kind = getattr(out, "error_kind", None)
        if kind == SHUTTING_DOWN:
            return self.shutting_down()
        if kind == ERROR_BUSY:
            return self.busy(out.error or "the grammar waited too long to compile; retry later")
        if kind in (ERROR_GRAMMAR, ERROR_GRAMMAR_TOO_COMPLEX):
            from ..grammar.errors import GrammarError, GrammarTooComplex  # deferred, as in constraints.py
            refusal = GrammarTooComplex if kind == ERROR_GRAMMAR_TOO_COMPLEX else GrammarError
            return grammar_error(refusal(out.error or "the grammar was refused"), param)
        if not self.healthy():
            return self.unavailable()
        return APIError(500, f"generation failed: {out.error or 'engine error'}", code="engine_error")

    def raise_engine_errors(self, finals, param: str | None = None) -> None:
        for f in finals:
            if f is not None and finish_str(f.finish_reason) == "error":
                raise self.generation_error(f, param)

    async def open_stream(self, gen: Generation, request: Request, grammar, param: str | None = None) -> None:
        """Before a streamed answer's 200 goes out, for a request with a grammar: waits for the
        engine's first update, so that a grammar the engine could not compile (busy in the compile
        queue, or refused: the up-front check passed, or was skipped for a grammar seen before)
        answers the status a non-streamed request gets, 503 with Retry-After or 400, instead of an
        error event in a 200 stream. The update stays in `gen` for the stream. Raises that
        APIError, or ClientGone if the client left meanwhile (the generation is aborted then)."""
        if grammar is None:
            return
        try:
            out = await self.wait(request, gen.first())
        except BaseException:
            gen.abort()
            raise
        if out.finished and finish_str(out.finish_reason) == "error" and getattr(out, "error_kind", None):
            gen.abort()
            raise self.generation_error(out, param)


# -- a generation's answer ----------------------------------------------------------------------------


class ClientGone(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


async def collect(gen: Generation, request: Request, n: int):
    """Runs a generation to the end (non-streaming); aborts it if the client disconnects."""
    texts_out = [[] for _ in range(n)]
    lps: list[list] = [[] for _ in range(n)]
    ids: list[list[int]] = [[] for _ in range(n)]
    finals: list[Any] = [None] * n

    async def run():
        async for i, out in gen:
            texts_out[i].append(out.new_text)
            ids[i].extend(out.new_token_ids)
            if out.logprobs is not None:
                lps[i].append(logprob_chunk(out))
            if out.finished:
                finals[i] = out

    runner = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({runner, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not runner.done():  # the client left
            gen.abort()
            runner.cancel()
            raise ClientGone()
        runner.result()
    finally:
        watcher.cancel()
        if not runner.done():
            runner.cancel()
        gen.abort()
    return ["".join(t) for t in texts_out], ids, lps, finals


class _Ended(Exception):
    """`until_disconnect`'s `ended` came first."""


async def until_disconnect(request: Request | None, awaitable, ended: asyncio.Future | None = None):
    """`await awaitable`, unless the client disconnects first: then it is cancelled (a compile
    future's cancel reaches the compile queue, or the engine process) and ClientGone is raised;
    or unless `ended` resolves first (the shutdown ends the requests: `_Ended`)."""
    task = asyncio.ensure_future(awaitable)
    watchers = [asyncio.ensure_future(_wait_disconnect(request))] if request is not None else []
    try:
        await asyncio.wait({task, *watchers, *([ended] if ended is not None else [])},
                           return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            if ended is not None and ended.done():
                raise _Ended()
            raise ClientGone()
        return task.result()
    finally:
        for watcher in watchers:
            watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def usage(prompt_tokens: int, finals, n: int = 1) -> dict:
    """OpenAI's usage. `finals` hold n siblings per prompt, prompt-major; a prompt counts once,
    and so do its tokens served from the prefix cache (the siblings' most)."""
    comp = sum(f.completion_tokens for f in finals if f is not None)
    cached = sum(max((f.cached_tokens for f in finals[i:i + n] if f is not None), default=0)
                 for i in range(0, len(finals), max(n, 1)))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": comp, "total_tokens": prompt_tokens + comp,
            "prompt_tokens_details": {"cached_tokens": min(cached, prompt_tokens)},
            # (OpenAI sends it always; a prediction's accepted tokens are not counted here: docs/api.md)
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0}}


def answer_message(run: ChatRun, req: ChatCompletionRequest, text: str, final) -> tuple[dict, str]:
    """A finished choice's chat message and finish reason (a call's, for tools)."""
    reason = finish_str(final.finish_reason)
    if run.plan is None:
        return {"role": "assistant", "content": text, "refusal": None, "annotations": []}, reason
    message, reason = run.plan.message(text, reason, grammar_complete(reason, final.matched_stop, req.stop_token_ids))
    return {**message, "annotations": []}, reason


def once(fn):
    """`fn`, run on the first call only (a stream's cleanup)."""
    done = []

    def wrapper():
        if not done:
            done.append(True)
            fn()
    return wrapper


def now() -> int:
    return int(time.time())


# -- what the steps above read of a message or an error ---------------------------------------------


def _template_message(m) -> dict:
    """A request message as the chat template takes it: `developer` as `system`; an assistant turn's
    tool calls and a tool's result as text."""
    if m.role == "developer":
        return {"role": "system", "content": m.text()}
    if m.role == "assistant" and m.tool_calls:
        return {"role": "assistant", "content": history_text(m.text(), m.tool_calls)}
    return {"role": m.role, "content": m.text()}


def _refusal(err: Exception, param: str | None, plan: ToolCallPlan | None) -> APIError:
    """A grammar's refusal as the 400 naming `param`; for the calls' grammar of a tool-call `plan`,
    the function whose parameters it found fault with, at the path in them (`locate_error`)."""
    if plan is not None and param == "tools":
        param, err = plan.locate_error(err)
    return grammar_error(err, param)


def _is_grammar_error(e: Exception) -> bool:
    return any(c.__name__ == "GrammarError" for c in type(e).__mro__)


def _object_by_us(parameters) -> bool:
    """Whether a function's parameters became an object's schema by the `type` the plan added
    (`ToolCallPlan.parameters`) while a keyword at their root allows other values: `anyOf` of a
    string and an integer, an `enum` of strings, a `$ref` to a string schema. Then no object may
    satisfy them, a dead branch of the calls' grammar that would be pruned: compiled alone first."""
    return (isinstance(parameters, dict) and parameters.get("type") != "object"
            and any(k in parameters for k in ("anyOf", "oneOf", "allOf", "enum", "const", "$ref")))


def _is_grammar_busy(e: Exception) -> bool:
    return type(e).__name__ == "GrammarBusy"

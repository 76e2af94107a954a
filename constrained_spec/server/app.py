"""The OpenAI-compatible HTTP server: FastAPI routes over one engine, either an `EngineClient` (the
engine in its own process, `engine_process.py`: how `serve` runs) or an in-process `Engine` (the
single-process server, `serve --single-process`, kept for comparison). Both take `add_request`,
`abort`, `grammar.compile_async` and `chat_prompt`; the engine's state comes as a snapshot
(`metrics.engine_snapshot`).

Routes: ``POST /v1/chat/completions``, ``POST /v1/responses`` (the Responses API over the chat
route: `responses.py`), ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``, ``GET /metrics``. See docs/api.md for the protocol and its extensions.

Request life: read and size-check the body, validate it (pydantic), resolve the model, build the
grammar and compile it in a worker thread (a bad schema is a 400 before anything is queued), build
the prompt and sampling parameters, admit the request (503 + Retry-After past the limit), queue it on
the engine, then answer in one piece or stream it as server-sent events. If the client goes away,
the request is aborted and its KV slots return to the pool.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from .constraints import CheckedGrammars, constraint_param, grammar_error, grammar_spec_for
from .engine_client import EngineClient, EngineUnavailable
from .errors import APIError, bad_request, validation_error_to_api
from .gate import Gate, too_large
from .generation import SSE_DONE, Generation, SSEResponse, finish_str, sse_event
from .metrics import ServerMetrics, engine_snapshot
from .protocol import ChatCompletionRequest, CompletionRequest, _GenerationRequest, new_id
from . import responses
from .request_params import RequestParams
from .tokens import TokenTexts
from .tools import ToolCallPlan, grammar_complete, history_text, tool_call_plan

log = logging.getLogger("constrained_spec.server")

API_KEY_ENV = "CONSTRAINED_SPEC_API_KEY"
INLINE_PROMPT_CHARS = 8000  # chat prompts up to this many characters are encoded on the event loop


@dataclass
class ServerConfig:
    """Server-side settings (the engine has its own EngineConfig)."""
    api_key: str | None = None  # None: no authentication; else /v1/* needs `Authorization: Bearer <key>`
    served_model_name: str | None = None  # the model id clients use; default: the engine's model name
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    max_pending_requests: int | None = None  # admitted generation requests (n counts n); None: engine running+queued
    retry_after_s: int = 1  # Retry-After on 503
    default_max_tokens: int | None = None  # chat requests without max_tokens; None: up to the context limit
    frontends: int = 1  # front-end processes over the engine: each admits its share of the default limit
    frontend: int = 0  # this one's number (0: the `serve` process); /health says it


@dataclass
class _ChatRun:
    """A validated chat request made ready to queue (`prepare_chat`)."""
    prompt: list[int]
    plan: ToolCallPlan | None
    grammar: Any
    params_list: list
    top_n: int


class _ServerState:
    def __init__(self, limit: int):
        self.pending = 0
        self.limit = limit


# -- helpers ------------------------------------------------------------------------------------------


def _json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


async def _read_json(request: Request, limit: int) -> Any:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json")
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return data


def _parse(model_cls, data: dict):
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_error_to_api(e.errors(include_url=False))


# -- the app ------------------------------------------------------------------------------------------


def create_app(engine, config: ServerConfig | None = None, *, owns_engine: bool = False) -> FastAPI:
    """Builds the FastAPI app over `engine`. With `owns_engine`, app shutdown shuts the engine down."""
    config = config or ServerConfig()
    if config.api_key is None and os.environ.get(API_KEY_ENV):
        config.api_key = os.environ[API_KEY_ENV]
    ecfg = getattr(engine, "config", None)
    limit = config.max_pending_requests
    if limit is None:
        limit = (getattr(ecfg, "max_running_requests", 128) or 128) + (getattr(ecfg, "max_queued_requests", 1024) or 0)
        limit = -(-limit // max(1, config.frontends))
    state = _ServerState(limit)
    metrics = ServerMetrics(engine, state)
    served = config.served_model_name or engine.model_name
    model_names = {served, engine.model_name, os.path.basename(str(engine.model_name).rstrip("/"))}
    texts = TokenTexts(engine.tokenizer)
    max_context = int(engine.max_context)
    params = RequestParams(max(len(engine.tokenizer), getattr(engine.tokenizer, "vocab_size", 0)), max_context,
                           config.default_max_tokens)

    @asynccontextmanager
    async def lifespan(app):
        metrics.attach()
        try:
            yield
        finally:
            metrics.detach()
            if owns_engine:
                try:
                    await run_in_threadpool(engine.shutdown)
                except Exception:
                    log.exception("engine shutdown failed")

    app = FastAPI(title="constrained-spec", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible structured-output serving (grammar-constrained + speculative "
                              "decoding). See docs/api.md.")
    app.state.engine = engine
    app.state.server_config = config
    app.state.metrics = metrics
    app.state.server_state = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        return APIError(exc.status_code, msg, code="not_found" if exc.status_code == 404 else None).response()

    @app.exception_handler(EngineUnavailable)
    async def _engine_unavailable(request: Request, exc: EngineUnavailable):
        return unavailable().response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, "internal server error; see the server log", code="internal_error").response()

    # -- shared steps ---------------------------------------------------------------------------------
    checked = CheckedGrammars()  # grammars seen to compile: no check for them again

    def check_model(name: str | None) -> None:
        if name is not None and name not in model_names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{served}'",
                           param="model", code="model_not_found")

    async def compile_grammar(req: _GenerationRequest, plan: ToolCallPlan | None = None):
        try:
            spec = grammar_spec_for(req, plan)
            if spec is None or spec in checked:
                return spec
            # the thread normalizes the schema (prepare_schema); the compile is awaited here, so a
            # request waiting in the compile queue holds no thread
            future = await run_in_threadpool(lambda: engine.grammar.compile_async(spec, check_only=True))
            await asyncio.wrap_future(future)
            checked.add(spec)
        except Exception as e:
            if _is_grammar_busy(e):
                raise busy(str(e))
            if _is_grammar_error(e):
                raise grammar_error(e, constraint_param(req))
            raise
        return spec

    def healthy() -> bool:
        return getattr(engine, "healthy", True)

    def unavailable() -> APIError:
        return APIError(503, "the engine is not running; the server cannot generate", code="engine_unavailable",
                        headers={"Retry-After": str(config.retry_after_s)})

    async def snapshot() -> dict:
        """The engine's state: asked of the engine process, or read in this one."""
        if isinstance(engine, EngineClient):
            return await asyncio.wait_for(asyncio.wrap_future(engine.snapshot_async()), timeout=10)
        return engine_snapshot(engine)

    def busy(message: str) -> APIError:
        return APIError(503, message, code="server_busy", headers={"Retry-After": str(config.retry_after_s)})

    async def prediction_ids(req: _GenerationRequest) -> list[int] | None:
        """The predicted output's tokens (no more than the context holds: the rest could not be
        repeated anyway); a long text is encoded off the event loop, as a long prompt is."""
        if req.prediction is None:
            return None
        text = req.prediction.text()
        encode = lambda: engine.tokenizer.encode(text, add_special_tokens=False)[:max_context]
        return encode() if len(text) <= INLINE_PROMPT_CHARS else await run_in_threadpool(encode)

    def admit(n: int) -> None:
        if not healthy():
            raise unavailable()
        if state.pending + n > state.limit:
            raise APIError(503, f"the server is at its limit of {state.limit} pending requests; retry later",
                           code="server_busy", headers={"Retry-After": str(config.retry_after_s)})
        state.pending += n
        metrics.in_flight.set(state.pending)

    def release(n: int) -> None:
        state.pending -= n
        metrics.in_flight.set(state.pending)

    def start(prompts, params_list, grammar, base_id, stream: bool) -> Generation:
        try:
            return Generation(engine, prompts, params_list, grammar, base_id, stream)
        except Exception as e:
            code = getattr(e, "code", None)
            if e.__class__.__name__ == "RequestError":
                if code == "queue_full":
                    raise busy(str(e))
                raise bad_request(str(e), param=getattr(e, "param", None), code=code or "invalid_request")
            if _is_grammar_busy(e):
                raise busy(str(e))
            if _is_grammar_error(e):
                raise grammar_error(e, None)
            raise

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
                if out.logprobs:
                    lps[i].append((list(out.new_token_ids), out.logprobs))
                if out.finished:
                    finals[i] = out

        runner = asyncio.ensure_future(run())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({runner, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not runner.done():  # the client left
                gen.abort()
                runner.cancel()
                raise _ClientGone()
            runner.result()
        finally:
            watcher.cancel()
            if not runner.done():
                runner.cancel()
            gen.abort()
        return ["".join(t) for t in texts_out], ids, lps, finals

    def usage(prompt_tokens: int, finals, n: int = 1) -> dict:
        """OpenAI's usage. `finals` hold n siblings per prompt, prompt-major; a prompt counts once,
        and so do its tokens served from the prefix cache (the siblings' most)."""
        comp = sum(f.completion_tokens for f in finals if f is not None)
        cached = sum(max((f.cached_tokens for f in finals[i:i + n] if f is not None), default=0)
                     for i in range(0, len(finals), max(n, 1)))
        return {"prompt_tokens": prompt_tokens, "completion_tokens": comp, "total_tokens": prompt_tokens + comp,
                "prompt_tokens_details": {"cached_tokens": min(cached, prompt_tokens)}}

    def generation_error(out) -> APIError:
        """What a request that ended in an error answers: 503 if the engine is gone, else 500."""
        if not healthy():
            return unavailable()
        return APIError(500, f"generation failed: {out.error or 'engine error'}", code="engine_error")

    def raise_engine_errors(finals) -> None:
        for f in finals:
            if f is not None and finish_str(f.finish_reason) == "error":
                raise generation_error(f)

    # -- routes ---------------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        try:
            snap = await snapshot() if healthy() else None
        except (EngineUnavailable, asyncio.TimeoutError):
            snap = None
        if snap is None:
            return _json_response({"status": "unhealthy", "model": served, "error": "the engine is not running",
                                   "pending_requests": state.pending}, status=503)
        return _json_response({"status": "ok", "model": served, "kv_free_slots": snap["kv_free"],
                               "kv_capacity": snap["kv_capacity"], "requests_running": snap["running"],
                               "requests_waiting": snap["waiting"], "pending_requests": state.pending,
                               "frontend": config.frontend, "frontends": config.frontends})

    @app.get("/metrics")
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        try:
            snap = await snapshot() if healthy() else None
        except (EngineUnavailable, asyncio.TimeoutError):
            snap = None
        return Response(metrics.render(snap), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": served, "object": "model", "created": 0, "owned_by": "constrained-spec",
                "max_model_len": max_context}

    @app.get("/v1/models")
    async def list_models():
        return _json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        check_model(model_id)
        return _json_response(model_card())

    async def prepare_chat(req: ChatCompletionRequest) -> _ChatRun:
        """A chat request's prompt, tool-call plan, compiled grammar and sampling parameters (the
        400s of a bad request come from here, before anything is queued)."""
        check_model(req.model)
        plan = tool_call_plan(req)
        if plan is not None and req.logprobs:
            raise bad_request("logprobs are not returned with tool calls", param="logprobs")
        messages = [_template_message(m) for m in req.messages]
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
        budget = params.token_budget(len(prompt), req.token_limit(), "messages")
        grammar = await compile_grammar(req, plan)
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
        params_list = params.sampling(req, budget, top_n if req.logprobs else None, await prediction_ids(req))
        return _ChatRun(prompt, plan, grammar, params_list, top_n)

    def answer_message(run: _ChatRun, req: ChatCompletionRequest, text: str, final) -> tuple[dict, str]:
        """A finished choice's chat message and finish reason (a call's, for tools)."""
        reason = finish_str(final.finish_reason)
        if run.plan is None:
            return {"role": "assistant", "content": text, "refusal": None}, reason
        return run.plan.message(text, reason, grammar_complete(reason, final.matched_stop, req.stop_token_ids))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = _parse(ChatCompletionRequest, await _read_json(request, config.max_body_bytes))
        run = await prepare_chat(req)
        admit(req.n)
        admitted = True
        try:
            cid = new_id("chatcmpl")
            gen = start([run.prompt] * req.n, run.params_list, run.grammar, cid, req.stream)
            model = served
            if req.stream:
                admitted = False  # the stream releases it
                return SSEResponse(chat_stream(gen, req, cid, model, len(run.prompt), run.top_n, run.plan),
                                   cleanup=_once(lambda: (gen.abort(), release(req.n))))
            try:
                outs, _ids, lps, finals = await collect(gen, request, req.n)
            except _ClientGone:
                return Response(status_code=499)
            raise_engine_errors(finals)
            choices = []
            for i in range(req.n):
                message, reason = answer_message(run, req, outs[i], finals[i])
                choice = {"index": i, "message": message,
                          "logprobs": texts.chat_logprobs(lps[i], run.top_n) if req.logprobs else None,
                          "finish_reason": reason}
                choices.append(choice)
            return _json_response({"id": cid, "object": "chat.completion", "created": _now(), "model": model,
                                   "choices": choices, "usage": usage(len(run.prompt), finals, req.n),
                                   "system_fingerprint": None})
        finally:
            if admitted:
                release(req.n)

    async def chat_stream(gen: Generation, req: ChatCompletionRequest, cid: str, model: str, prompt_len: int,
                          top_n: int, plan: ToolCallPlan | None):
        created = _now()
        include_usage = req.include_usage_in_stream
        finals: list[Any] = [None] * req.n
        calls = None if plan is None else [plan.stream() for _ in range(req.n)]

        def chunk(choices, usage_=None, with_usage_key=include_usage):
            d = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                 "system_fingerprint": None, "choices": choices}
            if with_usage_key:
                d["usage"] = usage_
            return sse_event(d)

        def events(i: int, out) -> list[bytes]:
            ev = []
            reason = finish_str(out.finish_reason) if out.finished else None
            complete = grammar_complete(reason, out.matched_stop, req.stop_token_ids)
            if calls is not None:  # tools: a call's arguments as tool_calls deltas, or a text answer's pieces
                delta = calls[i].update(out.new_text, reason, complete)
                if delta:
                    ev.append(chunk([{"index": i, "delta": delta, "finish_reason": None, "logprobs": None}]))
            elif out.new_text or (req.logprobs and out.logprobs):
                c = {"index": i, "delta": {"content": out.new_text}, "finish_reason": None,
                     "logprobs": texts.chat_logprobs([(list(out.new_token_ids), out.logprobs or [])], top_n)
                     if req.logprobs else None}
                ev.append(chunk([c]))
            if out.finished:
                finals[i] = out
                if calls is not None:
                    reason = calls[i].finish_reason(reason, complete)
                ev.append(chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}]))
                if reason == "error":  # the choice ends "error", then the error itself
                    ev.append(sse_event(generation_error(out).body()))
            return ev

        try:
            first = "" if calls is None else None  # a call's message has no content
            yield b"".join(chunk([{"index": i, "delta": {"role": "assistant", "content": first}, "logprobs": None,
                                   "finish_reason": None}]) for i in range(req.n))
            async for items in gen.batches():
                yield b"".join(e for i, out in items for e in events(i, out))
            if include_usage:
                yield chunk([], usage(prompt_len, finals, req.n))
            yield SSE_DONE
        finally:
            gen.abort()

    @app.post("/v1/responses")
    async def create_response(request: Request):
        rreq, req = responses.parse_request(await _read_json(request, config.max_body_bytes))
        try:
            run = await prepare_chat(req)
        except APIError as e:  # named as the Responses request has it
            e.param = responses.param_name(e.param)
            raise
        admit(1)
        admitted = True
        try:
            rid = new_id("resp")
            gen = start([run.prompt], run.params_list, run.grammar, rid, rreq.stream)
            created = responses.now()
            if rreq.stream:
                admitted = False  # the stream releases it
                return SSEResponse(response_stream(gen, rreq, req, rid, created, run),
                                   cleanup=_once(lambda: (gen.abort(), release(1))))
            try:
                outs, _ids, lps, finals = await collect(gen, request, 1)
            except _ClientGone:
                return Response(status_code=499)
            raise_engine_errors(finals)
            message, reason = answer_message(run, req, outs[0], finals[0])
            logprobs = texts.chat_logprobs(lps[0], run.top_n)["content"] if req.logprobs else None
            return _json_response(responses.response_object(
                rid, created, served, rreq, req, responses.status_of(reason),
                responses.output_items(message, logprobs), usage(len(run.prompt), finals)))
        finally:
            if admitted:
                release(1)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str):
        raise APIError(404, f"no response '{response_id}': this server stores no responses (answers come back "
                            "whole, or streamed, from POST /v1/responses)", param="response_id", code="not_found")

    async def response_stream(gen: Generation, rreq, req: ChatCompletionRequest, rid: str, created: int,
                              run: _ChatRun):
        shell = responses.response_object(rid, created, served, rreq, req, "in_progress", [], None)
        events = responses.ResponseEvents(shell)
        call = None if run.plan is None else run.plan.stream()
        try:
            yield b"".join(map(responses.sse, events.start()))
            async for items in gen.batches():
                out_events = []
                for _, out in items:
                    reason = finish_str(out.finish_reason) if out.finished else None
                    complete = grammar_complete(reason, out.matched_stop, req.stop_token_ids)
                    delta = call.update(out.new_text, reason, complete) if call is not None else (
                        {"content": out.new_text} if out.new_text or (req.logprobs and out.new_token_ids) else None)
                    if delta:
                        logprobs = (texts.chat_logprobs([(list(out.new_token_ids), out.logprobs or [])],
                                                        run.top_n)["content"] if req.logprobs else None)
                        out_events += events.delta(delta, logprobs)
                    if not out.finished:
                        continue
                    if reason == "error":
                        error = generation_error(out)
                        failed = {**shell, "status": "failed", "error": {"code": error.code or "server_error",
                                                                         "message": error.message}}
                        out_events.append(events.failed(failed))
                        continue
                    if call is not None:
                        reason = call.finish_reason(reason, complete)
                    out_events += events.finish(responses.response_object(
                        rid, created, served, rreq, req, responses.status_of(reason), [],
                        usage(len(run.prompt), [out])))
                yield b"".join(map(responses.sse, out_events))
        finally:
            gen.abort()

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = _parse(CompletionRequest, await _read_json(request, config.max_body_bytes))
        check_model(req.model)
        prompts: list[list[int]] = []
        for k, p in enumerate(req.prompts()):
            if isinstance(p, str):
                ids = engine.tokenizer.encode(p, add_special_tokens=False) if p else []
            elif isinstance(p, list) and all(isinstance(t, int) for t in p):
                params.check_token_ids(p, "prompt")
                ids = list(p)
            else:
                raise bad_request("prompt must be a string, a list of strings, a list of token ids, or a list of "
                                  "lists of token ids", param="prompt")
            if not ids:
                raise bad_request("the prompt is empty", param="prompt")
            prompts.append(ids)
        budgets = [params.token_budget(len(p), req.token_limit(), "prompt") for p in prompts]
        grammar = await compile_grammar(req)
        n = req.n
        top_n = req.logprobs or 0
        all_prompts, params_list = [], []
        prediction = await prediction_ids(req)
        for p, budget in zip(prompts, budgets):
            all_prompts += [p] * n
            params_list += params.sampling(req, budget, req.logprobs, prediction)
        total = len(all_prompts)
        admit(total)
        admitted = True
        try:
            cid = new_id("cmpl")
            gen = start(all_prompts, params_list, grammar, cid, req.stream)
            prompt_tokens = sum(len(p) for p in prompts)
            if req.stream:
                admitted = False
                return SSEResponse(completion_stream(gen, req, cid, total, prompt_tokens, top_n),
                                    cleanup=_once(lambda: (gen.abort(), release(total))))
            try:
                outs, _ids, lps, finals = await collect(gen, request, total)
            except _ClientGone:
                return Response(status_code=499)
            raise_engine_errors(finals)
            choices = [{"index": i, "text": outs[i],
                        "logprobs": texts.completion_logprobs(lps[i], top_n) if req.logprobs is not None else None,
                        "finish_reason": finish_str(finals[i].finish_reason)} for i in range(total)]
            return _json_response({"id": cid, "object": "text_completion", "created": _now(), "model": served,
                                   "choices": choices, "usage": usage(prompt_tokens, finals, n),
                                   "system_fingerprint": None})
        finally:
            if admitted:
                release(total)

    async def completion_stream(gen: Generation, req: CompletionRequest, cid: str, total: int, prompt_tokens: int,
                                top_n: int):
        created = _now()
        include_usage = req.include_usage_in_stream
        finals: list[Any] = [None] * total
        offsets = [0] * total

        def chunk(choices, usage_=None):
            d = {"id": cid, "object": "text_completion", "created": created, "model": served,
                 "system_fingerprint": None, "choices": choices}
            if include_usage:
                d["usage"] = usage_
            return sse_event(d)

        def events(i: int, out) -> list[bytes]:
            reason = finish_str(out.finish_reason) if out.finished else None
            if out.finished:
                finals[i] = out
            if reason == "error":
                return [sse_event(generation_error(out).body())]
            if not (out.new_text or out.finished):
                return []
            lp = None
            if req.logprobs is not None:
                lp = texts.completion_logprobs([(list(out.new_token_ids), out.logprobs or [])], top_n, offsets[i])
            offsets[i] += len(out.new_text)
            return [chunk([{"index": i, "text": out.new_text, "logprobs": lp, "finish_reason": reason}])]

        try:
            async for items in gen.batches():
                yield b"".join(e for i, out in items for e in events(i, out))
            if include_usage:
                yield chunk([], usage(prompt_tokens, finals, req.n))
            yield SSE_DONE
        finally:
            gen.abort()

    app.add_middleware(Gate, api_key=config.api_key, max_body_bytes=config.max_body_bytes, metrics=metrics)
    _warm_up(engine, served)
    return app


def _warm_up(engine, served: str) -> None:
    """What every request runs, once before the server takes any: parsing a request, the chat template,
    tokenizing and detokenizing. Their imports and caches start on first use, and in a fresh process
    that has no bytecode caches (a spawned front-end on a bare machine) they took seconds, which
    landed on the first requests each front-end served."""
    _parse(ChatCompletionRequest, {"model": served, "messages": [{"role": "user", "content": "warm-up"}],
                                   "response_format": {"type": "json_object"}, "stream": True})
    from ..engine.detokenizer import IncrementalDetokenizer
    ids = engine.chat_prompt([{"role": "user", "content": "warm-up"}])
    IncrementalDetokenizer(engine.tokenizer, ids[:-2], []).add(ids[-2:])


def _once(fn):
    done = []

    def wrapper():
        if not done:
            done.append(True)
            fn()
    return wrapper


class _ClientGone(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _template_message(m) -> dict:
    """A request message as the chat template takes it: `developer` as `system`; an assistant turn's
    tool calls and a tool's result as text."""
    if m.role == "developer":
        return {"role": "system", "content": m.text()}
    if m.role == "assistant" and m.tool_calls:
        return {"role": "assistant", "content": history_text(m.text(), m.tool_calls)}
    return {"role": m.role, "content": m.text()}


def _is_grammar_error(e: Exception) -> bool:
    return any(c.__name__ == "GrammarError" for c in type(e).__mro__)


def _is_grammar_busy(e: Exception) -> bool:
    return type(e).__name__ == "GrammarBusy"


def _now() -> int:
    import time
    return int(time.time())


def _version() -> str:
    try:
        from .. import __version__
        return __version__
    except Exception:
        return "0"

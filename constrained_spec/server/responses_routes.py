"""``POST /v1/responses`` (the Responses API over the chat route's steps; `responses.py` converts
between the two protocols), and ``GET``/``DELETE /v1/responses/{id}`` over the stored responses
(`response_store.py`)."""
from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from . import responses
from .constraints import constraint_param
from .errors import APIError, bad_request
from .generation import Generation, SSEResponse, finish_str
from .json_io import json_response, read_json
from .protocol import ChatCompletionRequest, new_id
from .service import ChatRun, ClientGone, Service, answer_message, collect, once, usage
from .tokens import logprob_chunk
from .tool_stops import engine_params, watch_stops
from .tools import grammar_complete

log = logging.getLogger(__name__)


def add_responses_routes(app: FastAPI, service: Service) -> None:
    config, texts, served = service.config, service.texts, service.served

    @app.post("/v1/responses")
    async def create_response(request: Request):
        data = await read_json(request, config.max_body_bytes)
        rreq = responses.parse(data)
        history = []
        if rreq.previous_response_id is not None:
            history = (await stored(rreq.previous_response_id, "previous_response_id"))[1]
        req = responses.chat_request(rreq, data, history)
        service.admit(1)  # before its prompt and grammar work (as the chat route's)
        admitted = True
        try:
            try:
                run = await service.prepare_chat(req, request)
            except APIError as e:  # named as the Responses request has it
                responses.in_responses_terms(e)
                raise
            rid = new_id("resp", "_")
            watched = run.plan is not None and bool(run.plan.stop)  # (as the chat route's)
            gen = service.start([run.prompt], engine_params(run.plan, run.params_list), run.grammar, rid,
                                rreq.stream or watched)
            created = responses.now()
            param = constraint_param(req)  # the field an error of its grammar names (the chat request's)
            if rreq.stream:
                try:
                    await service.open_stream(gen, request, run.grammar, param)
                except APIError as e:
                    responses.in_responses_terms(e)
                    raise
                admitted = False  # the stream releases it
                return SSEResponse(response_stream(watch_stops(gen, run.plan, 1), rreq, req, rid, created, run,
                                                   history, param),
                                   cleanup=once(lambda: (gen.abort(), service.release(1))))
            try:
                outs, _ids, lps, finals = await collect(watch_stops(gen, run.plan, 1), request, 1)
            except ClientGone:
                return Response(status_code=499)
            try:
                service.raise_engine_errors(finals, param)
            except APIError as e:  # named as the Responses request has it
                responses.in_responses_terms(e)
                raise
            message, reason = answer_message(run, req, outs[0], finals[0])
            logprobs = texts.chat_logprobs(lps[0], run.top_n)["content"] if req.logprobs else None
            status = responses.status_of(reason)
            response = responses.response_object(rid, created, served, rreq, req, status,
                                                 responses.output_items(message, logprobs, status),
                                                 usage(len(run.prompt), finals))
            await store(rreq, history, response)
            return json_response(response)
        finally:
            if admitted:
                service.release(1)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return json_response((await stored(response_id, "response_id"))[0])

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, after: str | None = None, limit: int = 20, order: str = "desc"):
        if not 1 <= limit <= 100:
            raise bad_request("limit must be between 1 and 100", param="limit")
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'", param="order")
        return json_response(responses.items_page((await stored(response_id, "response_id"))[2], after, limit, order))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not await service.stored_responses("delete", response_id):
            raise not_found(response_id, "response_id")
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def stored(response_id: str, param: str) -> tuple[dict, list[dict], list[dict]]:
        """(the response object, the conversation it ends, its input items)."""
        blob = await service.stored_responses("get", response_id)
        if blob is None:
            raise not_found(response_id, param)
        return tuple(orjson.loads(blob))

    async def store(rreq, history: list[dict], response: dict) -> None:
        """Keeps a finished response and the conversation it ends (unless `store` is false). The
        answer goes out even where storing fails (the engine process gone): it is logged."""
        if not rreq.store:
            return
        try:
            blob = orjson.dumps([response, responses.conversation(history, rreq, response["output"]),
                                 responses.input_items(rreq)])
            await service.stored_responses("put", response["id"], blob)
        except Exception:
            log.exception("storing response %s failed", response["id"])

    async def response_stream(gen: Generation, rreq, req: ChatCompletionRequest, rid: str, created: int,
                              run: ChatRun, history: list[dict], param: str | None):
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
                        logprobs = (texts.chat_logprobs([logprob_chunk(out)],
                                                        run.top_n)["content"] if req.logprobs else None)
                        out_events += events.delta(delta, logprobs)
                    if not out.finished:
                        continue
                    if reason == "error":
                        error = service.generation_error(out, param)
                        # OpenAI's codes are an enum (the openai package's ResponseError.code): ours in the message
                        code = "invalid_prompt" if error.status < 500 else "server_error"
                        failed = {**shell, "status": "failed",
                                  "error": {"code": code, "message": f"{error.code or code}: {error.message}"}}
                        out_events += events.failed(failed)
                        continue
                    if call is not None:
                        reason = call.finish_reason(reason, complete)
                    out_events += events.finish(responses.response_object(
                        rid, created, served, rreq, req, responses.status_of(reason), [],
                        usage(len(run.prompt), [out])))
                    await store(rreq, history, out_events[-1]["response"])
                yield b"".join(map(responses.sse, out_events))
        finally:
            gen.abort()


def not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"no stored response '{response_id}' (the least recently used go first when the store is "
                         "full; a restart forgets them unless the server keeps a --response-store file; "
                         "`store: false` keeps none)",
                    param=param, code="not_found")

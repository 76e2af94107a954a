"""``POST /v1/responses`` (the Responses API over the chat route's steps; `responses.py` converts
between the two protocols) and ``GET``/``DELETE /v1/responses/{id}``, which find nothing stored."""
from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.responses import Response

from . import responses
from .errors import APIError
from .generation import Generation, SSEResponse, finish_str
from .json_io import json_response, read_json
from .protocol import ChatCompletionRequest, new_id
from .service import ChatRun, ClientGone, Service, answer_message, collect, once, usage
from .tools import grammar_complete


def add_responses_routes(app: FastAPI, service: Service) -> None:
    config, texts, served = service.config, service.texts, service.served

    @app.post("/v1/responses")
    async def create_response(request: Request):
        rreq, req = responses.parse_request(await read_json(request, config.max_body_bytes))
        try:
            run = await service.prepare_chat(req)
        except APIError as e:  # named as the Responses request has it
            e.param = responses.param_name(e.param)
            raise
        service.admit(1)
        admitted = True
        try:
            rid = new_id("resp")
            gen = service.start([run.prompt], run.params_list, run.grammar, rid, rreq.stream)
            created = responses.now()
            if rreq.stream:
                admitted = False  # the stream releases it
                return SSEResponse(response_stream(gen, rreq, req, rid, created, run),
                                   cleanup=once(lambda: (gen.abort(), service.release(1))))
            try:
                outs, _ids, lps, finals = await collect(gen, request, 1)
            except ClientGone:
                return Response(status_code=499)
            service.raise_engine_errors(finals)
            message, reason = answer_message(run, req, outs[0], finals[0])
            logprobs = texts.chat_logprobs(lps[0], run.top_n)["content"] if req.logprobs else None
            return json_response(responses.response_object(
                rid, created, served, rreq, req, responses.status_of(reason),
                responses.output_items(message, logprobs), usage(len(run.prompt), finals)))
        finally:
            if admitted:
                service.release(1)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str):
        raise APIError(404, f"no response '{response_id}': this server stores no responses (answers come back "
                            "whole, or streamed, from POST /v1/responses)", param="response_id", code="not_found")

    async def response_stream(gen: Generation, rreq, req: ChatCompletionRequest, rid: str, created: int,
                              run: ChatRun):
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
                        error = service.generation_error(out)
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

"""``POST /v1/chat/completions``: a chat request answered in one piece or streamed as server-sent
events (with tools: the call's arguments as `tool_calls` deltas)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from .generation import Generation, SSEResponse, finish_str, sse_body, sse_event, stream_chunk
from .json_io import json_response, parse, read_json
from .constraints import constraint_param
from .protocol import ChatCompletionRequest, new_id
from .service import ClientGone, Service, answer_message, collect, now, once, usage
from .tokens import logprob_chunk
from .tool_stops import engine_params, watch_stops
from .tools import ToolCallPlan, grammar_complete


def add_chat_routes(app: FastAPI, service: Service) -> None:
    config, texts, served = service.config, service.texts, service.served

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await read_json(request, config.max_body_bytes))
        service.admit(req.n)  # before its prompt and grammar work: a refused request costs none (QA 1130b soak D2)
        admitted = True
        try:
            run = await service.prepare_chat(req, request)
            cid = new_id("chatcmpl")
            # an envelope's stop strings are matched here, in its visible text (`VisibleStops`), as the
            # engine's updates come: each step's, also for a whole answer
            watched = run.plan is not None and bool(run.plan.stop)
            gen = service.start([run.prompt] * req.n, engine_params(run.plan, run.params_list), run.grammar, cid,
                                req.stream or watched)
            model = served
            param = constraint_param(req)  # the field an error of the request's grammar names
            if req.stream:
                await service.open_stream(gen, request, run.grammar, param)
                admitted = False  # the stream releases it
                return SSEResponse(chat_stream(watch_stops(gen, run.plan, req.n), req, cid, model, len(run.prompt),
                                               run.top_n, run.plan, param),
                                   cleanup=once(lambda: (gen.abort(), service.release(req.n))))
            try:
                outs, _ids, lps, finals = await collect(watch_stops(gen, run.plan, req.n), request, req.n)
            except ClientGone:
                return Response(status_code=499)
            service.raise_engine_errors(finals, param)
            choices = []
            for i in range(req.n):
                message, reason = answer_message(run, req, outs[i], finals[i])
                choice = {"index": i, "message": message,
                          "logprobs": texts.chat_logprobs(lps[i], run.top_n) if req.logprobs else None,
                          "finish_reason": reason}
                choices.append(choice)
            return json_response({"id": cid, "object": "chat.completion", "created": now(), "model": model,
                                  "choices": choices, "usage": usage(len(run.prompt), finals, req.n),
                                  "system_fingerprint": None})
        finally:
            if admitted:
                service.release(req.n)

    async def chat_stream(gen: Generation, req: ChatCompletionRequest, cid: str, model: str, prompt_len: int,
                          top_n: int, plan: ToolCallPlan | None, param: str | None):
        created = now()
        include_usage = req.include_usage_in_stream
        finals: list[Any] = [None] * req.n
        calls = None if plan is None else [plan.stream() for _ in range(req.n)]

        def chunk(choices, usage_=None):
            return stream_chunk("chat.completion.chunk", cid, created, model, choices, usage_, include_usage)

        def events(i: int, out) -> list[bytes]:
            ev = []
            reason = finish_str(out.finish_reason) if out.finished else None
            complete = grammar_complete(reason, out.matched_stop, req.stop_token_ids)
            if calls is not None:  # tools: a call's arguments as tool_calls deltas, or a text answer's pieces
                delta = calls[i].update(out.new_text, reason, complete)
                if delta:
                    ev.append(chunk([{"index": i, "delta": delta, "finish_reason": None, "logprobs": None}]))
            else:
                tokens = logprob_chunk(out) if req.logprobs else None
                if out.new_text or (tokens and tokens[0]):
                    c = {"index": i, "delta": {"content": out.new_text}, "finish_reason": None,
                         "logprobs": texts.chat_logprobs([tokens], top_n) if tokens else None}
                    ev.append(chunk([c]))
            if out.finished:
                finals[i] = out
                if reason == "error":  # the error itself, no finish chunk: "error" is no finish_reason of
                    # OpenAI's, and a client that stops at the first finish_reason would not see the error
                    ev.append(sse_event(service.generation_error(out, param).body()))
                    return ev
                if calls is not None:
                    reason = calls[i].finish_reason(reason, complete)
                ev.append(chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}]))
            return ev

        try:
            first = "" if calls is None else None  # a call's message has no content
            yield b"".join(chunk([{"index": i, "delta": {"role": "assistant", "content": first}, "logprobs": None,
                                   "finish_reason": None}]) for i in range(req.n))
            async for body in sse_body(gen, events, lambda: chunk([], usage(prompt_len, finals, req.n))
                                       if include_usage else b""):
                yield body
        finally:
            gen.abort()

"""``POST /v1/completions``: text completions of one prompt or several (strings or token ids), n
choices each, answered in one piece or streamed as server-sent events."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from .constraints import constraint_param
from .errors import bad_request
from .generation import Generation, SSEResponse, finish_str, sse_body, sse_event, stream_chunk
from .json_io import json_response, parse, read_json
from .protocol import CompletionRequest, new_id
from .service import ClientGone, Service, collect, now, once, usage
from .tokens import logprob_chunk


def add_completions_routes(app: FastAPI, service: Service) -> None:
    engine, config, texts, params, served = (service.engine, service.config, service.texts, service.params,
                                             service.served)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = parse(CompletionRequest, await read_json(request, config.max_body_bytes))
        service.check_model(req.model)
        total = len(req.prompts()) * req.n
        service.admit(total)  # before its prompt and grammar work (as the chat route's)
        admitted = True
        try:
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
            grammar = await service.compile_grammar(req, request=request)
            n = req.n
            top_n = req.logprobs or 0
            all_prompts, params_list = [], []
            prediction = await service.prediction_ids(req)
            for p, budget in zip(prompts, budgets):
                all_prompts += [p] * n
                params_list += params.sampling(req, budget, req.logprobs, prediction)
            cid = new_id("cmpl")
            gen = service.start(all_prompts, params_list, grammar, cid, req.stream)
            prompt_tokens = sum(len(p) for p in prompts)
            param = constraint_param(req)  # the field an error of the request's grammar names
            if req.stream:
                await service.open_stream(gen, request, grammar, param)
                admitted = False
                return SSEResponse(completion_stream(gen, req, cid, total, prompt_tokens, top_n, param),
                                   cleanup=once(lambda: (gen.abort(), service.release(total))))
            try:
                outs, _ids, lps, finals = await collect(gen, request, total)
            except ClientGone:
                return Response(status_code=499)
            service.raise_engine_errors(finals, param)
            choices = [{"index": i, "text": outs[i],
                        "logprobs": texts.completion_logprobs(lps[i], top_n) if req.logprobs is not None else None,
                        "finish_reason": finish_str(finals[i].finish_reason)} for i in range(total)]
            return json_response({"id": cid, "object": "text_completion", "created": now(), "model": served,
                                  "choices": choices, "usage": usage(prompt_tokens, finals, n),
                                  "system_fingerprint": None})
        finally:
            if admitted:
                service.release(total)

    async def completion_stream(gen: Generation, req: CompletionRequest, cid: str, total: int, prompt_tokens: int,
                                top_n: int, param: str | None):
        created = now()
        include_usage = req.include_usage_in_stream
        finals: list[Any] = [None] * total
        offsets = [0] * total

        def chunk(choices, usage_=None):
            return stream_chunk("text_completion", cid, created, served, choices, usage_, include_usage)

        def events(i: int, out) -> list[bytes]:
            reason = finish_str(out.finish_reason) if out.finished else None
            if out.finished:
                finals[i] = out
            if reason == "error":
                return [sse_event(service.generation_error(out, param).body())]
            if not (out.new_text or out.finished):
                return []
            lp = None
            if req.logprobs is not None:
                lp = texts.completion_logprobs([logprob_chunk(out)], top_n, offsets[i])
            offsets[i] += len(out.new_text)
            return [chunk([{"index": i, "text": out.new_text, "logprobs": lp, "finish_reason": reason}])]

        try:
            async for body in sse_body(gen, events, lambda: chunk([], usage(prompt_tokens, finals, req.n))
                                       if include_usage else b""):
                yield body
        finally:
            gen.abort()

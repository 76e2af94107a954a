"""One HTTP request's engine requests (n choices) as an async stream of their updates, and the
server-sent-events response that carries a stream to the client."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import orjson
from starlette.responses import StreamingResponse

from ..engine.delivery import LoopDelivery
from ..engine.request import FinishReason, RequestOutput
from .engine_client import EngineClient

_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def finish_str(reason) -> str | None:
    if reason is None:
        return None
    return _FINISH.get(getattr(reason, "value", str(reason)), "stop")


class Generation:
    """n engine requests whose updates arrive, tagged with their choice index, on one asyncio queue."""

    def __init__(self, engine, prompts: list[list[int]], params_list: list, grammar, base_id: str, stream: bool):
        delivery = LoopDelivery.for_loop(asyncio.get_running_loop())
        # the engine process's client sends a non-streamed request's output in one piece at its end;
        # a streamed one with a grammar is announced once its grammar compiled (`Service.open_stream`)
        options = {"stream": stream} if isinstance(engine, EngineClient) else {"announce": stream}
        self.engine = engine
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request_ids: list[str] = []
        self.done = [False] * len(prompts)
        self.closed = False
        self._head: list[tuple[int, Any]] = []  # updates taken by `first`, not yet iterated
        self._ended = [False] * len(prompts)  # a choice's last update is queued (the event loop's)
        self._made = [0] * len(prompts)  # its tokens so far, as its last update queued said

        def make_cb(i):
            def cb(out):
                delivery.put(self._put, (i, out))
            return cb

        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                engine.add_request(prompt, params, grammar, make_cb(i), request_id=rid, **options)
                self.request_ids.append(rid)
        except BaseException:
            self.abort()
            raise

    async def first(self) -> Any:
        """The first update (of any choice), waited for; the iteration still yields it."""
        if not self._head:
            self._head.append(await self.queue.get())
        return self._head[0][1]

    async def __aiter__(self) -> AsyncIterator[tuple[int, Any]]:
        while not all(self.done):
            i, out = self._head.pop(0) if self._head else await self.queue.get()
            if out.finished:
                self.done[i] = True
            yield i, out

    async def batches(self) -> AsyncIterator[list[tuple[int, Any]]]:
        """The updates in hand each time the stream is ready for more, one per choice: when the
        event loop falls behind, a choice's updates of several steps become one event and the
        stream one write. Under load a front-end then spends less per token, where it would
        otherwise fall further behind (and its client parses fewer events)."""
        queue = self.queue
        while not all(self.done):
            items, self._head = self._head or [await queue.get()], []
            while not queue.empty():
                items.append(queue.get_nowait())
            for i, out in items:
                if out.finished:
                    self.done[i] = True
            yield coalesce(items) if len(items) > 1 else items

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        for i, rid in enumerate(self.request_ids):
            if not self.done[i]:
                self.engine.abort(rid)

    def end_choice(self, i: int) -> None:
        """Ends choice `i` here, its caller having found its end (a stop string in what a tool call
        shows: `tool_stops.VisibleStops`): aborted in the engine, whose end for it will not come,
        and what the engine made for it since dropped."""
        self._ended[i] = self.done[i] = True
        self.engine.abort(self.request_ids[i])

    def _put(self, item: tuple[int, Any]) -> None:
        i, out = item
        if self._ended[i]:  # ended by `end` (what the engine made since is dropped)
            return
        self._ended[i] = out.finished
        self._made[i] = out.completion_tokens
        self.queue.put_nowait(item)

    def end(self, error: str, kind: str) -> None:
        """Ends every choice still going with an error of `kind` (the event loop's; the server's
        shutdown): aborted in the engine, and its last update, that error, queued, so the request
        answers as a request the engine failed does (its route's error, or a stream's error event
        and its end)."""
        if self.closed:
            return
        for i, rid in enumerate(self.request_ids):
            if not self._ended[i]:
                self.engine.abort(rid)
                self._ended[i] = True
                self.queue.put_nowait((i, RequestOutput(rid, "", [], True, FinishReason.ERROR, error,
                                                        completion_tokens=self._made[i], error_kind=kind)))


def coalesce(items: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """(choice, update) pairs in arrival order -> one update per choice, each choice's in order joined."""
    joined: dict[int, Any] = {}
    for i, out in items:
        prev = joined.get(i)
        joined[i] = out if prev is None else join_outputs(prev, out)
    return list(joined.items())


def join_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive updates of one request as one (b's end state, both updates' tokens)."""
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return RequestOutput(b.request_id, a.new_text + b.new_text, a.new_token_ids + b.new_token_ids,
                         b.finished, b.finish_reason, b.error, b.prompt_tokens, b.completion_tokens, logprobs,
                         b.matched_stop, b.cached_tokens, b.error_kind)


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator and runs `cleanup`, so a client that
    disconnects (even before the first chunk) aborts its engine requests and frees their KV at once."""

    def __init__(self, content, cleanup, **kw):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kw)
        self.cleanup = cleanup

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self.cleanup()


def sse_event(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def stream_chunk(kind: str, cid: str, created: int, model: str, choices: list, usage: Any = None,
                 with_usage: bool = False) -> bytes:
    """One chunk of a streamed chat completion or completion (`kind`: its "object"), as an SSE event;
    `with_usage`: the "usage" key is sent (null but in the last chunk) when the client asked for it."""
    d = {"id": cid, "object": kind, "created": created, "model": model, "system_fingerprint": None,
         "choices": choices}
    if with_usage:
        d["usage"] = usage
    return sse_event(d)


SSE_DONE = b"data: [DONE]\n\n"


async def sse_body(gen, events, tail):
    """The rest of a streamed chat completion's or completion's body: each batch of updates as the
    events `events(choice index, output)` makes of them, then `tail()` (the usage chunk, or b"")
    and [DONE]."""
    async for items in gen.batches():
        yield b"".join(e for i, out in items for e in events(i, out))
    yield tail() + SSE_DONE

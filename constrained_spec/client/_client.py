"""Python SDK for a constrained-spec server: `Client` (sync) and `AsyncClient` (asyncio).

    from pydantic import BaseModel
    from constrained_spec.client import Client

    class City(BaseModel):
        name: str
        population: int

    with Client("http://127.0.0.1:8000") as client:
        city = client.parse("Describe Paris.", response_model=City)      # a validated City
        reply = client.chat("Say hello", max_tokens=32)                  # a ChatCompletion
        for delta in client.chat("Count to five", stream=True).text_deltas():
            print(delta, end="")

Only httpx and pydantic are needed (no torch): the client can run anywhere.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any, AsyncIterator, Iterator, Literal, Mapping, Sequence, TypeVar, Union, overload

import httpx
from pydantic import BaseModel, ValidationError

from ..server.protocol import ChatCompletion, ChatCompletionChunk, Completion, ModelCard

API_KEY_ENV = "CONSTRAINED_SPEC_API_KEY"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"

T = TypeVar("T", bound=BaseModel)
Messages = Union[str, Sequence[Mapping[str, Any]]]
SchemaLike = Union[Mapping[str, Any], type[BaseModel]]


class APIError(Exception):
    """The server answered with an error (any non-2xx status)."""

    def __init__(self, status_code: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None, body: Any = None, headers: Mapping[str, str] | None = None):
        super().__init__(f"{status_code} {message}")
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.body = body
        self.headers = dict(headers or {})


class ParseError(ValueError):
    """`parse` got output that is not a valid instance of the response model."""

    def __init__(self, message: str, text: str, finish_reason: str | None, completion: ChatCompletion | None = None):
        super().__init__(message)
        self.text = text
        self.finish_reason = finish_reason
        self.completion = completion


# -- request building ---------------------------------------------------------------------------------


def _messages(messages: Messages, system: str | None = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append({"role": "system", "content": system})
    if isinstance(messages, str):
        out.append({"role": "user", "content": messages})
    else:
        out.extend(dict(m) for m in messages)
    return out


def schema_of(schema: SchemaLike) -> dict[str, Any]:
    """A JSON schema dict from a dict or a pydantic model class."""
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return schema.model_json_schema()
    return dict(schema)


def _response_format(response_format: Mapping[str, Any] | None, json_schema: SchemaLike | None,
                     schema_name: str | None, strict: bool) -> dict[str, Any] | None:
    if json_schema is None:
        return dict(response_format) if response_format is not None else None
    if response_format is not None:
        raise ValueError("give either response_format or json_schema, not both")
    name = schema_name or (json_schema.__name__ if isinstance(json_schema, type) else "response")
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema_of(json_schema), "strict": strict}}


def _body(base: dict[str, Any], **fields: Any) -> dict[str, Any]:
    extra = fields.pop("extra_body", None) or {}
    for k, v in fields.items():
        if v is not None:
            base[k] = v
    base.update(extra)
    return base


def _chat_body(default_model: str | None, messages: Messages, *, model: str | None, system: str | None,
               stream: bool, max_tokens: int | None, temperature: float | None, top_p: float | None,
               seed: int | None, stop: str | list[str] | None, n: int | None, frequency_penalty: float | None,
               presence_penalty: float | None, logprobs: bool | None, top_logprobs: int | None,
               response_format: Mapping[str, Any] | None, json_schema: SchemaLike | None, schema_name: str | None,
               strict: bool, regex: str | None, ebnf: str | None, choice: Sequence[str] | None,
               include_usage: bool | None, extra_body: Mapping[str, Any] | None,
               tools: Sequence[Mapping[str, Any]] | None = None,
               tool_choice: str | Mapping[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": _messages(messages, system)}
    if model or default_model:
        body["model"] = model or default_model
    if stream:
        body["stream"] = True
        if include_usage is not False:
            body["stream_options"] = {"include_usage": True}
    return _body(body, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop, n=n,
                 frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, logprobs=logprobs,
                 top_logprobs=top_logprobs,
                 response_format=_response_format(response_format, json_schema, schema_name, strict),
                 regex=regex, ebnf=ebnf, choice=list(choice) if choice is not None else None,
                 tools=list(tools) if tools is not None else None, tool_choice=tool_choice,
                 extra_body=dict(extra_body or {}))


def _completion_body(default_model: str | None, prompt: str | list[int], *, model: str | None, stream: bool,
                     max_tokens: int | None, temperature: float | None, top_p: float | None, seed: int | None,
                     stop: str | list[str] | None, n: int | None, logprobs: int | None,
                     json_schema: SchemaLike | None, regex: str | None, ebnf: str | None,
                     choice: Sequence[str] | None, include_usage: bool | None,
                     extra_body: Mapping[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt}
    if model or default_model:
        body["model"] = model or default_model
    if stream:
        body["stream"] = True
        if include_usage is not False:
            body["stream_options"] = {"include_usage": True}
    return _body(body, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop, n=n,
                 logprobs=logprobs, response_format=_response_format(None, json_schema, None, True), regex=regex,
                 ebnf=ebnf, choice=list(choice) if choice is not None else None, extra_body=dict(extra_body or {}))


def _raise_for(resp: httpx.Response, body: bytes | None = None) -> None:
    if resp.status_code < 400:
        return
    raw = body if body is not None else resp.content
    try:
        data = json.loads(raw)
        err = data.get("error", {}) if isinstance(data, dict) else {}
    except ValueError:
        data, err = raw.decode("utf-8", "replace"), {}
    if not isinstance(err, dict):  # /health's 503 says {"status": "unhealthy", "error": "<why>"}
        err = {"message": str(err)}
    raise APIError(resp.status_code, err.get("message") or str(data) or resp.reason_phrase, err.get("type"),
                   err.get("param"), err.get("code"), data, resp.headers)


def _unhealthy(e: APIError) -> dict[str, Any]:
    """/health's 503 body (status "unhealthy", and why); any other error raises."""
    if e.status_code == 503 and isinstance(e.body, dict) and e.body.get("status") == "unhealthy":
        return e.body
    raise e


def _retry_after(resp: httpx.Response) -> float:
    try:
        return min(max(float(resp.headers.get("retry-after", "1")), 0.05), 30.0)
    except ValueError:
        return 1.0


def _sse_data(line: str) -> str | None:
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


# a streamed error comes after the 200 went out: the status the same error has unstreamed
_UNAVAILABLE = frozenset({"engine_unavailable", "server_busy", "queue_full", "server_shutting_down"})


def _stream_error_status(err: dict) -> int:
    if err.get("code") in _UNAVAILABLE:
        return 503
    return 400 if err.get("type") == "invalid_request_error" else 500


def _parse_chunk(data: str, kind: type[BaseModel]):
    obj = json.loads(data)
    if isinstance(obj, dict) and "error" in obj and "choices" not in obj:
        err = obj["error"] or {}
        raise APIError(_stream_error_status(err), err.get("message", "stream error"), err.get("type"),
                       err.get("param"), err.get("code"), obj)
    return kind.model_validate(obj)


def _validate(response_model: type[T], completion: ChatCompletion) -> T:
    choice = completion.choices[0]
    text = choice.message.content or ""
    if choice.finish_reason == "length":
        raise ParseError("the output hit max_tokens before the JSON was complete; raise max_tokens", text,
                         choice.finish_reason, completion)
    try:
        return response_model.model_validate_json(text)
    except ValidationError as e:
        raise ParseError(f"the output does not validate as {response_model.__name__}: {e}", text,
                         choice.finish_reason, completion) from e


# -- streams --------------------------------------------------------------------------------------------


_DONE = object()


class _StreamState:
    """What both streams keep of the chunks they read: the usage (last chunk with one) and each
    choice's finish reason."""

    def __init__(self, response: httpx.Response, kind: type[BaseModel]):
        self.response = response
        self._kind = kind
        self.usage = None
        self.finish_reasons: dict[int, str] = {}

    def _take(self, line: str):
        """The chunk of one SSE line; None for a line without data, _DONE at the end."""
        data = _sse_data(line)
        if data is None:
            return None
        if data == "[DONE]":
            return _DONE
        chunk = _parse_chunk(data, self._kind)
        if getattr(chunk, "usage", None) is not None:
            self.usage = chunk.usage
        for c in chunk.choices:
            if c.finish_reason is not None:
                self.finish_reasons[c.index] = c.finish_reason
        return chunk


def _pieces(chunk, index: int) -> Iterator[str]:
    """Choice `index`'s new text in a chunk (chat delta or completion text)."""
    for c in chunk.choices:
        if c.index == index:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            if piece:
                yield piece


class ChatStream(_StreamState):
    """An iterator over ChatCompletionChunk; also a context manager that closes the connection.

    Leaving it early (break, close()) closes the connection, and the server aborts the request."""

    def __init__(self, response: httpx.Response, kind: type[BaseModel] = ChatCompletionChunk):
        super().__init__(response, kind)
        self._lines = response.iter_lines()

    def __iter__(self) -> Iterator[Any]:
        try:
            for line in self._lines:
                chunk = self._take(line)
                if chunk is _DONE:
                    return
                if chunk is not None:
                    yield chunk
        finally:
            self.close()

    def text_deltas(self, index: int = 0) -> Iterator[str]:
        """Just the new text of choice `index`, piece by piece."""
        for chunk in self:
            yield from _pieces(chunk, index)

    def text(self, index: int = 0) -> str:
        """Reads the stream to the end and returns choice `index`'s full text."""
        return "".join(self.text_deltas(index))

    def close(self) -> None:
        self.response.close()

    def __enter__(self) -> "ChatStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncChatStream(_StreamState):
    """Async iterator over ChatCompletionChunk; `async with` closes the connection."""

    def __init__(self, response: httpx.Response, kind: type[BaseModel] = ChatCompletionChunk):
        super().__init__(response, kind)

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            async for line in self.response.aiter_lines():
                chunk = self._take(line)
                if chunk is _DONE:
                    return
                if chunk is not None:
                    yield chunk
        finally:
            await self.aclose()

    async def text_deltas(self, index: int = 0) -> AsyncIterator[str]:
        async for chunk in self:
            for piece in _pieces(chunk, index):
                yield piece

    async def text(self, index: int = 0) -> str:
        return "".join([p async for p in self.text_deltas(index)])

    async def aclose(self) -> None:
        await self.response.aclose()

    async def __aenter__(self) -> "AsyncChatStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


# -- clients --------------------------------------------------------------------------------------------


class _Base:
    def __init__(self, base_url: str | None, api_key: str | None, model: str | None, max_retries: int):
        base_url = (base_url or os.environ.get("CONSTRAINED_SPEC_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        if base_url.endswith("/v1"):
            base_url = base_url[:-3]
        self.base_url = base_url
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.model = model
        self.max_retries = max_retries

    def _headers(self) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


class Client(_Base):
    """Synchronous client.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is fine). Default:
            ``$CONSTRAINED_SPEC_BASE_URL`` or ``http://127.0.0.1:8000``.
        api_key: sent as ``Authorization: Bearer``; default ``$CONSTRAINED_SPEC_API_KEY``.
        model: model id for requests that give none; default: the server's (it serves one model).
        timeout: seconds per request (streams: between chunks).
        max_retries: retries of a 503 (server busy), after the server's Retry-After.
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, model: str | None = None,
                 timeout: float = 600.0, max_retries: int = 2, http_client: httpx.Client | None = None):
        super().__init__(base_url, api_key, model, max_retries)
        self._http = http_client or httpx.Client(base_url=self.base_url, timeout=timeout)
        self._owns_http = http_client is None

    # plumbing
    def _send(self, method: str, path: str, body: Any = None, stream: bool = False,
              retries: int | None = None) -> httpx.Response:
        attempt, retries = 0, self.max_retries if retries is None else retries
        while True:
            req = self._http.build_request(method, self.base_url + path, json=body, headers=self._headers())
            resp = self._http.send(req, stream=stream)
            if resp.status_code == 503 and attempt < retries:
                attempt += 1
                resp.close()
                time.sleep(_retry_after(resp))
                continue
            if resp.status_code >= 400:
                content = resp.read()
                resp.close()
                _raise_for(resp, content)
            return resp

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # endpoints
    def models(self) -> list[ModelCard]:
        """The models the server serves (`GET /v1/models`)."""
        return [ModelCard.model_validate(m) for m in self._send("GET", "/v1/models").json()["data"]]

    def health(self) -> dict[str, Any]:
        """`GET /health`: status, model, KV-cache use; an unhealthy server's answer (503: status
        "unhealthy" and why) is returned at once, not retried."""
        try:
            return self._send("GET", "/health", retries=0).json()
        except APIError as e:
            return _unhealthy(e)

    @overload
    def chat(self, messages: Messages, *, stream: Literal[False] = False, **kw: Any) -> ChatCompletion: ...

    @overload
    def chat(self, messages: Messages, *, stream: Literal[True], **kw: Any) -> ChatStream: ...

    def chat(self, messages: Messages, *, model: str | None = None, system: str | None = None, stream: bool = False,
             max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
             seed: int | None = None, stop: str | list[str] | None = None, n: int | None = None,
             frequency_penalty: float | None = None, presence_penalty: float | None = None,
             logprobs: bool | None = None, top_logprobs: int | None = None,
             response_format: Mapping[str, Any] | None = None, json_schema: SchemaLike | None = None,
             schema_name: str | None = None, strict: bool = True, regex: str | None = None, ebnf: str | None = None,
             choice: Sequence[str] | None = None, include_usage: bool | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str | Mapping[str, Any] | None = None,
             extra_body: Mapping[str, Any] | None = None) -> ChatCompletion | ChatStream:
        """`POST /v1/chat/completions`.

        `messages` is a list of ``{"role", "content"}`` dicts or one string (a user message). At most
        one constraint: `json_schema` (a dict or a pydantic model class), `response_format` (OpenAI's
        dict), `regex`, `ebnf`, `choice`, or `tools` with `tool_choice` (OpenAI's; the calls come in
        ``message.tool_calls``). With ``stream=True`` returns a ChatStream of chunks.
        Raises APIError on an error status.
        """
        body = _chat_body(self.model, messages, model=model, system=system, stream=stream, max_tokens=max_tokens,
                          temperature=temperature, top_p=top_p, seed=seed, stop=stop, n=n,
                          frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, logprobs=logprobs,
                          top_logprobs=top_logprobs, response_format=response_format, json_schema=json_schema,
                          schema_name=schema_name, strict=strict, regex=regex, ebnf=ebnf, choice=choice,
                          include_usage=include_usage, tools=tools, tool_choice=tool_choice, extra_body=extra_body)
        if stream:
            return ChatStream(self._send("POST", "/v1/chat/completions", body, stream=True))
        return ChatCompletion.model_validate(self._send("POST", "/v1/chat/completions", body).json())

    def chat_text(self, messages: Messages, **kw: Any) -> str:
        """Like `chat`, returning just the first choice's text."""
        return self.chat(messages, **kw).choices[0].message.content or ""

    def parse(self, messages: Messages, response_model: type[T], **kw: Any) -> T:
        """Asks for output that follows `response_model`'s JSON schema and returns it validated.

        Raises ParseError when the output stops early (max_tokens) or does not validate."""
        kw.pop("stream", None)
        return _validate(response_model, self.chat(messages, json_schema=response_model, **kw))

    @overload
    def complete(self, prompt: str | list[int], *, stream: Literal[False] = False, **kw: Any) -> Completion: ...

    @overload
    def complete(self, prompt: str | list[int], *, stream: Literal[True], **kw: Any) -> ChatStream: ...

    def complete(self, prompt: str | list[int], *, model: str | None = None, stream: bool = False,
                 max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                 seed: int | None = None, stop: str | list[str] | None = None, n: int | None = None,
                 logprobs: int | None = None, json_schema: SchemaLike | None = None, regex: str | None = None,
                 ebnf: str | None = None, choice: Sequence[str] | None = None, include_usage: bool | None = None,
                 extra_body: Mapping[str, Any] | None = None) -> Completion | ChatStream:
        """`POST /v1/completions`: raw text (or token ids) in, text out, no chat template."""
        body = _completion_body(self.model, prompt, model=model, stream=stream, max_tokens=max_tokens,
                                temperature=temperature, top_p=top_p, seed=seed, stop=stop, n=n, logprobs=logprobs,
                                json_schema=json_schema, regex=regex, ebnf=ebnf, choice=choice,
                                include_usage=include_usage, extra_body=extra_body)
        if stream:
            return ChatStream(self._send("POST", "/v1/completions", body, stream=True), Completion)
        return Completion.model_validate(self._send("POST", "/v1/completions", body).json())


class AsyncClient(_Base):
    """Asynchronous client; the same methods as `Client`, as coroutines. Streams are async iterators:

        async with AsyncClient() as client:
            stream = await client.chat("Count to five", stream=True)
            async for delta in stream.text_deltas():
                print(delta, end="")
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, model: str | None = None,
                 timeout: float = 600.0, max_retries: int = 2, http_client: httpx.AsyncClient | None = None):
        super().__init__(base_url, api_key, model, max_retries)
        self._http = http_client or httpx.AsyncClient(base_url=self.base_url, timeout=timeout)
        self._owns_http = http_client is None

    async def _send(self, method: str, path: str, body: Any = None, stream: bool = False,
                    retries: int | None = None) -> httpx.Response:
        attempt, retries = 0, self.max_retries if retries is None else retries
        while True:
            req = self._http.build_request(method, self.base_url + path, json=body, headers=self._headers())
            resp = await self._http.send(req, stream=stream)
            if resp.status_code == 503 and attempt < retries:
                attempt += 1
                await resp.aclose()
                await asyncio.sleep(_retry_after(resp))
                continue
            if resp.status_code >= 400:
                content = await resp.aread()
                await resp.aclose()
                _raise_for(resp, content)
            return resp

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def models(self) -> list[ModelCard]:
        return [ModelCard.model_validate(m) for m in (await self._send("GET", "/v1/models")).json()["data"]]

    async def health(self) -> dict[str, Any]:
        try:
            return (await self._send("GET", "/health", retries=0)).json()
        except APIError as e:
            return _unhealthy(e)

    @overload
    async def chat(self, messages: Messages, *, stream: Literal[False] = False, **kw: Any) -> ChatCompletion: ...

    @overload
    async def chat(self, messages: Messages, *, stream: Literal[True], **kw: Any) -> AsyncChatStream: ...

    async def chat(self, messages: Messages, *, model: str | None = None, system: str | None = None,
                   stream: bool = False, max_tokens: int | None = None, temperature: float | None = None,
                   top_p: float | None = None, seed: int | None = None, stop: str | list[str] | None = None,
                   n: int | None = None, frequency_penalty: float | None = None,
                   presence_penalty: float | None = None, logprobs: bool | None = None,
                   top_logprobs: int | None = None, response_format: Mapping[str, Any] | None = None,
                   json_schema: SchemaLike | None = None, schema_name: str | None = None, strict: bool = True,
                   regex: str | None = None, ebnf: str | None = None, choice: Sequence[str] | None = None,
                   include_usage: bool | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
                   tool_choice: str | Mapping[str, Any] | None = None,
                   extra_body: Mapping[str, Any] | None = None) -> ChatCompletion | AsyncChatStream:
        """`POST /v1/chat/completions` (see `Client.chat`). With ``stream=True`` returns an
        AsyncChatStream (``async for chunk in stream``)."""
        body = _chat_body(self.model, messages, model=model, system=system, stream=stream, max_tokens=max_tokens,
                          temperature=temperature, top_p=top_p, seed=seed, stop=stop, n=n,
                          frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, logprobs=logprobs,
                          top_logprobs=top_logprobs, response_format=response_format, json_schema=json_schema,
                          schema_name=schema_name, strict=strict, regex=regex, ebnf=ebnf, choice=choice,
                          include_usage=include_usage, tools=tools, tool_choice=tool_choice, extra_body=extra_body)
        if stream:
            return AsyncChatStream(await self._send("POST", "/v1/chat/completions", body, stream=True))
        return ChatCompletion.model_validate((await self._send("POST", "/v1/chat/completions", body)).json())

    async def chat_text(self, messages: Messages, **kw: Any) -> str:
        return (await self.chat(messages, **kw)).choices[0].message.content or ""

    async def parse(self, messages: Messages, response_model: type[T], **kw: Any) -> T:
        """See `Client.parse`."""
        kw.pop("stream", None)
        return _validate(response_model, await self.chat(messages, json_schema=response_model, **kw))

    async def complete(self, prompt: str | list[int], *, model: str | None = None, stream: bool = False,
                       max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                       seed: int | None = None, stop: str | list[str] | None = None, n: int | None = None,
                       logprobs: int | None = None, json_schema: SchemaLike | None = None,
                       regex: str | None = None, ebnf: str | None = None, choice: Sequence[str] | None = None,
                       include_usage: bool | None = None,
                       extra_body: Mapping[str, Any] | None = None) -> Completion | AsyncChatStream:
        """`POST /v1/completions` (see `Client.complete`)."""
        body = _completion_body(self.model, prompt, model=model, stream=stream, max_tokens=max_tokens,
                                temperature=temperature, top_p=top_p, seed=seed, stop=stop, n=n, logprobs=logprobs,
                                json_schema=json_schema, regex=regex, ebnf=ebnf, choice=choice,
                                include_usage=include_usage, extra_body=extra_body)
        if stream:
            return AsyncChatStream(await self._send("POST", "/v1/completions", body, stream=True), Completion)
        return Completion.model_validate((await self._send("POST", "/v1/completions", body)).json())

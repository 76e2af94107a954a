"""Python SDK for a constrained-spec server (httpx + pydantic; no torch needed).

    from constrained_spec.client import Client, AsyncClient

See `Client` for the methods: `chat`, `chat_text`, `parse`, `complete`, `models`, `health`.
"""
from ..server.protocol import (ChatChoice, ChatCompletion, ChatCompletionChunk, Completion, CompletionChoice,
                               ModelCard, Usage)
from ._client import (APIError, AsyncChatStream, AsyncClient, ChatStream, Client, ParseError, schema_of)

__all__ = ["Client", "AsyncClient", "ChatStream", "AsyncChatStream", "APIError", "ParseError", "ChatCompletion",
           "ChatCompletionChunk", "ChatChoice", "Completion", "CompletionChoice", "ModelCard", "Usage", "schema_of"]

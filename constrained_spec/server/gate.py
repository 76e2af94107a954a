"""The ASGI gate in front of the routes: authentication, the declared body size and encoding, a
request id on every answer, per-status metrics."""
from __future__ import annotations

import hmac
import re
import uuid

from .errors import APIError, bad_request
from .metrics import ServerMetrics

_KNOWN = {"/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/models", "/health", "/metrics"}
# routes with an id in their path, labelled by their template (one label each, not one per id)
_TEMPLATES = tuple((re.compile(pattern), template) for pattern, template in (
    (r"/v1/models/.+", "/v1/models/{id}"), (r"/v1/responses/[^/]+", "/v1/responses/{id}"),
    (r"/v1/responses/[^/]+/input_items", "/v1/responses/{id}/input_items")))


def _template(path: str) -> str:
    return next((template for pattern, template in _TEMPLATES if pattern.fullmatch(path)), "other")


class Gate:
    """ASGI middleware in front of every route: the API key on /v1/*, the declared body size, and a
    count per endpoint and status for /metrics (whatever the route answered, or the gate)."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics | None = None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in _KNOWN else _template(path)
        status_box = [500]

        headers = dict(scope.get("headers") or [])
        # OpenAI's `x-request-id` on every answer (the SDK's `_request_id`, quoted in client logs): the
        # client's own if it sent one
        request_id = headers.get(b"x-request-id") or f"req_{uuid.uuid4().hex}".encode()

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        try:
            if self.api_key is not None and path.startswith("/v1"):
                auth = headers.get(b"authorization", b"")
                scheme, _, token = auth.partition(b" ")
                if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                    err = APIError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                                   code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                    return await err.response()(scope, receive, send_wrapper)
            encoding = headers.get(b"content-encoding", b"identity").strip().lower()
            if encoding != b"identity":  # (a gzip body was read as text: "not valid UTF-8")
                err = APIError(415, f"Content-Encoding {encoding.decode(errors='replace')!r} is not supported; send the "
                               "body uncompressed", code="unsupported_content_encoding")
                return await err.response()(scope, receive, send_wrapper)
            length = headers.get(b"content-length")
            if length is not None:
                try:
                    too_big = int(length) > self.max_body_bytes
                except ValueError:
                    return await bad_request("invalid Content-Length").response()(scope, receive, send_wrapper)
                if too_big:
                    return await too_large(self.max_body_bytes).response()(scope, receive, send_wrapper)
            return await self.app(scope, receive, send_wrapper)
        finally:
            if self.metrics is not None:
                self.metrics.requests.labels(endpoint=endpoint, status=str(status_box[0])).inc()


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body larger than {limit} bytes", code="request_too_large")

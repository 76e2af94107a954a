"""Request and response bodies as the routes read and write them: a request's JSON body (size-checked
as it arrives) validated into its pydantic model, and a JSON response."""
from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from pydantic import ValidationError
from starlette.responses import Response

from .errors import bad_request, validation_error_to_api
from .gate import too_large


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


async def read_json(request: Request, limit: int) -> Any:
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


def parse(model_cls, data: dict):
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_error_to_api(e.errors(include_url=False), data)

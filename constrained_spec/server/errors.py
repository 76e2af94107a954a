"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # (OpenAI's own, with code invalid_api_key)
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error the server answers with; `status` is the HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(orjson.dumps(self.body()), status_code=self.status, media_type="application/json",
                        headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_request") -> APIError:
    return APIError(400, message, param=param, code=code)


def validation_error_to_api(errors: list[dict[str, Any]], body: Any = None) -> APIError:
    """Turns pydantic's error list into a 400 naming the first offending field (its path in `body`,
    the request as sent, where given)."""
    if not errors:
        return bad_request("invalid request body")
    # a union's value is one error per member; the one that got furthest into the body says most
    # (`{"type": "function"}` for tool_choice: its `function` is missing, not "none"/"auto"/"required")
    paths = [_field_path([x for x in e.get("loc", ()) if x != "body"], body, e.get("type") == "missing")
             for e in errors]
    # (a tagged union's tag error names the tag, one level below its path)
    depth = [len(p) + str(e.get("type", "")).startswith("union_tag_") for p, e in zip(paths, errors)]
    deepest = max(range(len(errors)), key=lambda i: (depth[i], -i))
    first = errors[deepest]
    param = ".".join(str(x) for x in paths[deepest]) or None
    msg = first.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    kind = first.get("type", "")
    ctx = first.get("ctx") or {}
    if kind.startswith("union_tag_"):  # a tagged union's tag (`type`), absent or not one it knows
        tag = str(ctx.get("discriminator", "type")).strip("'")
        param = f"{param}.{tag}" if param else tag
        if kind == "union_tag_invalid":
            kind, msg = "invalid", f"{ctx.get('tag')!r} is not one of {ctx.get('expected_tags')}"
        else:
            kind = "missing"
    elif kind in ("model_type", "model_attributes_type", "dataclass_type"):  # pydantic names its class
        msg = "Input should be a JSON object"
    if kind == "missing":
        text = f"missing required field '{param}'"
    elif param:
        text = f"invalid value for '{param}': {msg}"
    else:
        text = msg
    code = {"missing": "missing_field", "invalid_schema": "invalid_schema",
            "unsupported_parameter": "unsupported_parameter"}.get(kind, "invalid_value")
    return bad_request(text, param=param, code=code)


def _field_path(loc: list, body: Any, missing: bool = True) -> list:
    """`loc` without pydantic's union tags ('str' for a union's string member, 'json_schema' for a
    tagged union's member, "literal['none','auto']"): followed through the body, an element that
    names no key or index there is a tag, but for the last one of a `missing` error, the missing
    field's name; past a scalar, all are tags."""
    if body is None:
        return loc
    path, at = [], body
    for i, x in enumerate(loc):
        if isinstance(at, dict) and x in at:
            at = at[x]
        elif isinstance(at, list) and isinstance(x, int) and 0 <= x < len(at):
            at = at[x]
        elif missing and isinstance(at, dict) and i == len(loc) - 1:
            pass  # a required field the body lacks
        else:
            continue  # a tag
        path.append(x)
    return path

"""JSON error responses in OpenAI's schema: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re

from aiohttp import web

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
          404: "NotFoundError", 405: "MethodNotAllowedError", 409: "ConflictError",
          415: "UnsupportedMediaTypeError", 422: "UnprocessableEntityError",
          429: "RateLimitError", 503: "ServiceUnavailableError"}  # fmt: skip
"""The openai client's exception names for the statuses it has one for (409, 422 too), and
the statuses this server answers with a name of their own (405, 415, 503)."""
_PARAM = re.compile(r"^(?:sampling parameter )?'?([a-z_][a-z0-9_.\[\]]*)'?\b")


def error_response(
    status: int, message: str, param: str | None = None, headers: dict | None = None
) -> web.Response:
    return web.json_response(error_body(status, message, param), status=status, headers=headers)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error object; a 4xx without `param` names the field its message starts with."""
    return {
        "error": {
            "message": message,
            "type": error_type(status),
            "param": param if param is not None or status >= 500 else _guess_param(message),
            "code": status,
        }
    }


def error_type(status: int) -> str:
    """The OpenAI error type of an HTTP status: its own name where it has one, else
    BadRequestError for a 4xx (408, 411, 413, ...) and InternalServerError for a 5xx."""
    return _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def _guess_param(message: str) -> str | None:
    """The parameter a validation message starts with ("temperature must be ...")."""
    match = _PARAM.match(message)
    return match.group(1) if match else None


class BadRequest(ValueError):
    """A request the server rejects with a 4xx; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status

"""The router's error answers, OpenAI-shaped: every stage raises ``ApiError`` and the app's
middleware writes it (``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ApiError(Exception):
    """An OpenAI-style error answer: ``{"error": {"message", "type", "param", "code"}}``;
    ``headers`` go with it (a 429's ``Retry-After``, a 401's ``WWW-Authenticate``)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ERROR_TYPES.get(status, "InternalServerError")
        self.headers = dict(headers or {})

    def response(self) -> web.Response:
        body = {"message": self.message, "type": self.kind, "param": self.param}
        error = {"error": {**body, "code": self.status}}
        return web.json_response(error, status=self.status, headers=self.headers)


def upstream_message(answer: Any) -> str:
    """An engine's error answer (JSON text or parsed) as the message of the router's own."""
    if isinstance(answer, str):
        with contextlib.suppress(ValueError):
            answer = json.loads(answer)
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return str(answer["error"].get("message", answer["error"]))
    return str(answer)[:500]

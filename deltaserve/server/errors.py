"""Errors as OpenAI sends them, {"error": {"message", "type", "param", "code"}}, for every failure: a bad
request is a 4xx naming what was wrong; anything else is a 500 that names no internals (the details go
to the server log)."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("deltaserve.server")

INTERNAL = "the server failed on this request; the details are in its log"
ECHO_CHARS = 100  # of a client's value quoted back in a message


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers


class JSON(JSONResponse):
    """JSON in ASCII: a string a client sent (a model name with an unpaired surrogate) cannot make the
    response fail to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSON:
    return JSON(error_body(message, kind, param, code), status_code=status, headers=headers)


def echo(value: str) -> str:
    """A client's value, short enough to quote in a message."""
    return value if len(value) <= ECHO_CHARS else value[:ECHO_CHARS] + "..."


def install(app: FastAPI) -> None:
    """Give every exception the app can meet an OpenAI-style body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.kind, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        return _validation_error(e.errors())

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error_response(e.status_code, str(e.detail), kind, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, INTERNAL, "server_error", code="internal_error")


def _validation_error(errors) -> JSON:
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # loc is ("body", offset)
        reason = (first.get("ctx") or {}).get("error", "")
        offset = first.get("loc", ("body", "?"))[-1]
        return error_response(400, f"the body is not valid JSON (at character {offset}: {reason})",
                              code="invalid_json")
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return error_response(400, f"{where}: {message}" if where else message, param=where or None)

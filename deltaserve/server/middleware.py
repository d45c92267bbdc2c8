"""What every request passes before a route: the API key, the size of the body, and whether the server is
shutting down. Plain ASGI, not Starlette's BaseHTTPMiddleware: the body is read here within its limit, and
the route's `receive` stays the server's own, so a client that leaves is seen while its request waits."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

from .errors import INTERNAL, error_response

log = logging.getLogger("deltaserve.server")

Scope, Message = dict, dict

# After a refusal the rest of the body is read and dropped, up to this much: a client that is still
# sending reads the answer only once it is done, and one that sends for ever is cut off (connection closed).
DRAIN_BYTES = 64 * 2**20


# paths served without the API key: the health check, and the chat page (static; it asks for the key and
# sends it with its requests)
OPEN_PATHS = ("/health", "/")


class Guard:
    def __init__(self, app, *, api_key: str | None, max_body: int, closing: Callable[[], bool]):
        self.app, self.max_body, self.closing = app, max_body, closing
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] not in OPEN_PATHS \
                and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            return await _refuse(scope, receive, send, error_response(
                401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error",
                code="invalid_api_key"))
        if self.closing():
            return await _refuse(scope, receive, send, error_response(
                503, "the server is shutting down", "server_error", code="server_shutting_down"))
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:  # refused before a byte of it is read
            return await _refuse(scope, receive, send, self._too_large())
        body, more = await _read(receive, self.max_body)
        if more is None:  # the client left while sending
            return
        if body is None:
            return await _refuse(scope, receive, send, self._too_large(), more_body=more)
        await _answered(self.app, scope, _replay(body, receive), send)

    def _too_large(self):
        return error_response(413, f"the request body is larger than this server's limit of {self.max_body} "
                                   f"bytes (serve --max-request-bytes)", code="request_too_large")


async def _read(receive, limit: int) -> tuple[bytes | None, bool | None]:
    """The body, read until it ends or passes `limit` bytes: (body, False); (None, whether more of it is
    coming) when it passed the limit, what was read dropped; (None, None) when the client disconnected."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, None
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            return None, more
        chunks.append(chunk)
        if not more:
            return b"".join(chunks), False


async def _answered(app, scope: Scope, receive, send) -> None:
    """Run the app; an exception before the response started becomes a JSON 500 here. (Starlette's own
    handler answers too, but then re-raises to the server, which closes the connection: a keep-alive
    client's next request on it would fail.)"""
    started = False

    async def watched(message: Message) -> None:
        nonlocal started
        started = started or message["type"] == "http.response.start"
        await send(message)

    try:
        await app(scope, receive, watched)
    except Exception:
        if started:  # mid-response: only closing the connection can tell the client
            raise
        log.exception("%s %s failed", scope.get("method"), scope.get("path"))
        await error_response(500, INTERNAL, "server_error", code="internal_error")(scope, receive, send)


def _replay(body: bytes, receive):
    """A `receive` that gives the body read here, then the server's own messages (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


async def _refuse(scope: Scope, receive, send, response, more_body: bool = True) -> None:
    """Answer with `response` without running the app, after reading (and dropping) what the client
    still sends of its body, within DRAIN_BYTES."""
    drained = 0
    while more_body and drained <= DRAIN_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        drained += len(message.get("body", b""))
        more_body = message.get("more_body", False)
    if more_body:
        response.headers["connection"] = "close"
    await response(scope, receive, send)

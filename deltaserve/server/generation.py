"""A request's life on the server once it is valid: submitted to the engine, waited for (or streamed), and
ended early when its client leaves or the server shuts down.

The engine calls back from its own thread; each request's events cross to the event loop through an
asyncio.Queue. A non-streaming request checks its connection while it waits, so a client that gives up
frees its slot within POLL_SECONDS, as a stream's does."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from deltaserve.engine.engine import Engine
from deltaserve.engine.request import Delta, Done
from deltaserve.engine.sampling import SamplingParams

from .chat_output import ChatOutput, OutputFormat
from .errors import APIError, error_body

log = logging.getLogger("deltaserve.server")

POLL_SECONDS = 0.25
SHUTDOWN = object()  # put on every request's queue when the server shuts down
ENGINE_FAILED = "the engine failed while generating this request; the details are in the server log"
SHUTTING_DOWN = "the server is shutting down"


class Inflight:
    """The queues of the requests the server is serving, to end them all at shutdown."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.queues: set[asyncio.Queue] = set()
        self.closing = False
        self.loop: asyncio.AbstractEventLoop | None = None

    def shutdown(self) -> None:
        """Stop taking requests and end those in flight with a final event. Safe from any thread and from
        a signal handler, which may run in the middle of the event loop's own code: the work is done
        by the loop. (No loop yet: no request was ever submitted, so none is in flight.)"""
        self.closing = True
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._end_all)

    def _end_all(self) -> None:
        self.engine.cancel_all()
        for queue in self.queues:
            queue.put_nowait(SHUTDOWN)


class Generation:
    """One submitted request: what the routes need to wait for it or stream it."""

    def __init__(self, engine: Engine, inflight: Inflight, ids: list[int], params: SamplingParams, *, chat: bool,
                 token_ids: bool, stream: bool, marks: tuple[int, ...] = (), cache_prompt: bool = True,
                 output: OutputFormat | None = None):
        """stream: the Deltas are wanted; without it only the Done crosses to the event loop, so that the
        wait for it times out, and checks the connection, every POLL_SECONDS. output: how a chat reply is
        read (reasoning, tool calls)."""
        self.engine, self.inflight, self.chat, self.token_ids = engine, inflight, chat, token_ids
        self.reader = ChatOutput(output or OutputFormat()) if chat else None
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

        def on_event(event) -> None:  # in the engine thread
            if stream or isinstance(event, Done):
                loop.call_soon_threadsafe(self.queue.put_nowait, event)

        self.req = engine.submit(ids, params, on_event, marks=marks, cache_prompt=cache_prompt)
        inflight.loop = loop
        inflight.queues.add(self.queue)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.kind = "chat.completion" if chat else "text_completion"
        self.include_usage = False

    def close(self) -> None:
        """The client has what it gets: stop the engine request if it still runs."""
        self.inflight.queues.discard(self.queue)
        if self.req.done is None:
            self.engine.cancel(self.req)

    async def result(self, request: Request) -> dict:
        """The response body once the request is done; APIError if it failed or the server shuts down."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(self.queue.get(), timeout=POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise APIError(499, "the client closed the connection", code="client_closed") from None
                    continue
                if event is SHUTDOWN or (isinstance(event, Done) and event.reason == "cancelled"):
                    raise APIError(503, SHUTTING_DOWN, kind="server_error", code="server_shutting_down")
                if isinstance(event, Done):
                    return self._body(event)
        finally:
            self.close()

    def _body(self, done: Done) -> dict:
        if done.reason == "error":
            log.error("request %d failed: %s", self.req.id, done.error)
            raise APIError(500, ENGINE_FAILED, kind="server_error", code="engine_error")
        if self.chat:
            self.reader.feed(done.text)
            self.reader.finish()
            choice = {"index": 0, "message": self.reader.message(), "finish_reason": self.reader.finish_reason(done.reason)}
        else:
            choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.reason}
        if self.token_ids:
            choice["token_ids"] = done.token_ids
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.engine.model_name,
                "choices": [choice], "usage": usage(done)}

    def stream(self, include_usage: bool) -> StreamingResponse:
        self.include_usage = include_usage
        return _Stream(self._events(), self.close, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache"})

    async def _events(self):
        """Server-sent events, always ending with a final event (finish_reason or an error) and [DONE]."""
        sent_ids = 0
        try:
            if self.chat:
                yield self._chunk(None, role=True)
            while True:
                event = await self.queue.get()
                if isinstance(event, Delta):
                    sent_ids += len(event.token_ids)
                    deltas = (self.reader.feed(event.text) or [{}]) if self.chat else [None]
                    for i, delta in enumerate(deltas):  # the event's token ids go with its first chunk
                        yield self._chunk(event.text, ids=event.token_ids if i == 0 else [], delta=delta)
                    continue
                for line in self._ending(event, sent_ids):
                    yield line
                return
        except Exception:  # the response has started: the client gets a final error event instead of a 500
            log.exception("stream %s failed", self.id)
            yield _sse(error_body(ENGINE_FAILED, "server_error", code="engine_error"))
            yield "data: [DONE]\n\n"
        finally:  # done, or the client went away: free the slot
            self.close()

    def _ending(self, event, sent_ids: int) -> list[str]:
        if event is SHUTDOWN or event.reason == "cancelled":
            lines = [_sse(error_body(SHUTTING_DOWN, "server_error", code="server_shutting_down"))]
        elif event.reason == "error":
            log.error("request %d failed: %s", self.req.id, event.error)
            lines = [_sse(error_body(ENGINE_FAILED, "server_error", code="engine_error"))]
        else:
            lines = [self._chunk(None, delta=delta) for delta in (self.reader.finish() if self.chat else [])]
            reason = self.reader.finish_reason(event.reason) if self.chat else event.reason
            lines.append(self._chunk(None, finish=reason, ids=event.token_ids[sent_ids:]))
            if self.include_usage:
                lines.append(_sse({"id": self.id, "object": self._chunk_kind, "created": self.created,
                                   "model": self.engine.model_name, "choices": [], "usage": usage(event)}))
        return [*lines, "data: [DONE]\n\n"]

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, text: str | None, finish: str | None = None, role: bool = False,
               ids: list[int] | None = None, delta: dict | None = None) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else delta or {}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if self.token_ids:
            choice["token_ids"] = ids or []
        body = {"id": self.id, "object": self._chunk_kind, "created": self.created, "model": self.engine.model_name,
                "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return _sse(body)


class _Stream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends: a client that leaves before the first
    event is sent cancels the response before its generator starts, and so before the generator's own
    cleanup could run."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"

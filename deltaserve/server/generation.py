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
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from deltaserve.engine.engine import Engine
from deltaserve.engine.request import Delta, Done
from deltaserve.engine.request import Request as EngineRequest
from deltaserve.engine.sampling import SamplingParams

from .chat_output import ChatOutput, OutputFormat
from .errors import APIError, error_body
from .logprobs import LogprobFormatter, first_token

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


@dataclass
class Prompt:
    """One prompt of a request: its ids, the positions to checkpoint, and the text echoed before each of its
    choices (completions' echo; None: no echo)."""

    ids: list[int]
    marks: tuple[int, ...] = ()
    echo: str | None = None


class Generation:
    """One request's choices (n per prompt) submitted together: what the routes need to wait for them or
    stream them. Choice p * n + j is the j-th of prompt p, as OpenAI numbers them."""

    def __init__(self, engine: Engine, inflight: Inflight, prompts: list[Prompt], params: SamplingParams, *,
                 chat: bool, token_ids: bool, stream: bool, n: int = 1, cache_prompt: bool = True,
                 output: OutputFormat | None = None):
        """stream: the Deltas are wanted; without it only the Dones cross to the event loop, so that the
        wait for them times out, and checks the connection, every POLL_SECONDS. output: how a chat reply is
        read (reasoning, tool calls)."""
        self.engine, self.inflight, self.chat, self.token_ids = engine, inflight, chat, token_ids
        self.params, self.prompts, self.n = params, prompts, n
        self.fmt = LogprobFormatter(engine.tokenizer)
        self.readers = [ChatOutput(output or OutputFormat()) for _ in range(len(prompts) * n)] if chat else []
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

        def handler(index: int):
            def on_event(event) -> None:  # in the engine thread
                if stream or isinstance(event, Done):
                    loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))
            return on_event

        self.reqs = []
        for p, prompt in enumerate(prompts):
            self.reqs += engine.submit_choices(prompt.ids, params.choices(n), [handler(p * n + j) for j in range(n)],
                                               marks=prompt.marks, cache_prompt=cache_prompt)
        inflight.loop = loop
        inflight.queues.add(self.queue)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.kind = "chat.completion" if chat else "text_completion"
        self.include_usage = False

    def close(self) -> None:
        """The client has what it gets: stop the engine requests that still run."""
        self.inflight.queues.discard(self.queue)
        for req in self.reqs:
            if req.done is None:
                self.engine.cancel(req)

    async def result(self, request: Request) -> dict:
        """The response body once every choice is done; APIError if one failed or the server shuts down."""
        dones: dict[int, Done] = {}
        try:
            while len(dones) < len(self.reqs):
                try:
                    item = await asyncio.wait_for(self.queue.get(), timeout=POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise APIError(499, "the client closed the connection", code="client_closed") from None
                    continue
                if item is SHUTDOWN or item[1].reason == "cancelled":
                    raise APIError(503, SHUTTING_DOWN, kind="server_error", code="server_shutting_down")
                if item[1].reason == "error":
                    log.error("request %d failed: %s", self.reqs[item[0]].id, item[1].error)
                    raise APIError(500, ENGINE_FAILED, kind="server_error", code="engine_error")
                dones[item[0]] = item[1]
            return self._body([dones[i] for i in range(len(self.reqs))])
        finally:
            self.close()

    def _body(self, dones: list[Done]) -> dict:
        choices = []
        for index, done in enumerate(dones):
            if self.chat:
                reader = self.readers[index]
                reader.feed(done.text)
                reader.finish()
                choice = {"index": index, "message": reader.message(),
                          "logprobs": self.fmt.chat(done.logprobs) if self.params.logprobs is not None else None,
                          "finish_reason": reader.finish_reason(done.reason)}
            else:
                prompt = self.prompts[index // self.n]
                choice = {"index": index, "text": (prompt.echo or "") + done.text,
                          "logprobs": self._legacy(self._echoed(prompt, done) + done.logprobs),
                          "finish_reason": done.reason}
            if self.token_ids:
                choice["token_ids"] = done.token_ids
            choices.append(choice)
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.engine.model_name,
                "choices": choices, "usage": self._usage(dones)}

    def _echoed(self, prompt: Prompt, done: EngineRequest | Done) -> list:
        """The prompt's logprob entries of a completion choice: under echo with logprobs, the first token
        (with nulls) and those the prefill reported."""
        if prompt.echo is None or self.params.logprobs is None:
            return []
        return [first_token(prompt.ids[0]), *done.prompt_logprobs]

    def _legacy(self, entries: list) -> dict | None:
        return self.fmt.completion(entries) if self.params.logprobs is not None else None

    def _usage(self, dones: list[Done]) -> dict:
        """Each prompt counts once, whatever n; its cached tokens are those of its first choice, which
        prefilled it."""
        leaders = dones[::self.n]
        return usage(sum(d.prompt_tokens for d in leaders), sum(d.completion_tokens for d in dones),
                     sum(d.cached_tokens for d in leaders))

    def stream(self, include_usage: bool) -> StreamingResponse:
        self.include_usage = include_usage
        return ClosingStream(self._events(), self.close, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache"})

    async def _events(self):
        """Server-sent events, always ending with a final event per choice (its finish_reason) or an error,
        and [DONE]."""
        total = len(self.reqs)
        sent_ids, offsets, dones, opened = [0] * total, [0] * total, {}, set()
        try:
            for index in range(total) if self.chat else ():
                yield self._chunk(index, None, role=True)
            while len(dones) < total:
                item = await self.queue.get()
                if item is SHUTDOWN or (isinstance(item[1], Done) and item[1].reason in ("cancelled", "error")):
                    for line in self._failure(item):
                        yield line
                    return
                index, event = item
                prompt = self.prompts[index // self.n]
                if not self.chat and prompt.echo is not None and index not in opened:  # the prompt has been read
                    opened.add(index)
                    yield self._chunk(index, prompt.echo, logprobs=self._piece_logprobs(
                        self._echoed(prompt, self.reqs[index]), index, offsets))
                if isinstance(event, Delta):
                    ids, logprobs, text, finish = event.token_ids, event.logprobs, event.text, None
                    deltas = (self.readers[index].feed(text) or [{}]) if self.chat else [None]
                else:
                    dones[index] = event
                    ids, logprobs = event.token_ids[sent_ids[index]:], event.logprobs[sent_ids[index]:]
                    text, finish = None, event.reason
                    if self.chat:  # what the reader held back, then the final chunk
                        for delta in self.readers[index].finish():
                            yield self._chunk(index, None, delta=delta)
                        finish = self.readers[index].finish_reason(event.reason)
                    deltas = [None]
                sent_ids[index] += len(ids)
                logprobs = self._piece_logprobs(logprobs, index, offsets)
                for i, delta in enumerate(deltas):  # the event's token ids and logprobs go with its first chunk
                    yield self._chunk(index, text, ids=ids if i == 0 else [], logprobs=logprobs if i == 0 else None,
                                      finish=finish, delta=delta)
            if self.include_usage:
                yield _sse({"id": self.id, "object": self._chunk_kind, "created": self.created,
                            "model": self.engine.model_name, "choices": [],
                            "usage": self._usage([dones[i] for i in range(total)])})
            yield "data: [DONE]\n\n"
        except Exception:  # the response has started: the client gets a final error event instead of a 500
            log.exception("stream %s failed", self.id)
            yield _sse(error_body(ENGINE_FAILED, "server_error", code="engine_error"))
            yield "data: [DONE]\n\n"
        finally:  # done, or the client went away: free the slots
            self.close()

    def _piece_logprobs(self, entries: list, index: int, offsets: list[int]) -> dict | None:
        if self.params.logprobs is None:
            return None
        if self.chat:
            return self.fmt.chat(entries)
        out = self.fmt.completion(entries, offsets[index])
        offsets[index] += sum(len(t) for t in out["tokens"])
        return out

    def _failure(self, item) -> list[str]:
        """The end of a stream whose choice was cancelled (the server shuts down) or failed."""
        if item is SHUTDOWN or item[1].reason == "cancelled":
            body = error_body(SHUTTING_DOWN, "server_error", code="server_shutting_down")
        else:
            log.error("request %d failed: %s", self.reqs[item[0]].id, item[1].error)
            body = error_body(ENGINE_FAILED, "server_error", code="engine_error")
        return [_sse(body), "data: [DONE]\n\n"]

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, index: int, text: str | None, finish: str | None = None, role: bool = False,
               ids: list[int] | None = None, logprobs: dict | None = None, delta: dict | None = None) -> str:
        """One event of choice `index`: a chat delta (`delta`, as the reply's reader made it), or a
        completion's `text`."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else delta or {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if self.token_ids:
            choice["token_ids"] = ids or []
        body = {"id": self.id, "object": self._chunk_kind, "created": self.created, "model": self.engine.model_name,
                "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return _sse(body)


class ClosingStream(StreamingResponse):
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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"

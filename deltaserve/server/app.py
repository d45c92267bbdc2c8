"""OpenAI-compatible HTTP API over the Engine, plus /health, /metrics and the chat page at /."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltaserve.engine.engine import Engine
from deltaserve.engine.request import Delta, Done
from deltaserve.engine.sampling import SamplingParams
from deltaserve.errors import DeltaserveError

CHAT_PAGE = Path(__file__).with_name("chat.html")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_body(message: str, kind: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---------------------------------------------------------------------------- request bodies
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(default=1, ge=1, le=1)


class CompletionBody(_Body):
    prompt: str | list[int]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)


# ---------------------------------------------------------------------------- the app
def create_app(engine: Engine, *, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="deltaserve", docs_url=None, redoc_url=None)
    tok = engine.tokenizer

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(error_body(e.message, e.kind, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return JSONResponse(error_body(message, "invalid_request_error", where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path != "/health" and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse(error_body("invalid or missing API key (Authorization: Bearer KEY)",
                                           "authentication_error", code="invalid_api_key"), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "deltaserve", "max_model_len": engine.max_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_prometheus(engine), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        _check_model(engine, body.model)
        if isinstance(body.prompt, str):
            ids = tok.encode(body.prompt)
        else:
            ids = body.prompt
            vocab = engine.runner.model.config.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return await _serve(engine, request, body, ids, body.max_tokens if body.max_tokens is not None else 16,
                            chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        _check_model(engine, body.model)
        messages = [{"role": m.role, "content": _text(m.content)} for m in body.messages]
        try:
            prompt = tok.chat_prompt(messages)
        except DeltaserveError as e:
            raise APIError(400, f"messages: {e}", "messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await _serve(engine, request, body, tok.encode(prompt), max_tokens, chat=True)

    return app


def _check_model(engine: Engine, name: str | None):
    if name not in (None, "", engine.model_name):
        raise APIError(404, f"the model '{name}' does not exist; this server serves '{engine.model_name}'",
                       "model", "model_not_found")


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


async def _serve(engine: Engine, request: Request, body: _Body, ids: list[int], max_tokens: int | None, chat: bool):
    if not ids:
        raise APIError(400, "the prompt is empty", "messages" if chat else "prompt")
    room = engine.max_len - len(ids)
    if room < 1:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context holds {engine.max_len}",
                       "messages" if chat else "prompt", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise APIError(400, f"max_tokens {max_tokens} plus the prompt's {len(ids)} tokens exceed this model's "
                            f"context of {engine.max_len} tokens", "max_tokens", "context_length_exceeded")
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                                top_p=body.top_p, min_p=body.min_p, seed=body.seed,
                                stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []))
    except ValueError as e:
        raise APIError(400, str(e)) from None

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    req = engine.submit(ids, params, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if body.stream:
        usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(_sse(engine, req, queue, rid, created, chat, usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.cancel(req)
                    return JSONResponse({}, status_code=499)
                continue
            if isinstance(event, Done):
                break
    except asyncio.CancelledError:
        engine.cancel(req)
        raise
    if event.reason == "error":
        raise APIError(500, event.error or "internal error", kind="server_error")
    choice = ({"index": 0, "message": {"role": "assistant", "content": event.text}} if chat
              else {"index": 0, "text": event.text, "logprobs": None})
    choice["finish_reason"] = event.reason
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": engine.model_name, "choices": [choice], "usage": _usage(event)}


async def _sse(engine: Engine, req, queue: asyncio.Queue, rid: str, created: int, chat: bool, include_usage: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta_text: str | None, finish=None, role=False):
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": delta_text} if delta_text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
        body = {"id": rid, "object": kind, "created": created, "model": engine.model_name, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:
            yield chunk(None, role=True)
        while True:
            event = await queue.get()
            if isinstance(event, Delta):
                yield chunk(event.text)
                continue
            if event.reason == "error":
                yield f"data: {json.dumps(error_body(event.error or 'internal error', 'server_error'))}\n\n"
            else:
                yield chunk(None, finish=event.reason)
            if include_usage:
                body = {"id": rid, "object": kind, "created": created, "model": engine.model_name, "choices": [],
                        "usage": _usage(event)}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
            return
    finally:  # the client went away (or we are done): free the slot
        if req.done is None:
            engine.cancel(req)


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def _prometheus(engine: Engine) -> str:
    m = engine.metrics
    rows = [
        ("requests_total", "counter", "requests received", m.requests_total),
        ("requests_finished_total", "counter", "requests finished (any reason)", m.requests_finished),
        ("prompt_tokens_total", "counter", "prompt tokens of finished requests", m.prompt_tokens_total),
        ("generated_tokens_total", "counter", "tokens generated", m.generated_tokens_total),
        ("prefill_tokens_per_second", "gauge", "prefill throughput since start",
         m.prefill_tokens / m.prefill_seconds if m.prefill_seconds else 0.0),
        ("decode_tokens_per_second", "gauge", "decode throughput since start (all sequences)",
         m.decode_tokens / m.decode_seconds if m.decode_seconds else 0.0),
        ("queue_depth", "gauge", "requests waiting for a slot", engine.queue_depth()),
        ("running_requests", "gauge", "requests holding a slot", engine.running()),
        ("cache_bytes", "gauge", "bytes of per-slot state and prefix checkpoints", engine.runner.cache.nbytes()),
    ]
    out = []
    for name, kind, help_text, value in rows:
        out += [f"# HELP deltaserve_{name} {help_text}", f"# TYPE deltaserve_{name} {kind}",
                f"deltaserve_{name} {value}"]
    return "\n".join(out) + "\n"

"""OpenAI-compatible HTTP API over the Engine (completions, chat completions, responses), plus /health, /metrics
and the chat page at /.

No request can harm another: its values are validated (schemas), its body, prompt, stop strings and wait
in the queue are bounded, its prompt is tokenised off the event loop, and the engine fails only the
request whose pass fails. Every error is an OpenAI-style JSON body (errors)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, PlainTextResponse

from deltaserve.engine.engine import Engine
from deltaserve.errors import DeltaserveError

from . import errors, slots
from .chat_output import OutputFormat, call_form
from .chat_request import chat_inputs
from .errors import JSON, APIError, echo
from .generation import SHUTTING_DOWN, Generation, Inflight, Prompt
from .middleware import Guard
from .responses import install_responses
from .schemas import ChatBody, CompletionBody, valid_unicode
from .structured import chat_grammar
from .tokenize import install_tokenize

CHAT_PAGE = Path(__file__).with_name("chat.html")
MAX_REQUEST_BYTES = 4 * 2**20  # a prompt filling a 256k-token context is about 1 MB of text
# requests that may wait for a slot, per slot: a waiting request then starts within about two generations
# (an unbounded queue let one client park any number of requests); beyond, 503 and Retry-After
QUEUE_PER_SLOT = 2
RETRY_AFTER_SECONDS = 1


def create_app(engine: Engine, *, api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES,
               max_queue: int | None = None, allowed_origins: list[str] | None = None,
               slot_save_path: str | Path | None = None, tool_call_parser: str = "auto") -> FastAPI:
    """The API over `engine`; max_queue None: QUEUE_PER_SLOT per slot. app.state.inflight.shutdown() ends
    every request in flight (on SIGTERM). allowed_origins: web origins that may call the API (CORS); a
    browser's preflight is answered before the API key is checked, since browsers send it without one.
    slot_save_path: the folder of the slot save / restore files (None: off). tool_call_parser: the form
    tool calls are read in (chat_output.PARSERS; auto: the chat template's)."""
    form = call_form(tool_call_parser, engine.tokenizer.template)
    if max_queue is None:
        max_queue = QUEUE_PER_SLOT * engine.runner.n_slots
    app = FastAPI(title="deltaserve", docs_url=None, redoc_url=None, default_response_class=JSON)
    inflight = Inflight(engine)
    app.state.inflight = inflight
    errors.install(app)
    app.add_middleware(Guard, api_key=api_key, max_body=max_request_bytes, closing=lambda: inflight.closing)
    if allowed_origins:  # added last: outermost
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    prompts = Prompts(engine)
    slots.install(app, engine, slot_save_path)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    served = {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "deltaserve",
              "max_model_len": engine.max_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [served]}

    @app.get("/v1/models/{name:path}")  # (a path: model ids may hold '/')
    async def model(name: str):
        _check_model(engine, name)
        return served

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_prometheus(engine), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))

    async def generate(request: Request, body: CompletionBody | ChatBody, prompts_in: list[Prompt],
                       max_tokens: int | None, chat: bool, output: OutputFormat | None = None,
                       grammar: str | None = None):
        param = "messages" if chat else "prompt"
        longest = max(prompts_in, key=lambda p: len(p.ids)).ids
        n = _choices(engine, body, len(prompts_in), max_queue)
        params = body.sampling(_max_tokens(engine, longest, max_tokens, param))
        params.grammar = grammar
        if inflight.closing:  # it began while this prompt was being tokenised
            raise APIError(503, SHUTTING_DOWN, kind="server_error", code="server_shutting_down")
        if engine.waiting_for_slot() >= max_queue:
            raise APIError(503, f"the server is busy: {max_queue} requests are already waiting for a slot; "
                                f"retry later", kind="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        gen = Generation(engine, inflight, prompts_in, params, chat=chat, token_ids=bool(body.return_token_ids),
                         stream=bool(body.stream), n=n, cache_prompt=body.cache_prompt is not False, output=output)
        if body.stream:
            return gen.stream(bool(body.stream_options and body.stream_options.include_usage))
        return await gen.result(request)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        _check_model(engine, body.model)
        batch = []
        for prompt in body.prompts:
            ids = await prompts.completion(prompt)
            echo_text = (prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids)) if body.echo else None
            batch.append(Prompt(ids, (len(ids),), echo_text))
        return await generate(request, body, batch, 16 if body.max_tokens is None else body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        _check_model(engine, body.model)
        inputs = chat_inputs(body)
        ids, reply_start, prompt = await prompts.chat(inputs.messages, inputs.options)
        output = OutputFormat.of(form, engine.tokenizer.template, prompt, inputs.tools)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        grammar = await asyncio.to_thread(chat_grammar, body, engine.tokenizer, ids, engine.vocab_size)
        # checkpoints where the next turn's prompt leaves this one, and at its end
        return await generate(request, body, [Prompt(ids, (reply_start, len(ids)))], max_tokens, chat=True,
                              output=output, grammar=grammar)

    install_responses(app, engine, chat)
    install_tokenize(app, engine, prompts)
    return app


class Prompts:
    """A request's prompt as token ids the model takes: tokenised in a worker thread (a long prompt does
    not hold up the event loop's other requests), checked against the model's vocabulary and context."""

    def __init__(self, engine: Engine):
        self.engine, self.tok = engine, engine.tokenizer
        # a token stands for at most `longest` bytes of text, so longer text cannot fit the context: it is
        # refused without tokenising it (the tokenizer holds the GIL for about 1.5 s per MB)
        longest = max((len(self.tok.token_bytes(i)) for i in range(self.tok.vocab_size)), default=1)
        self.max_chars = engine.max_len * max(longest, 1)

    async def completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._checked(await asyncio.to_thread(self._encode, prompt, "prompt"), "prompt", tokenized=True)
        return self._checked(prompt, "prompt", tokenized=False)

    async def chat(self, messages: list[dict], options: dict) -> tuple[list[int], int, str]:
        """The chat prompt's ids, how many of them a later turn's prompt shares (Tokenizer.reply_start), and
        its text (Tokenizer.chat_prompt's `options`: tools, template variables)."""
        ids, start, text = await asyncio.to_thread(self._render, messages, options)
        return self._checked(ids, "messages", tokenized=True), start, text

    def _render(self, messages: list[dict], options: dict) -> tuple[list[int], int, str]:
        try:
            text = self.tok.chat_prompt(messages, **options)
            valid_unicode(text)  # a tool's schema or a template variable may carry an unpaired surrogate
            ids = self._encode(text, "messages")
            return ids, self.tok.reply_start(messages, ids, **options), text
        except (DeltaserveError, ValueError) as e:
            raise APIError(400, f"messages: {e}", "messages") from None

    def _encode(self, text: str, param: str) -> list[int]:
        if len(text) > self.max_chars:
            raise APIError(400, f"the prompt has {len(text)} characters; this model's context of "
                                f"{self.engine.max_len} tokens holds at most {self.max_chars}", param,
                           "context_length_exceeded")
        return self.tok.encode(text)

    def _checked(self, ids: list[int], param: str, tokenized: bool) -> list[int]:
        if not ids:
            raise APIError(400, "the prompt is empty", param)
        vocab = self.engine.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad and tokenized:  # the server's tokenizer knows ids the model does not: no client can fix that
            raise APIError(400, f"the tokenizer gave token ids {bad[:5]}, outside this model's vocabulary "
                                f"[0, {vocab}): its tokenizer does not match it", param, "token_out_of_range")
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab}), got {bad[:5]}", param,
                           "token_out_of_range")
        if len(ids) >= self.engine.max_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context holds "
                                f"{self.engine.max_len}", param, "context_length_exceeded")
        return ids


def _max_tokens(engine: Engine, ids: list[int], max_tokens: int | None, param: str) -> int:
    room = engine.max_len - len(ids)
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise APIError(400, f"max_tokens {max_tokens} plus the prompt's {len(ids)} tokens exceed this model's "
                            f"context of {engine.max_len} tokens", "max_tokens", "context_length_exceeded")
    return max_tokens


def _choices(engine: Engine, body: CompletionBody | ChatBody, n_prompts: int, max_queue: int) -> int:
    """n, once the request's choices and the token ids it names are known to be servable."""
    n = body.n or 1
    if n > engine.runner.n_slots:
        raise APIError(400, f"n is {n}; this server runs at most {engine.runner.n_slots} choices at once (its "
                            f"slots, serve --slots)", "n")
    if isinstance(body, CompletionBody) and body.best_of not in (None, n):
        raise APIError(400, f"best_of must equal n ({n}): this server generates no choices to drop", "best_of")
    if n * n_prompts > engine.runner.n_slots + max_queue:
        raise APIError(400, f"{n_prompts} prompts x n={n} make {n * n_prompts} choices; this server takes at most "
                            f"{engine.runner.n_slots + max_queue} in one request", "prompt")
    for param, ids in (("logit_bias", [int(k) for k in body.logit_bias or {}]),
                       ("stop_token_ids", body.stop_token_ids or [])):
        bad = [t for t in ids if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {engine.vocab_size}), got {bad[:5]}", param)
    return n


def _check_model(engine: Engine, name: str | None):
    if name not in (None, "", engine.model_name):
        raise APIError(404, f"the model '{echo(name)}' does not exist; this server serves '{engine.model_name}'",
                       "model", "model_not_found")


def _prometheus(engine: Engine) -> str:
    m, cache = engine.metrics, engine.runner.cache
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
        ("cache_checkpoint_bytes", "gauge", "bytes of prefix checkpoints", cache.store.nbytes if cache.store else 0),
        ("cache_checkpoints", "gauge", "prefix checkpoints held", cache.store.checkpoints if cache.store else 0),
        ("cache_hits_total", "counter", "prompts that restored a checkpoint", cache.hits),
        ("cached_prompt_tokens_total", "counter", "prompt tokens served from live state or checkpoints",
         m.cached_tokens_total),
    ]
    out = []
    for name, kind, help_text, value in rows:
        out += [f"# HELP deltaserve_{name} {help_text}", f"# TYPE deltaserve_{name} {kind}",
                f"deltaserve_{name} {value}"]
    return "\n".join(out) + "\n"

"""POST /tokenize and /detokenize, in the shapes llama-server and vLLM give them (both accepted):

    /tokenize   {"content": text} (llama-server) or {"prompt": text} (vLLM), or {"messages": [...]} (the ids a
                chat request with them gets); "add_special" / "add_special_tokens" (default false: as the
                completions endpoint encodes), "with_pieces" (llama-server: [{"id", "piece"}] instead of ids)
                -> {"tokens": [...], "count": n, "max_model_len": context}
    /detokenize {"tokens": [ids]} -> {"content": text, "prompt": text}
    GET /tokenizer_info (vLLM's) -> {"eos_token", "bos_token", "pad_token", "chat_template", ...}

The text goes through the same checks as a completion's prompt (size, valid Unicode), off the event loop.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .errors import APIError
from .schemas import MAX_MESSAGES, Message, valid_unicode


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    content: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special: bool | None = None
    add_special_tokens: bool | None = None
    with_pieces: bool | None = False

    @field_validator("content", "prompt")
    @classmethod
    def _unicode(cls, text):
        return text if text is None else valid_unicode(text)

    @model_validator(mode="after")
    def _one_input(self):
        given = [k for k in ("content", "prompt", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of content, prompt or messages, got {given or 'none'}")
        return self


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def install_tokenize(app: FastAPI, engine, prompts) -> None:
    """The two routes over `engine`'s tokenizer; `prompts` (app.Prompts) bounds and encodes text."""
    tok = engine.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        add = bool(body.add_special or body.add_special_tokens)
        if body.messages is not None:  # the ids a chat request with these messages is given
            ids, _, _ = await prompts.chat([{"role": m.role, "content": m.content} for m in body.messages], {})
        else:
            text = body.content if body.content is not None else body.prompt
            if len(text) > prompts.max_chars:
                raise APIError(400, f"the text has {len(text)} characters; at most {prompts.max_chars} fit this "
                                    f"model's context", "content" if body.content is not None else "prompt")
            ids = await asyncio.to_thread(tok.encode, text, add)
        tokens = ([{"id": i, "piece": tok.token_bytes(i).decode("utf-8", errors="replace")} for i in ids]
                  if body.with_pieces else ids)
        return {"tokens": tokens, "count": len(ids), "max_model_len": engine.max_len}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        # vLLM's: what a client-side tokenizer needs (lm-evaluation-harness's remote tokenizer reads it)
        return {**tok.special_token_texts, "chat_template": tok.chat_template, "vocab_size": tok.vocab_size,
                "model_max_length": engine.max_len, "add_bos_token": tok.add_bos}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {tok.vocab_size}), got {bad[:5]}", "tokens")
        text = tok.decode(body.tokens)
        return {"content": text, "prompt": text}

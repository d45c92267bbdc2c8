"""Logprobs in OpenAI's two response shapes.

Chat (`logprobs: true`, `top_logprobs: k`): {"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}], "refusal": null}, one entry per generated token.
Completions (`logprobs: k`, the legacy shape): {"tokens", "token_logprobs", "top_logprobs" (a dict token ->
logprob per position), "text_offset"}; with `echo` the prompt's tokens come first, the first of them with
a null logprob and null top_logprobs (nothing predicts it).

A token's text is its bytes decoded on their own (a token holding part of a UTF-8 character reads as
U+FFFD; its `bytes` are exact). text_offset is the character offset of each token in the choice's text
(which starts with the prompt under echo). The values are log_softmax of the raw logits: engine/logits.py.
"""

from __future__ import annotations

from deltaserve.engine.logits import TokenLogprob
from deltaserve.tokenizer import Tokenizer


class LogprobFormatter:
    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token: int) -> str:
        if token not in self._text:
            self._text[token] = self.tok.token_bytes(token).decode("utf-8", errors="replace")
        return self._text[token]

    def _entry(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": logprob, "bytes": list(self.tok.token_bytes(token))}

    def chat(self, entries: list[TokenLogprob]) -> dict:
        return {"content": [{**self._entry(e.token, e.logprob), "top_logprobs": [self._entry(t, v) for t, v in e.top]}
                            for e in entries], "refusal": None}

    def completion(self, entries: list[TokenLogprob], offset: int = 0) -> dict:
        """offset: of the first token in the choice's text (where a streamed chunk's text begins)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(self.text(e.token))
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({self.text(t): v for t, v in e.top} if e.top is not None else None)
            out["text_offset"].append(offset)
            offset += len(out["tokens"][-1])
        return out


def first_token(token: int) -> TokenLogprob:
    """The prompt's first token under echo: no logprob, no alternatives (OpenAI's nulls)."""
    return TokenLogprob(token, None, None)

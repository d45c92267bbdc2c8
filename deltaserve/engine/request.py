"""A generation request: its prompt, sampling settings, progress, and the text it has produced so far."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from deltaserve.tokenizer import Tokenizer

from .logits import TokenLogprob
from .sampling import SamplingParams

_ids = itertools.count()


@dataclass
class Delta:
    """New text of a request (text that could still become a stop string is held back), and the ids of the
    tokens generated since the previous Delta."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, when the request asked for them


@dataclass
class Done:
    """The request ended: reason is "stop" (eos or a stop string), "length", "cancelled" or "error"."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str
    token_ids: list[int]
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the slot's live state or a checkpoint
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids (params.logprobs)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.. (params.prompt_logprobs)


Event = Delta | Done


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    on_event: Callable[[Event], None] = lambda event: None
    marks: tuple[int, ...] = ()  # prompt positions to checkpoint (where a later turn may leave this prompt)
    cache_prompt: bool = True  # reuse cached prompt tokens (live state, checkpoints)
    id: int = field(default_factory=lambda: next(_ids))
    slot: int | None = None
    n_fed: int = 0  # prompt tokens already in the slot's state
    cached: int = 0  # of them, those the slot held when the request was admitted
    pending: int | None = None  # the last sampled token, not yet fed
    output_ids: list[int] = field(default_factory=list)
    done: Done | None = None
    cancelled: bool = False
    # n > 1: the other choices of the same prompt, which take a copy of this request's state once its
    # prompt is prefilled (Scheduler._prefilled) instead of prefilling it themselves
    followers: list[Request] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self):
        self.generator = self.params.generator()
        self.decoder = self.tokenizer.stream()
        self.eos = set() if self.params.ignore_eos else self.tokenizer.eos_token_ids
        self.end_ids = self.eos | set(self.params.stop_token_ids)  # tokens that end the request unseen
        self.text, self.sent, self.ids_sent = "", 0, 0

    @property
    def prefilling(self) -> bool:
        return self.n_fed < len(self.prompt_ids)

    def add_token(self, token: int, room: int, logprob: TokenLogprob | None = None) -> None:
        """Take a sampled token; `room` is how many more tokens the slot can hold after this one."""
        if token in self.end_ids:
            return self.finish("stop")
        self.output_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        before = len(self.text)
        self.text += self.decoder.feed(token)
        stops = self.params.stop
        # the text before this token held no stop string, so a new one ends in the new text: searching only
        # from there keeps the cost per token independent of the length of the output
        hits = [i for i in (self.text.find(s, max(before - len(s) + 1, 0)) for s in stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return self.finish("stop")
        if len(self.output_ids) >= self.params.max_tokens or room <= 0:
            self.text += self.decoder.flush()
            return self.finish("length")
        self._emit_until(len(self.text) - max((_held(self.text, s) for s in stops), default=0))
        self.pending = token

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.done is not None:
            return
        self.pending = None
        # done before any event goes out: a handler that raises cannot leave the request running
        self.done = Done(reason, len(self.prompt_ids), len(self.output_ids), self.text, self.output_ids, error,
                         self.cached, self.logprobs, self.prompt_logprobs)
        self._emit_until(len(self.text))
        self.on_event(self.done)

    def _emit_until(self, end: int) -> None:
        if end > self.sent:
            text, ids = self.text[self.sent:end], self.output_ids[self.ids_sent:]
            logprobs = self.logprobs[self.ids_sent:]
            self.sent, self.ids_sent = end, len(self.output_ids)
            self.on_event(Delta(text, ids, logprobs))


def _held(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `stop`: text that may still become it."""
    tail = text[max(len(text) - len(stop) + 1, 0):] if len(stop) > 1 else ""
    i = tail.find(stop[0])
    while i >= 0:  # the first candidate that matches is the longest
        if stop.startswith(tail[i:]):
            return len(tail) - i
        i = tail.find(stop[0], i + 1)
    return 0

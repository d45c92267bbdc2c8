"""A generation request: its prompt, sampling settings, progress, and the text it has produced so far."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from deltaserve.tokenizer import Tokenizer

from .sampling import SamplingParams

_ids = itertools.count()


@dataclass
class Delta:
    """New text of a request (text that could still become a stop string is held back)."""

    text: str


@dataclass
class Done:
    """The request ended: reason is "stop" (eos or a stop string), "length", "cancelled" or "error"."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str
    token_ids: list[int]
    error: str | None = None


Event = Delta | Done


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    on_event: Callable[[Event], None] = lambda event: None
    id: int = field(default_factory=lambda: next(_ids))
    slot: int | None = None
    n_fed: int = 0  # prompt tokens already in the slot's state
    pending: int | None = None  # the last sampled token, not yet fed
    output_ids: list[int] = field(default_factory=list)
    done: Done | None = None
    cancelled: bool = False

    def __post_init__(self):
        self.generator = self.params.generator()
        self.decoder = self.tokenizer.stream()
        self.eos = set() if self.params.ignore_eos else self.tokenizer.eos_token_ids
        self.text, self.sent = "", 0

    @property
    def prefilling(self) -> bool:
        return self.n_fed < len(self.prompt_ids)

    def add_token(self, token: int, room: int) -> None:
        """Take a sampled token; `room` is how many more tokens the slot can hold after this one."""
        if token in self.eos:
            return self.finish("stop")
        self.output_ids.append(token)
        self.text += self.decoder.feed(token)
        stops = self.params.stop
        hits = [i for i in (self.text.find(s) for s in stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return self.finish("stop")
        if len(self.output_ids) >= self.params.max_tokens or room <= 0:
            self.text += self.decoder.flush()
            return self.finish("length")
        held = max((n for s in stops for n in range(len(s) - 1, 0, -1) if self.text.endswith(s[:n])), default=0)
        self._emit_until(len(self.text) - held)
        self.pending = token

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.done is not None:
            return
        self.pending = None
        # done before any event goes out: a handler that raises cannot leave the request running
        self.done = Done(reason, len(self.prompt_ids), len(self.output_ids), self.text, self.output_ids, error)
        self._emit_until(len(self.text))
        self.on_event(self.done)

    def _emit_until(self, end: int) -> None:
        if end > self.sent:
            self.on_event(Delta(self.text[self.sent:end]))
            self.sent = end

"""A reply's thinking, split from its answer as text streams in: what the model writes inside
<think>...</think> becomes `reasoning_content`, the rest `content`.

A Qwen3.5 prompt opens the block itself (the generation prompt ends with "<think>\\n"), so the reply starts
inside it; a Qwen3 reply may open it as its first words. A reply cut off before </think> is all reasoning.
The whitespace around the thinking is the template's layout, not the model's words: it is dropped, as
the templates drop it when they render an earlier turn. Pieces are emitted as soon as no marker can still
be forming across the cut, so the streamed pieces join to what the whole text gives.
"""

from __future__ import annotations

from deltaserve.callforms import THINK_CLOSE, THINK_OPEN

REASONING, CONTENT = "reasoning", "content"
_START, _THINK, _ANSWER = "start", "think", "answer"


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may be the start of one of `markers` (to wait for)."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt leaves the model inside a <think> block."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class ReasoningSplitter:
    """feed(text) / finish() -> [(REASONING or CONTENT, text)]."""

    def __init__(self, opened: bool):
        """opened: the prompt ended inside <think> (opens_thinking)."""
        self.state = _THINK if opened else _START
        self.buf = ""
        self.lead = True  # whitespace here starts the reasoning, or the answer after </think>: dropped

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.state == _START:
                head = self.buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self.buf, self.state = head[len(THINK_OPEN):], _THINK
                    continue
                if THINK_OPEN.startswith(head):  # "", or "<thi": not decided yet
                    break
                self.state, self.lead = _ANSWER, False
            elif self.state == _THINK:
                end = self.buf.find(THINK_CLOSE)
                if end < 0:
                    self._emit(out, REASONING, self._ready(len(self.buf) - held_back(self.buf, (THINK_CLOSE,))))
                    break
                self._emit(out, REASONING, self.buf[:end].rstrip())
                self.buf, self.state, self.lead = self.buf[end + len(THINK_CLOSE):], _ANSWER, True
            else:
                self._emit(out, CONTENT, self.buf)
                self.buf = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        rest, self.buf = self.buf, ""
        if self.state == _THINK:
            self._emit(out, REASONING, rest.rstrip())
        else:
            self._emit(out, CONTENT, rest)
        return out

    def _ready(self, upto: int) -> str:
        """The reasoning in buf[:upto] that can go out now: trailing whitespace waits (it may end the block)."""
        ready = self.buf[:upto].rstrip()
        self.buf = self.buf[len(ready):]
        return ready

    def _emit(self, out: list, kind: str, text: str) -> None:
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        if text:
            out.append((kind, text))

"""A chat reply's text as the OpenAI API returns it: thinking in `reasoning_content`, tool calls in
`tool_calls` (finish_reason "tool_calls"), the rest in `content`; streamed as OpenAI streams it (a call's
first delta carries its index, id, type and name, the next ones fragments of its arguments).

The whole reply and the stream are read by the same parsers, so the deltas of a stream join to the
message of the same text, wherever the text was cut into pieces."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from deltaserve.callforms import THINK_OPEN, CallForm, form_of_template

from .reasoning import CONTENT, REASONING, ReasoningSplitter, opens_thinking
from .toolcalls import CALL, ToolCallParser

PARSERS = ("auto", "qwen3_coder", "hermes", "none")  # --tool-call-parser


def call_form(parser: str, template: str | None) -> CallForm | None:
    """The tool-call form to read (`parser` as --tool-call-parser takes it; auto: the template's)."""
    if parser == "auto":
        return form_of_template(template)
    return None if parser == "none" else CallForm(parser)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class OutputFormat:
    """How one request's reply is read: made per request from the template, the prompt and the tools."""

    form: CallForm | None = None  # None, or no tools in the request: tool calls are not looked for
    tools: list[dict] | None = None
    thinking: bool = False  # the template knows <think>: a reply may think
    opened: bool = False  # the prompt left the model inside <think>

    @classmethod
    def of(cls, form: CallForm | None, template: str | None, prompt: str, tools: list[dict] | None) -> OutputFormat:
        opened = opens_thinking(prompt)
        return cls(form=form if tools else None, tools=tools, opened=opened,
                   thinking=opened or bool(template and THINK_OPEN in template))


@dataclass
class ChatOutput:
    """feed(text) / finish() -> delta dicts of chat.completion.chunk; message() -> the whole message."""

    fmt: OutputFormat
    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.splitter = ReasoningSplitter(self.fmt.opened) if self.fmt.thinking else None
        self.tools = ToolCallParser(self.fmt.form, self.fmt.tools, new_call_id) if self.fmt.form else None

    def feed(self, text: str) -> list[dict]:
        pieces = self.splitter.feed(text) if self.splitter else [(CONTENT, text)]
        return self._deltas(pieces)

    def finish(self) -> list[dict]:
        pieces = self.splitter.finish() if self.splitter else []
        return self._deltas(pieces, final=True)

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" else reason

    def message(self) -> dict:
        """The assistant message of what was fed (after finish)."""
        message = {"role": "assistant", "content": self.content or (None if self.calls else "")}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = self.calls
        return message

    def _deltas(self, pieces: list[tuple[str, str]], final: bool = False) -> list[dict]:
        events: list[tuple] = []
        for kind, text in pieces:
            if kind == REASONING or self.tools is None:
                events.append((kind, text))
            else:
                events += self.tools.feed(text)
        if final and self.tools is not None:
            events += self.tools.finish()
        deltas: list[dict] = []
        for event in events:
            self._record(event)
            delta = _delta(event)
            merged = deltas and event[0] in (REASONING, CONTENT) and set(deltas[-1]) == set(delta)
            if merged:  # consecutive text of one kind: one delta
                key = next(iter(delta))
                deltas[-1][key] += delta[key]
            else:
                deltas.append(delta)
        return deltas

    def _record(self, event: tuple) -> None:
        if event[0] == REASONING:
            self.reasoning += event[1]
        elif event[0] == CONTENT:
            self.content += event[1]
        elif event[0] == CALL:
            self.calls.append({"id": event[2], "type": "function", "function": {"name": event[3], "arguments": ""}})
        else:
            self.calls[event[1]]["function"]["arguments"] += event[2]


def _delta(event: tuple) -> dict:
    if event[0] == REASONING:
        return {"reasoning_content": event[1]}
    if event[0] == CONTENT:
        return {"content": event[1]}
    if event[0] == CALL:
        return {"tool_calls": [{"index": event[1], "id": event[2], "type": "function",
                                "function": {"name": event[3], "arguments": ""}}]}
    return {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}

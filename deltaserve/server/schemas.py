"""Request bodies of the API, validated before anything else runs: every value that reaches the engine is
one SamplingParams accepts and the sampler handles (see engine.sampling), and what a request can make the
engine do per token is bounded (stop strings)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deltaserve.engine.sampling import SEED_MAX, SEED_MIN, SamplingParams

# Each stop string is searched for after every token, and text that may still become one is held back:
# OpenAI allows 4; a few more for clients that list variants, each long enough for any real delimiter.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
# Messages are validated on the event loop, about 10 us each: 60,000 of them (2 MB) held it for 0.6 s.
MAX_MESSAGES = 4096


def valid_unicode(text: str) -> str:
    """`text`, if it is valid Unicode: JSON can carry an unpaired surrogate ("\\ud800"), which no tokenizer
    encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text holds an unpaired UTF-16 surrogate (U+{ord(text[e.start]):04X}) at "
                         f"character {e.start}") from None
    return text


class _Body(BaseModel):
    # Unknown fields (logprobs, user, ...) are ignored as OpenAI-compatible servers do; a null means the
    # default, as in OpenAI's API. Types are strict, as OpenAI's are: "5" is not an int, true not a 1, and
    # NaN and infinity are not numbers.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1, le=1)
    return_token_ids: bool | None = False  # vLLM's extension: the generated ids in each choice and chunk
    ignore_eos: bool | None = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)
    cache_prompt: bool | None = True  # llama-server's: False prefills the whole prompt, reusing nothing

    @field_validator("stop", mode="before")
    @classmethod
    def _bounded_stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list):
            return stops  # the type check that follows names the problem
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for s in stops:
            if isinstance(s, str) and not 0 < len(s) <= MAX_STOP_CHARS:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}")
        return stops

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=_default(self.temperature, 1.0),
                              top_k=_default(self.top_k, 0), top_p=_default(self.top_p, 1.0),
                              min_p=_default(self.min_p, 0.0), seed=self.seed, stop=list(self.stop or []),
                              ignore_eos=bool(self.ignore_eos))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = False


class CompletionBody(_Body):
    prompt: str | list[int]

    @field_validator("prompt", mode="before")
    @classmethod
    def _valid_prompt(cls, prompt):
        if isinstance(prompt, str):
            return valid_unicode(prompt)
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt
        raise ValueError("prompt must be a string or a list of token ids (integers)")


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str = ""

    @field_validator("content", mode="before")
    @classmethod
    def _text_of(cls, content):
        """A string, null, or a list of text parts, joined: the models served read text only."""
        if content is None:
            return ""
        if isinstance(content, str):
            return valid_unicode(content)
        if not isinstance(content, list):
            raise ValueError("content must be a string or a list of text parts")
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError(f"part {i}: only parts of type 'text' are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: 'text' must be a string")
            texts.append(valid_unicode(part["text"]))
        return "".join(texts)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None  # with a forced tool_choice, made into a grammar by server.structured


def _default(value, default):
    return default if value is None else value


_Body.model_rebuild()

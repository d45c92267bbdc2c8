"""Request bodies of the API, validated before anything else runs: every value that reaches the engine is
one SamplingParams accepts and the sampler handles (see engine.sampling), and what a request can make the
engine do per token is bounded (stop strings)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deltaserve.engine.sampling import MAX_LOGPROBS, SEED_MAX, SEED_MIN, SamplingParams

from .errors import echo

# Each stop string is searched for after every token, and text that may still become one is held back:
# OpenAI allows 4; a few more for clients that list variants, each long enough for any real delimiter.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
# Messages are validated on the event loop, about 10 us each: 60,000 of them (2 MB) held it for 0.6 s.
MAX_MESSAGES = 4096
MAX_LOGIT_BIAS = 300  # OpenAI's bound
MAX_N = 64  # choices per prompt; the server also bounds them by its slots
# chat parameters of OpenAI's API that this server refuses: (why, the one value that is accepted)
REFUSED = {
    "audio": ("the models served output text only", None),
    "modalities": ("the models served output text only", ["text"]),
    "prediction": ("predicted outputs are not implemented", None),
    "web_search_options": ("there is no web search", None),
    "moderation": ("there is no moderation model", None),
    "verbosity": ("the models served have no verbosity setting", None),
    "prompt_cache_retention": ("the prompt cache keeps entries by its own memory budget", None),
    "prompt_cache_options": ("the prompt cache keeps entries by its own memory budget", None),
    "functions": ("deprecated by OpenAI: send tools", None),
    "function_call": ("deprecated by OpenAI: send tool_choice", None),
}


def valid_unicode(text: str) -> str:
    """`text`, if it is valid Unicode: JSON can carry an unpaired surrogate ("\\ud800"), which no tokenizer
    encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text holds an unpaired UTF-16 surrogate (U+{ord(text[e.start]):04X}) at "
                         f"character {e.start}") from None
    return text


class RequestBody(BaseModel):
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
    n: int | None = Field(default=1, ge=1, le=MAX_N)  # at most the server's slots (app)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)  # vLLM's extension, as llama-server's
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM's extension
    stop_token_ids: list[int] | None = None  # vLLM's extension
    # identifiers and tags OpenAI keeps for monitoring and cache routing: accepted, they change no output
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    store: bool | None = None
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

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_keys(cls, bias):
        if isinstance(bias, dict):
            if len(bias) > MAX_LOGIT_BIAS:  # each is applied at every step
                raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
            for key, value in bias.items():
                if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                    raise ValueError(f"keys must be token ids written as strings, got '{echo(str(key))}'")
                if type(value) in (int, float) and not -100 <= value <= 100:
                    raise ValueError(f"the bias of token {key} must be in [-100, 100], got {value}")
            return {k: float(v) if type(v) is int else v for k, v in bias.items()}
        return bias

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, store):
        if store:
            raise ValueError("this server stores no completions: store must be false or absent")
        return store

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=_default(self.temperature, 1.0),
                              top_k=_default(self.top_k, 0), top_p=_default(self.top_p, 1.0),
                              min_p=_default(self.min_p, 0.0), seed=self.seed, stop=list(self.stop or []),
                              ignore_eos=bool(self.ignore_eos), presence_penalty=_default(self.presence_penalty, 0.0),
                              frequency_penalty=_default(self.frequency_penalty, 0.0),
                              repetition_penalty=_default(self.repetition_penalty, 1.0),
                              logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
                              min_tokens=_default(self.min_tokens, 0), stop_token_ids=list(self.stop_token_ids or []),
                              **self._logprobs())

    def _logprobs(self) -> dict:
        return {}



class _Refusing(BaseModel):
    """Parameters of OpenAI's API this server cannot honour: a request that sets one gets a 400 naming it
    rather than an answer that silently ignores it. A null is the default and passes."""

    @field_validator(*REFUSED, mode="before", check_fields=False)
    @classmethod
    def _refuse(cls, value, info):
        if value is not None and value != REFUSED[info.field_name][1]:
            raise ValueError(f"not supported by this server: {REFUSED[info.field_name][0]}")
        return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = False


class CompletionBody(RequestBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1)  # only best_of == n: no choice is generated to be dropped
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _valid_prompt(cls, prompt):
        if isinstance(prompt, str):
            return valid_unicode(prompt)
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [valid_unicode(p) for p in prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) and all(type(t) is int for t in p)
                                                       for p in prompt):
            return prompt
        raise ValueError("prompt must be a string, a list of token ids (integers), or a non-empty list of either")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix):
        if suffix:
            raise ValueError("not supported by this server: the models served do not fill in the middle")
        return suffix

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of a batched request, one per choice group (a single prompt is a list of one)."""
        p = self.prompt
        return [p] if isinstance(p, str) or not p or isinstance(p[0], int) else p

    def _logprobs(self) -> dict:
        return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs if self.echo else None}


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str = ""
    # checked and handed to the chat template by chat_request
    tool_calls: list[dict] | None = Field(default=None, max_length=MAX_MESSAGES)
    reasoning_content: str | None = None
    tool_call_id: str | None = None
    name: str | None = None

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


class ChatBody(RequestBody, _Refusing):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    verbosity: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: str | None = None  # the models have thinking on or off, no levels: see chat_request

    # checked by chat_request: the template's inputs, and which tool calls the reply is read for
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # calls are read however many the model writes
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool | None = True  # vLLM's: False with continue_final_message
    continue_final_message: bool | None = False  # vLLM's: the reply continues the final assistant message
    response_format: dict | None = None  # with a forced tool_choice, made into a grammar by server.structured

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top, info):
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    def _logprobs(self) -> dict:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}


def _default(value, default):
    return default if value is None else value


RequestBody.model_rebuild()

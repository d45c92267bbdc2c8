"""Every parameter the openai SDK's chat.completions.create and completions.create can send either works or
gets a 400 naming it: none is silently dropped. The tables list them all, and the test fails when the
installed SDK has a parameter they do not list. What "works" does is checked in test_sampling_api.py and
test_openai_api.py; here a working value must be accepted and answered."""

import inspect

import openai
import pytest
from openai.resources.chat.completions import Completions as ChatCompletions
from openai.resources.completions import Completions

HI = [{"role": "user", "content": "Hi"}]
TRANSPORT = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}  # the SDK's own, not sent as such
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}

CHAT_WORKS = {
    "messages": {}, "model": {}, "frequency_penalty": {"frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {"7": 2.5}}, "logprobs": {"logprobs": True},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2}, "max_completion_tokens": {"max_completion_tokens": 2},
    "max_tokens": {"max_tokens": 2}, "n": {"n": 2}, "presence_penalty": {"presence_penalty": -0.5},
    "seed": {"seed": 9}, "stop": {"stop": ["\n\n"]}, "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "temperature": {"temperature": 0.3}, "top_p": {"top_p": 0.5}, "user": {"user": "u-1"},
    "safety_identifier": {"safety_identifier": "s-1"}, "prompt_cache_key": {"prompt_cache_key": "conv-1"},
    "metadata": {"metadata": {"team": "a"}}, "store": {"store": False}, "service_tier": {"service_tier": "auto"},
    "modalities": {"modalities": ["text"]}, "reasoning_effort": {"reasoning_effort": "low"},
    # what they do is checked in test_tool_calls.py, test_structured.py and test_forced_calls.py
    "tools": {"tools": [TOOL]}, "tool_choice": {"tools": [TOOL], "tool_choice": "required"},
    "parallel_tool_calls": {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False},
    "response_format": {"response_format": {"type": "json_object"}},
}
CHAT_REFUSED = {
    "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content", "content": "Hi"},
    "web_search_options": {}, "moderation": {"model": "omni-moderation-latest"}, "verbosity": "low",
    "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "30m"},
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": "auto",
}
CHAT_REFUSED_VALUES = [("store", True), ("service_tier", "flex"), ("service_tier", "priority"),
                       ("modalities", ["text", "audio"]), ("parallel_tool_calls", "no"),
                       ("response_format", {"type": "grammar"}), ("tool_choice", "sometimes")]

COMPLETION_WORKS = {
    "model": {}, "prompt": {}, "best_of": {"best_of": 2, "n": 2}, "echo": {"echo": True},
    "frequency_penalty": {"frequency_penalty": 0.5}, "logit_bias": {"logit_bias": {"7": -100}},
    "logprobs": {"logprobs": 3}, "max_tokens": {"max_tokens": 2}, "n": {"n": 2},
    "presence_penalty": {"presence_penalty": 1.0}, "seed": {"seed": 2}, "stop": {"stop": "x"},
    "stream": {"stream": True}, "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "temperature": {"temperature": 0}, "top_p": {"top_p": 0.9}, "user": {"user": "u-2"},
}
COMPLETION_REFUSED = {"suffix": "the end"}
COMPLETION_REFUSED_VALUES = [("best_of", 3)]


def sdk_parameters(method) -> set[str]:
    return set(inspect.signature(method).parameters) - TRANSPORT


def test_the_tables_cover_every_sdk_parameter():
    chat = set(CHAT_WORKS) | set(CHAT_REFUSED)
    assert sdk_parameters(ChatCompletions.create) == chat, "a chat parameter this test does not decide on"
    assert sdk_parameters(Completions.create) == set(COMPLETION_WORKS) | set(COMPLETION_REFUSED)


def answered(result) -> list:
    """The choices of a response, or of a stream's chunks."""
    if isinstance(result, openai.Stream):
        return [c for chunk in result for c in chunk.choices]
    return result.choices


@pytest.mark.parametrize("name", sorted(CHAT_WORKS))
def test_chat_parameter_works(client, name):
    kwargs = {"max_tokens": 2, **CHAT_WORKS[name]}
    choices = answered(client.chat.completions.create(model="tiny", messages=HI, **kwargs))
    assert choices and {c.index for c in choices} == set(range(kwargs.get("n", 1)))


@pytest.mark.parametrize("name, value", sorted(CHAT_REFUSED.items()) + CHAT_REFUSED_VALUES)
def test_chat_parameter_is_refused_by_name(client, name, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=2, **{name: value})
    assert info.value.body["param"] == name


@pytest.mark.parametrize("name", sorted(COMPLETION_WORKS))
def test_completion_parameter_works(client, name):
    kwargs = {"max_tokens": 2, **COMPLETION_WORKS[name]}
    choices = answered(client.completions.create(model="tiny", prompt="Hi", **kwargs))
    assert choices and {c.index for c in choices} == set(range(kwargs.get("n", 1)))


@pytest.mark.parametrize("name, value", sorted(COMPLETION_REFUSED.items()) + COMPLETION_REFUSED_VALUES)
def test_completion_parameter_is_refused_by_name(client, name, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, **{name: value})
    assert info.value.body["param"] == name


def test_reasoning_effort_none_switches_thinking_off_as_enable_thinking_false_does(client):
    def prompt_tokens(**extra):
        return client.chat.completions.create(model="tiny", messages=HI, max_tokens=1, **extra).usage.prompt_tokens

    off = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert prompt_tokens(reasoning_effort="none") == prompt_tokens(reasoning_effort="minimal") == off
    assert prompt_tokens(reasoning_effort="high") == prompt_tokens() != off
    with pytest.raises(openai.BadRequestError) as e:
        prompt_tokens(reasoning_effort="extreme")
    assert e.value.body["param"] == "reasoning_effort"

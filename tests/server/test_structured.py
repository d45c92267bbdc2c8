"""Structured output through the API, driven by real clients against a real server: the openai SDK's
`parse` with a pydantic model, LangChain's `with_structured_output`, forced tool calls, and a 400 naming
the parameter for each bad schema or choice.

The server's model is the random tiny qwen35 with its template's thinking switched off, so that the
answer starts at once (a random model rarely closes a <think> block)."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from deltaserve.engine.engine import Engine
from deltaserve.engine.llm import load
from deltaserve.server.app import create_app

from .conftest import LiveServer, assert_error


class Person(BaseModel):
    name: str = Field(max_length=7)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    tags: list[Literal["red", "green", "blue"]] = Field(max_length=3)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 9},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                                                "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "Who is on duty, and what is the weather?"}]


@pytest.fixture(scope="module")
def server(tiny_gguf):
    model, tokenizer = load(tiny_gguf)
    tokenizer.chat_template = "{%- set enable_thinking = false %}" + tokenizer.chat_template
    engine = Engine(model, tokenizer, n_slots=3, max_len=1024, model_name="tiny")
    live = LiveServer(create_app(engine))
    yield live
    live.stop()
    engine.close()


def test_openai_sdk_parses_a_pydantic_model(client):
    for seed in range(3):
        completion = client.beta.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Person,
                                                        max_tokens=300, seed=seed)
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, Person)
        jsonschema.validate(json.loads(message.content), Person.model_json_schema())


def test_langchain_structured_output(server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="tiny", max_tokens=300, seed=7,
                      max_retries=0)
    person = chat.with_structured_output(Person, method="json_schema").invoke("Describe someone on duty.")
    assert isinstance(person, Person)


def test_json_object_and_streamed_json_schema(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=300, seed=2,
                                         response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":  # an open object can go on past max_tokens
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    schema = Person.model_json_schema()
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=300, seed=3, stream=True,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "person", "schema": schema, "strict": True}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


def _calls(message) -> list[tuple[str, dict]]:
    """(name, arguments) of the calls in a reply: from `tool_calls` where the server parses them, else read
    from the content with regular expressions (the tiny model's template writes Qwen3.5's XML form)."""
    if message.tool_calls:
        return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    calls = re.findall(r"<tool_call>\n<function=([\w-]+)>\n(.*?)</function>\n</tool_call>", message.content, re.S)
    assert calls and "".join(re.findall(r"<tool_call>.*?</tool_call>\n?", message.content, re.S)) == \
        message.content, message.content
    out = []
    for name, body in calls:  # XML values are raw text for strings, JSON for anything else
        props = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in (WEATHER, TIME)}[name]
        raw = {k for k, p in props.items() if p.get("type") == "string" or "enum" in p}
        args = {k: (v if k in raw else json.loads(v))
                for k, v in re.findall(r"<parameter=([\w-]+)>\n(.*?)\n</parameter>\n", body, re.S)}
        out.append((name, args))
    return out


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_valid_calls_of_allowed_tools(client, choice):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(3):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=300, seed=seed,
                                             tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
        calls = _calls(out.choices[0].message)
        assert len(calls) == 1
        name, args = calls[0]
        assert name in (schemas if choice == "required" else ["get_time"])
        jsonschema.validate(args, schemas[name])


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "not a valid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "response_format", "cannot be used"),
    ({"response_format": {"type": "xml"}}, "response_format", "type is one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "name"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
      "tool_choice": "required"}, "tools", "not a valid JSON schema"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "one of them"),
    # the tiny model writes the XML form: a raw string must meet its pattern, so one with look-ahead is refused
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "k": {"type": "string", "pattern": "^(?!x)"}}}}}], "tool_choice": "required"}, "tools",
     "tool 'f', parameter 'k': pattern '^(?!x)' cannot be used: look-around"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/A"}}}}}], "tool_choice": "required"}, "tools",
     "a cycle of $refs"),
])
def test_bad_structured_output_requests_get_a_400_naming_the_parameter(server, body, param, fragment):
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, **body},
                          timeout=60)
    assert_error(response, 400, param, fragment)

"""What a chat request hands the template, seen in the prompt the server bills: tools, thinking switched off,
earlier calls and their results, continuing the final assistant message; each counted against transformers'
own rendering of the model's template. Bad inputs get one 400 naming the parameter."""

import json

import httpx
import pytest

from .conftest import assert_error
transformers = pytest.importorskip("transformers")
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

# short: the tiny server's context is 512 tokens, and the tools block's instructions take most of it
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}
ROUND = ASK + [{"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]


def billed(server, **body) -> int:
    r = httpx.post(server.url + "/v1/chat/completions", json={"max_tokens": 1, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def theirs(engine, messages, **options) -> int:
    """Prompt tokens of transformers' rendering (tool-call arguments decoded, as templates take them)."""
    messages = json.loads(json.dumps(messages))
    for m in messages:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    rendered, _ = render_jinja_template([messages], chat_template=engine.tokenizer.template,
                                        **{"add_generation_prompt": True, **options})
    return len(engine.tokenizer.encode(rendered[0]))


@pytest.mark.parametrize("body, options", [
    ({"messages": ASK}, {}),
    ({"messages": ASK, "tools": [WEATHER]}, {"tools": [WEATHER]}),
    ({"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
    ({"messages": ROUND, "tools": [WEATHER]}, {"tools": [WEATHER]}),
    ({"messages": ASK + [{"role": "assistant", "content": "It is"}], "add_generation_prompt": False,
      "continue_final_message": True}, {"add_generation_prompt": False, "continue_final_message": True}),
], ids=["plain", "tools", "thinking-off", "tool-round", "continue"])
def test_the_prompt_is_the_templates_rendering(server, engine, body, options):
    ours = billed(server, **body)
    assert ours == theirs(engine, body["messages"], **options)
    if body.get("tools") or "chat_template_kwargs" in body:
        assert ours != billed(server, messages=body["messages"])  # the inputs changed the prompt


BAD = [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": "get_weather"}, "tools"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "other"}}, "tools": [WEATHER]}, "tool_choice"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "think"}, "chat_template_kwargs"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    ({"messages": [*ASK, {"role": "assistant", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[2].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}]}, "messages"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[p for _, p in BAD])
def test_bad_inputs_are_400_naming_the_parameter(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, **body}, timeout=60)
    assert_error(r, 400, param)

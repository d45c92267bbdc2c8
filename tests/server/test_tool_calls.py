"""Tool calls and thinking through real clients against a real server: the openai SDK (whole and streamed,
the call's result sent back) and LangChain's ChatOpenAI.bind_tools. The model is fitted (toolmodel.py) to
answer exactly these conversations with hand-written replies, so the clients see a call only if the server
rendered their tools and history into the very prompt the model was fitted on and parsed its reply."""

import json

import pytest

from deltaserve.callforms import CallForm
from deltaserve.server.app import create_app

from .conftest import LiveServer
from .toolmodel import ANSWER, CALL_ARGS, QUESTION, RESULT, THOUGHT, WEATHER

openai = pytest.importorskip("openai")
ASK = [{"role": "user", "content": QUESTION}]


@pytest.fixture
def client(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="none", max_retries=0)


def ask(client, messages=ASK, **kw):
    return client.chat.completions.create(model="tool", messages=messages, tools=[WEATHER], temperature=0,
                                          max_tokens=200, **kw)


def test_a_call_with_its_thinking_and_typed_arguments(client):
    choice = ask(client).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.model_extra["reasoning_content"] == THOUGHT
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}  # days typed by the schema


def test_a_streamed_call_arrives_as_openai_streams_it(client):
    chunks = [c for c in ask(client, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert reasoning == THOUGHT and not "".join(d.content or "" for d in deltas)
    first, rest = calls[0], calls[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function", "get_weather", "")
    assert first.id.startswith("call_") and rest and all(c.index == 0 and c.id is None and c.function.name is None
                                                         for c in rest)
    assert json.loads("".join(c.function.arguments for c in rest)) == CALL_ARGS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_result_sent_back_gets_the_answer(client):
    """The assistant's call (arguments as the JSON text the SDK returned) and the tool's result are rendered
    into the history as the model was fitted on: it answers from the result."""
    message = ask(client).choices[0].message
    history = [*ASK, {"role": "assistant", "content": None, "reasoning_content": message.model_extra["reasoning_content"],
                      "tool_calls": [c.model_dump() for c in message.tool_calls]},
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": RESULT}]
    choice = ask(client, history).choices[0]
    assert (choice.message.content, choice.finish_reason, choice.message.tool_calls) == (ANSWER, "stop", None)
    assert choice.message.model_extra["reasoning_content"] == "The tool answered."


def test_tool_choice_none_leaves_the_call_in_the_text(client):
    choice = ask(client, tool_choice="none").choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content.startswith("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n")


def test_the_parser_option_none_reads_no_calls(tool_engine):
    live = LiveServer(create_app(tool_engine, tool_call_parser="none"))
    try:
        plain = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)
        message = ask(plain).choices[0].message
    finally:
        live.stop()
    assert message.tool_calls is None and message.content.startswith("<tool_call>")


def test_langchain_bind_tools_returns_the_call(tool_server):
    chat_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed").ChatOpenAI
    llm = chat_openai(base_url=tool_server.url + "/v1", api_key="none", model="tool", temperature=0, max_tokens=200,
                      max_retries=0).bind_tools([WEATHER])
    reply = llm.invoke(QUESTION)
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("get_weather", CALL_ARGS)]
    chunks = list(llm.stream(QUESTION))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed = streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("get_weather", CALL_ARGS)]


def test_a_json_call_from_a_qwen3_style_template(tool_engines):
    """A template that writes JSON calls (the hermes form) has its replies read in that form, the thinking
    opened by the reply itself; --tool-call-parser qwen3_coder on the same model reads no call."""
    engine = tool_engines(CallForm.JSON)
    for parser, calls in (("auto", [("get_weather", CALL_ARGS)]), ("qwen3_coder", [])):
        live = LiveServer(create_app(engine, tool_call_parser=parser))
        try:
            client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)
            message = ask(client).choices[0].message
            streamed = [c.choices[0].delta for c in ask(client, stream=True) if c.choices]
        finally:
            live.stop()
        assert message.model_extra["reasoning_content"] == THOUGHT
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []] == calls
        names = [c.function.name for d in streamed for c in d.tool_calls or [] if c.function.name]
        assert names == [name for name, _ in calls]
        if not calls:
            assert message.content.startswith('<tool_call>\n{"name": "get_weather"')

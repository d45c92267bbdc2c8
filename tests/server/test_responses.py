"""POST /v1/responses through the real openai SDK (`client.responses`): on the fitted tool model
(toolmodel.py), which writes its thinking and call only after exactly the prompt it was fitted on, so the
client sees them only if the server rendered the Responses input as that chat and parsed the reply into
output items; on the tiny model, text against the engine alone (greedy), structured output, and the
requests this server refuses by name."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from .conftest import assert_error, settled
from .toolmodel import ANSWER, CALL_ARGS, QUESTION, RESULT, THOUGHT, WEATHER

openai = pytest.importorskip("openai")
TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool


@pytest.fixture
def tool_client(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def ask(client, input=QUESTION, **kw):
    return client.responses.create(model="tool", input=input, tools=[TOOL], temperature=0, max_output_tokens=200,
                                   **kw)


def test_a_call_with_its_thinking(tool_client):
    response = ask(tool_client)
    assert response.object == "response" and response.status == "completed" and response.id.startswith("resp_")
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == [THOUGHT]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == CALL_ARGS and response.output_text == ""
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_the_output_sent_back_with_the_result_gets_the_answer(tool_client):
    """The response's own output items (reasoning, call) go back as input with the call's output, as a client
    of a server that stores nothing sends them: the model answers from the result."""
    first = ask(tool_client)
    call = first.output[1]
    history = [{"role": "user", "content": QUESTION}, *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    answer = ask(tool_client, history)
    assert answer.output_text == ANSWER and answer.status == "completed"
    assert [item.type for item in answer.output] == ["reasoning", "message"]
    assert answer.output[0].content[0].text == "The tool answered."


def test_a_streamed_call_arrives_as_responses_events(tool_client):
    """The SDK's own stream helper checks the events' order and ids as it accumulates them."""
    with tool_client.responses.stream(model="tool", input=QUESTION, tools=[TOOL], temperature=0,
                                      max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert thought == THOUGHT and json.loads(arguments) == CALL_ARGS
    assert [(e.type, e.item.type) for e in events if e.type.startswith("response.output_item")] == [
        ("response.output_item.added", "reasoning"), ("response.output_item.done", "reasoning"),
        ("response.output_item.added", "function_call"), ("response.output_item.done", "function_call")]
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert json.loads(final.output[1].arguments) == CALL_ARGS and final.usage.output_tokens > 0


def test_text_is_the_engines_greedy_answer_whole_and_streamed(client, reference):
    instructions, question = "Answer briefly.", "To be, or not to be?"
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": question}]
    prompt = reference.tokenizer.chat_prompt(messages, enable_thinking=False)
    expected = reference.generate(prompt, max_tokens=10, temperature=0)
    options = dict(model="tiny", instructions=instructions, temperature=0, max_output_tokens=10,
                   reasoning={"effort": "none"})
    whole = client.responses.create(input=[{"role": "user", "content": [{"type": "input_text", "text": question}]}],
                                    **options)
    assert whole.output_text == expected.text and whole.usage.output_tokens == len(expected.token_ids)
    assert whole.usage.input_tokens == len(reference.tokenizer.encode(prompt))
    assert whole.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    events = list(client.responses.create(input=question, stream=True, **options))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.text
    assert events[-1].response.output_text == expected.text


def test_max_output_tokens_ends_an_incomplete_response(client):
    response = client.responses.create(model="tiny", input="Tell me a story", max_output_tokens=3, temperature=0,
                                       reasoning={"effort": "none"}, extra_body={"ignore_eos": True})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    options = dict(model="tiny", input="Tell me a story", max_output_tokens=3, temperature=0,
                   extra_body={"ignore_eos": True})  # thinking on: cut off while thinking, no message
    thinking = client.responses.create(**options)
    streamed = list(client.responses.create(stream=True, **options))[-1]
    assert streamed.type == "response.incomplete"
    for whole in (thinking, streamed.response):
        assert [item.type for item in whole.output] == ["reasoning"] and whole.output_text == ""


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    response = client.responses.create(model="tiny", input="Is it fine?", temperature=0, max_output_tokens=60,
                                       reasoning={"effort": "none"},
                                       text={"format": {"type": "json_schema", "name": "verdict", "schema": schema,
                                                        "strict": True}})
    answer = json.loads(response.output_text)
    assert list(answer) == ["ok"] and isinstance(answer["ok"], bool)


@pytest.mark.parametrize("body, param, fragment", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stored responses"),
    ({"truncation": "auto"}, "truncation", "input items are not dropped"),
    ({"store": True}, "store", "stores no"),
    ({"background": True}, "background", "answered in the request"),
    ({"include": ["message.output_text.logprobs"]}, "include", "message.output_text.logprobs"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "only text parts"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", '"item_reference" are not supported'),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "role must be one of"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id", "needs 'call_id'"),
    ({"input": []}, "input", "holds no message"),
    ({"n": 2}, "n", "one output"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "stored prompt templates"),
    ({"max_tool_calls": 1}, "max_tool_calls", "a bound on tool calls"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs in responses"),
    ({"temperature": 3}, "temperature", ""),
])
def test_bad_requests_are_refused_by_name(server, body, param, fragment):
    response = httpx.post(server.url + "/v1/responses", json={"model": "tiny", "input": "hi", **body}, timeout=60)
    assert_error(response, 400, param, fragment)


def test_the_values_those_parameters_take_are_accepted(server):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "background": False, "truncation": "disabled",
            "include": ["reasoning.encrypted_content"], "store": False, "previous_response_id": None}
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["status"] == "incomplete"


KEYS = ["type", "role", "content", "text", "call_id", "name", "arguments", "output", "summary", "id", "status"]
VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6)
                      | st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "user",
                                         "assistant", "developer", "input_text", "output_text", "reasoning_text"]),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner,
                                                                                  max_size=4), max_leaves=12)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=5), max_size=4))
def test_any_input_items_get_an_answer_or_a_400_naming_the_input(server, items):
    response = httpx.post(server.url + "/v1/responses", timeout=60,
                          json={"model": "tiny", "input": items, "max_output_tokens": 1, "temperature": 0})
    assert response.status_code in (200, 400), response.text[:300]
    if response.status_code == 400:
        assert_error(response, 400)["param"].startswith(("input", "messages"))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["tools", "tool_choice", "text", "reasoning", "instructions", "include", "metadata",
                              "truncation", "parallel_tool_calls", "max_output_tokens"]), value=VALUES)
def test_any_value_of_a_field_gets_an_answer_or_a_400(server, field, value):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 1, "temperature": 0, field: value}
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code in (200, 400), response.text[:300]


def test_an_engine_failure_is_a_500_or_ends_the_stream_with_response_failed(tiny_gguf):
    """As test_isolation's engine error: a model whose ids outrun its tokenizer's fails inside the engine. The
    whole response is a JSON 500; a stream ends with an error event and response.failed, naming no internals."""
    from deltaserve.engine.engine import Engine
    from deltaserve.engine.llm import load
    from deltaserve.server.app import create_app

    from .conftest import LiveServer

    model, _ = load(None)
    _, small_tokenizer = load(tiny_gguf)
    engine = Engine(model, small_tokenizer, n_slots=2, max_len=256, model_name="mismatch")
    live = LiveServer(create_app(engine))
    body = {"model": "mismatch", "input": "ROMEO:", "max_output_tokens": 50, "temperature": 2.0, "seed": 1,
            "ignore_eos": True}
    try:
        error = assert_error(httpx.post(live.url + "/v1/responses", json=body, timeout=60), 500, None,
                             "the engine failed")
        assert error["code"] == "engine_error"
        with httpx.stream("POST", live.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
        assert [e["type"] for e in events[:1] + events[-2:]] == ["response.created", "error", "response.failed"]
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "engine_error"
        assert "Traceback" not in json.dumps(events) and "vocabulary" not in json.dumps(events)
    finally:
        live.stop()
        engine.close()


def test_a_client_leaving_a_stream_frees_its_slot(server, engine):
    before = engine.metrics.generated_tokens_total
    with httpx.stream("POST", server.url + "/v1/responses", timeout=30,
                      json={"model": "tiny", "input": "Tell me a story", "max_output_tokens": 400, "stream": True,
                            "temperature": 0, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["type"].endswith(".delta"):
                break  # leave after the first piece of text
    assert settled(engine) and engine.runner.free_slots() == engine.runner.n_slots
    assert engine.metrics.generated_tokens_total - before < 400  # it did not run to the end

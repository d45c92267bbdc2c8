"""Reading replies: thinking into reasoning_content, tool calls of both forms into OpenAI tool_calls with
arguments typed by the tools' schemas, and anything malformed left in the content. The replies are written
by hand as the models write them; the expected messages are written by hand too. Every reply is also fed
as a stream cut at every character boundary (and a character at a time): the deltas must join to the same
message, each call's first delta carrying its index, id, type and name and the next ones only arguments."""

import json

import pytest

from deltaserve.callforms import CallForm, render_call
from deltaserve.server.chat_output import ChatOutput, OutputFormat, call_form
from deltaserve.server.toolcalls import typed_value

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "at": {"type": "object"},
                                     "hours": {"type": "array"}, "scale": {"type": ["number", "null"]}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}
TOOLS = [WEATHER, SEARCH]
XML, JSON_FORM = CallForm.XML, CallForm.JSON


def msg(content=None, reasoning=None, calls=()):
    """The expected assistant message; calls as (name, arguments dict)."""
    out = {"role": "assistant", "content": content if content is not None or calls else ""}
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return out


CASES = {
    "thinking, then an answer": (
        XML, True, "I should greet them.\n</think>\n\nHello there!", msg("Hello there!", "I should greet them.")),
    "thinking cut off by the length limit": (XML, True, "Step one.\nStep two", msg("", "Step one.\nStep two")),
    "a reply that opens its own thinking": (
        JSON_FORM, False, "<think>\nhmm\n</think>\n\nYes.", msg("Yes.", "hmm")),
    "no thinking": (JSON_FORM, False, "  Plain words <b>bold</b>\n", msg("  Plain words <b>bold</b>\n")),
    "an XML call after thinking and text, values typed by the schema": (
        XML, True,
        "Weather needed.\n</think>\n\nLet me look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "New York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
        "<parameter=at>\n{\"lat\": 40.7, \"lon\": -74}\n</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n"
        "<parameter=scale>\n1.5\n</parameter>\n</function>\n</tool_call>",
        msg("Let me look.", "Weather needed.", [("get_weather", {"city": "New York", "days": 3, "metric": True,
                                                                 "at": {"lat": 40.7, "lon": -74}, "hours": [9, 12],
                                                                 "scale": 1.5})])),
    "two XML calls, a multi-line string, an unknown parameter kept as text": (
        XML, False,
        "<tool_call>\n<function=search>\n<parameter=query>\nline one\nline two\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n007\n</parameter>\n"
        "<parameter=unit>\n42\n</parameter>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>",
        msg(None, None, [("search", {"query": "line one\nline two"}),
                         ("get_weather", {"city": "007", "unit": "42", "days": "three"})])),
    "an XML call without parameters and with an unclosed parameter": (
        XML, False,
        "<tool_call>\n<function=search>\n</function>\n</tool_call><tool_call>\n<function=get_weather>\n"
        "<parameter=days>\n2\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
        msg(None, None, [("search", {}), ("get_weather", {"days": 2, "city": "Rome"})])),
    "an XML call cut off: the parameters it completed": (
        XML, False, "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n<parameter=city>\nPa",
        msg(None, None, [("get_weather", {"days": 4})])),
    "a JSON call after thinking": (
        JSON_FORM, True,
        'Use the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
        "</tool_call>",
        msg(None, "Use the tool.", [("get_weather", {"city": "Oslo", "days": 2})])),
    "JSON calls with string arguments, text between them": (
        JSON_FORM, False,
        'Two searches.\n<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"a\\"}"}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": {"query": "b <i>"}}</tool_call>',
        msg("Two searches.", None, [("search", {"query": "a"}), ("search", {"query": "b <i>"})])),
    "a JSON call left unclosed at the end": (
        JSON_FORM, False, '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n',
        msg(None, None, [("search", {"query": "x"})])),
    "malformed XML stays content": (
        XML, False, "Try <tool_call>\nnot a call</tool_call> and <tool_call>\n<function=bad name\n>",
        msg("Try <tool_call>\nnot a call</tool_call> and <tool_call>\n<function=bad name\n>")),
    "malformed JSON stays content, a good call after it is read": (
        JSON_FORM, False,
        'A <tool_call>{"name": 3}</tool_call> B\n<tool_call>{"name": "search", "arguments": {}}</tool_call> C',
        msg('A <tool_call>{"name": 3}</tool_call> B C', None, [("search", {})])),
    "an unfinished marker at the end is content": (XML, False, "Almost <tool_ca", msg("Almost <tool_ca")),
}


def fed(fmt: OutputFormat, pieces: list[str]) -> tuple[list[dict], dict]:
    out = ChatOutput(fmt)
    deltas = [d for piece in pieces for d in out.feed(piece)] + out.finish()
    return deltas, out.message()


def without_ids(message: dict) -> dict:
    message = json.loads(json.dumps(message))
    for call in message.get("tool_calls", []):
        assert call.pop("id").startswith("call_")
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return message


def joined(deltas: list[dict]) -> dict:
    """The message a client assembles from the stream's deltas (checking each call's first delta)."""
    text = {"content": "", "reasoning_content": ""}
    calls: list[dict] = []
    for delta in deltas:
        for key in text:
            text[key] += delta.get(key, "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):
                assert set(call) == {"index", "id", "type", "function"} and call["function"]["arguments"] == ""
                calls.append({"id": call["id"], "type": call["type"], "function": dict(call["function"])})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    message = {"role": "assistant", "content": text["content"] or (None if calls else "")}
    if text["reasoning_content"]:
        message["reasoning_content"] = text["reasoning_content"]
    if calls:
        message["tool_calls"] = calls
    return message


@pytest.mark.parametrize("form, opened, text, expected", CASES.values(), ids=CASES.keys())
def test_replies_parse_whole_and_at_every_cut(form, opened, text, expected):
    fmt = OutputFormat(form=form, tools=TOOLS, thinking=True, opened=opened)
    deltas, whole = fed(fmt, [text])
    assert without_ids(whole) == expected
    assert joined(deltas) == whole
    for cut in range(1, len(text)):
        deltas, message = fed(fmt, [text[:cut], text[cut:]])
        assert without_ids(message) == expected, cut
        assert without_ids(joined(deltas)) == expected, cut
    deltas, message = fed(fmt, list(text))
    assert without_ids(joined(deltas)) == expected == without_ids(message)


def test_arguments_stream_one_parameter_at_a_time():
    fmt = OutputFormat(form=XML, tools=TOOLS)
    text = render_call(XML, "get_weather", {"city": "Paris", "days": 3})
    deltas, message = fed(fmt, [text[:text.index("</parameter>") + 12], text[text.index("</parameter>") + 12:]])
    assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas] == ["", '{"city": "Paris"', ', "days": 3', "}"]
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 3}


@pytest.mark.parametrize("form", [XML, JSON_FORM])
def test_the_shared_call_forms_read_back(form):
    arguments = {"city": "Zürich", "days": 10, "metric": False, "at": {"x": [1, 2]}, "hours": [], "scale": None}
    message = fed(OutputFormat(form=form, tools=TOOLS), [render_call(form, "get_weather", arguments)])[1]
    assert without_ids(message) == msg(None, None, [("get_weather", arguments)])


def test_without_tools_calls_are_content():
    text = render_call(XML, "search", {"query": "q"})
    assert fed(OutputFormat(form=None, tools=None), [text])[1] == msg(text)


@pytest.mark.parametrize("text, schema, expected", [
    ("12", {"type": "integer"}, 12), (" -7 ", {"type": "integer"}, -7), ("1.0", {"type": "integer"}, "1.0"),
    ("2.5e3", {"type": "number"}, 2500.0), ("nan", {"type": "number"}, "nan"), ("4", {"type": "number"}, 4),
    ("FALSE", {"type": "boolean"}, False), ("yes", {"type": "boolean"}, "yes"),
    ("null", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, None),
    ("[1, \"a\"]", {"type": "array"}, [1, "a"]), ("{\"a\": 1}", {"type": "array"}, "{\"a\": 1}"),
    ("{bad", {"type": "object"}, "{bad"), (" keep spaces ", {"type": "string"}, " keep spaces "),
    ("5", None, "5"), ("5", {"enum": ["5"]}, "5"), ("5", {"enum": [5, "auto"]}, 5),
    ("\"auto\"", {"enum": [5, "auto"]}, "auto"),
    ("true", {"anyOf": [{"const": True}, {"enum": ["a"]}]}, True), ("1", {"enum": [True, 2]}, "1"),
    ("a", {"anyOf": [{"enum": ["a"]}, {"enum": [1]}]}, "a"),
])
def test_parameter_values_are_typed_by_the_schema(text, schema, expected):
    value = typed_value(text, schema)
    assert value == expected and type(value) is type(expected)


def test_the_parser_is_chosen_from_the_template_or_the_option():
    from deltaserve.convert.templates import QWEN3_JSON, QWEN35
    from deltaserve.tokenizer import CHATML_TEMPLATE

    assert call_form("auto", QWEN35) is XML and call_form("auto", QWEN3_JSON) is JSON_FORM
    assert call_form("auto", CHATML_TEMPLATE) is None and call_form("auto", None) is None
    assert call_form("hermes", QWEN35) is JSON_FORM and call_form("none", QWEN35) is None


PIECES = ["<tool_call>", "</tool_call>", "<function=get_weather>", "<function=", "</function>", "<parameter=days>",
          "<parameter=", "</parameter>", "<think>", "</think>", "\n", " ", "x", "{", "}", '"name": "search"', ":",
          '"arguments": {}', "3", "<", ">", "é"]


@pytest.mark.parametrize("form", [XML, JSON_FORM])
def test_any_text_parses_without_error_the_same_whole_or_cut(form):
    """Random jumbles of the markers: never an exception, every call's arguments a JSON object, and the same
    message whole, cut anywhere, or a character at a time."""
    import random

    rng = random.Random(1234)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 25)))
        fmt = OutputFormat(form=form, tools=TOOLS, thinking=True, opened=rng.random() < 0.5)
        whole = fed(fmt, [text])[1]
        for call in whole.get("tool_calls", []):
            assert isinstance(json.loads(call["function"]["arguments"]), dict), text
        expected = without_ids(whole)
        cut = rng.randint(1, max(1, len(text) - 1))
        for pieces in ([text[:cut], text[cut:]], list(text)):
            deltas, message = fed(fmt, pieces)
            assert without_ids(message) == expected == without_ids(joined(deltas)), (text, pieces)


def test_xml_values_are_typed_through_refs():
    """A tool's schema as pydantic writes it: the parameters object and its properties behind $refs."""
    booking = {"type": "function", "function": {"name": "book", "parameters": {"$ref": "#/$defs/Booking", "$defs": {
        "Booking": {"type": "object", "properties": {"nights": {"$ref": "#/$defs/Nights"},
                                                     "guest": {"$ref": "#/$defs/Guest"},
                                                     "note": {"anyOf": [{"$ref": "#/$defs/Nights"}, {"type": "null"}]},
                                                     "name": {"type": "string"}}},
        "Nights": {"type": "integer"}, "Guest": {"type": "object"}}}}}
    arguments = {"nights": 3, "guest": {"name": "Ann"}, "note": None, "name": "7"}
    message = fed(OutputFormat(form=XML, tools=[booking]), [render_call(XML, "book", arguments)])[1]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == arguments

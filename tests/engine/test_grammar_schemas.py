"""What the grammars hold strings to, checked against independent references: jsonschema's format checkers
(rfc3339-validator, fqdn, rfc3986-validator, isoduration, ipaddress, uuid) and Python's `re` for patterns,
on strings drawn at random from the grammars themselves (a walk over a byte-level vocabulary, each step
a byte the grammar allows), and on hand-written values each way. Also $ref resolution and the refusals."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import llguidance
import pytest
from llguidance import LLMatcher

from deltaserve.callforms import CallForm, json_call, xml_call
from deltaserve.engine.grammar import Tool, json_grammar, tool_call_grammar
from deltaserve.engine.patterns import avoiding
from deltaserve.engine.schema import MAX_REF_DEPTH, SchemaError
from deltaserve.engine.xmlcall import TAGS

CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
FORMATS = ("date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri")
pytestmark = pytest.mark.skipif(not {"date-time", "hostname", "uri", "duration"} <= set(CHECKER.checkers),
                                reason="jsonschema's format checkers need jsonschema[format-nongpl]")


class _Bytes:
    """A vocabulary of the 256 bytes and an end token."""

    def __init__(self):
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff<end>"]
        self.special_token_ids, self.eos_token_id, self.bos_token_id = [256], 256, None

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
END = 256


def accepts(grammar: str, text: str) -> bool:
    m = LLMatcher(BYTES, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    ids = list(text.encode())
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def walk(grammar: str, rng: random.Random, limit: int = 300) -> str | None:
    """A text the grammar takes, one allowed byte at a time (the end taken with odds 1 in 4 when allowed);
    None if it ran past `limit` bytes."""
    m = LLMatcher(BYTES, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    out = bytearray()
    while len(out) < limit:
        mask = m.compute_bitmask()
        allowed = [t for t in range(257) if mask[t // 8] >> (t % 8) & 1]
        if END in allowed and (len(allowed) == 1 or rng.random() < 0.25):
            return out.decode()
        token = rng.choice([t for t in allowed if t != END])
        assert m.consume_token(token)
        out.append(token)
        if m.is_stopped():
            return out.decode()
    return None


def samples(grammar: str, n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    found = [s for s in (walk(grammar, rng) for _ in range(n)) if s is not None]
    assert len(found) >= n // 2  # the walks end
    return found


def raw_values(schema: dict, n: int, seed: int = 0) -> list[str]:
    """Raw values of a string parameter with `schema` that the XML form's grammar lets a model write."""
    grammar = tool_call_grammar([Tool("t", {"type": "object", "properties": {"v": schema}, "required": ["v"]})],
                                CallForm.XML, parallel=False)
    head, tail = "<tool_call>\n<function=t>\n<parameter=v>\n", "\n</parameter>\n</function>\n</tool_call>"
    out = []
    for text in samples(grammar, n, seed):
        assert text.startswith(head) and text.endswith(tail), text
        out.append(text[len(head):-len(tail)])
    return out


# ---------------------------------------------------------------- formats

@pytest.mark.parametrize("fmt", FORMATS)
def test_every_string_of_a_format_validates_in_both_forms(fmt):
    schema = {"type": "string", "format": fmt, "maxLength": 60}
    raw = raw_values(schema, 60)
    json_strings = [json.loads(s) for s in samples(json_grammar(schema), 60, seed=1)]
    for value in raw + json_strings:
        jsonschema.validate(value, schema, format_checker=CHECKER)
    assert len(set(raw)) > 20  # the walks explore the format, not one corner of it


VALID = {"date-time": ["2024-02-29T23:59:59.5+05:30", "1999-12-31t00:00:00z"],
         "date": ["2000-02-29", "0001-01-01", "2023-11-30"], "time": ["00:00:00Z", "12:34:56.789-08:00"],
         "duration": ["P1Y2M3DT4H5M6S", "PT0S", "P3W", "P1M"], "email": ["a.b+c@example.com", "x@[192.0.2.1]"],
         "hostname": ["a", "example.com", "a-1.b2"], "ipv4": ["0.0.0.0", "255.255.255.255"],
         "ipv6": ["::", "::1", "1:2:3:4:5:6:7:8", "fe80::1:2", "::ffff:192.0.2.1", "1::"],
         "uuid": ["123e4567-e89b-12d3-a456-426614174000"],
         "uri": ["https://example.com/a/b?c=d#e", "urn:isbn:0451450523", "http://[::1]:8080/", "a:"]}
INVALID = {"date-time": ["2023-02-29T00:00:00Z", "2024-01-01 00:00:00Z", "2024-01-01T24:00:00Z"],
           "date": ["2023-02-29", "1900-02-29", "0000-01-01", "2024-04-31", "2024-1-01"],
           "time": ["12:00:00", "23:60:00Z"], "duration": ["P", "PT", "P1D1Y", "P1Y1W"],
           "email": ["a@", "@b", "a b@c"], "hostname": ["-a", "a..b", "a_b", "a" * 64],
           "ipv4": ["01.2.3.4", "256.0.0.0", "1.2.3"], "ipv6": ["1:::2", "1:2:3:4:5:6:7:8:9", "g::"],
           "uuid": ["123e4567e89b12d3a456426614174000"], "uri": ["1a:b", "a:%zz", "http://a b"]}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_format_takes_valid_values_and_refuses_invalid_ones(fmt):
    tool = Tool("t", {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"]})
    xml, hermes = tool_call_grammar([tool], CallForm.XML, False), tool_call_grammar([tool], CallForm.JSON, False)
    for value in VALID[fmt] + INVALID[fmt]:
        valid = value in VALID[fmt]
        # the reference agrees on the valid ones (some of its checkers are laxer: for email, any '@' will do)
        assert CHECKER.conforms(value, fmt) or not valid, value
        assert accepts(xml, xml_call("t", {"v": value})) == valid, value
        assert accepts(hermes, json_call("t", {"v": value})) == valid, value


# ---------------------------------------------------------------- patterns and lengths

PATTERNS = ["^[A-Z]{2}-\\d{3}$", "ab", "^x|y$", "^[^\\d]+$", "\\w+@\\w+", "^\\S{1,4}$", "(a|b)+c", "^a/b",
            "^[\\w.-]{2,}\\.[a-z]{2,3}$", "^[^\\s\\W]+$", "^\\D\\S$", "^(?:[0-9]{1,3}\\.){3}[0-9]{1,3}$"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_raw_strings_match_their_pattern_as_python_searches_it(pattern):
    schema = {"type": "string", "pattern": pattern, "minLength": 2, "maxLength": 12}
    for value in raw_values(schema, 40):
        assert re.search(pattern, value) and 2 <= len(value) <= 12, value
        assert not any(tag in value for tag in TAGS)


def test_a_pattern_found_anywhere_unless_anchored():
    tool = Tool("t", {"type": "object", "properties": {"v": {"type": "string", "pattern": "b+c"},
                                                       "w": {"type": "string", "pattern": "^b+c$"}}})
    g = tool_call_grammar([tool], CallForm.XML, False)
    assert accepts(g, xml_call("t", {"v": "a bbc d"})) and not accepts(g, xml_call("t", {"v": "a bd"}))
    assert accepts(g, xml_call("t", {"w": "bbc"})) and not accepts(g, xml_call("t", {"w": "abbc"}))


@pytest.mark.parametrize("pattern, why", [("^(?=a)b", "look-around"), ("(a)\\1", "back-reference"),
                                          ("\\bword", "word boundary"), ("a^b", "anchor"), ("(a", "parenthes"),
                                          ("[a-", "class")])
def test_a_pattern_that_cannot_be_matched_is_refused_naming_tool_and_parameter(pattern, why):
    tool = Tool("lookup", {"type": "object", "properties": {"key": {"type": "string", "pattern": pattern}}})
    with pytest.raises(SchemaError, match=f"tool 'lookup', parameter 'key': pattern .*{why}"):
        tool_call_grammar([tool], CallForm.XML)


def test_an_unknown_format_is_refused_naming_tool_and_parameter():
    tool = Tool("t", {"type": "object", "properties": {"when": {"type": "string", "format": "iso-week"}}})
    with pytest.raises(SchemaError, match="tool 't', parameter 'when': format 'iso-week'"):
        tool_call_grammar([tool], CallForm.XML)


def test_no_value_can_hold_a_tag_of_the_form():
    nested = {"type": "object", "properties": {"s": {"type": "string"}, "any": {}}}
    tool = Tool("t", {"type": "object", "properties": {"raw": {"type": "string"}, "obj": nested}})
    g = tool_call_grammar([tool], CallForm.XML, False)
    assert accepts(g, xml_call("t", {"raw": "a <b> </p> <param", "obj": {"s": "</par", "any": "<function"}}))
    for tag in TAGS:
        assert not accepts(g, xml_call("t", {"raw": f"x{tag}y"})), tag
        assert not accepts(g, xml_call("t", {"obj": {"s": f"x{tag}"}})), tag
        assert not accepts(g, xml_call("t", {"obj": {"any": tag}})), tag


def test_the_words_avoided_match_a_substring_search():
    regex = re.compile(avoiding(TAGS))
    rng = random.Random(0)
    for _ in range(20000):
        text = "".join(rng.choice("<</parmetfunciol_>= x\n") for _ in range(rng.randint(0, 16)))
        if rng.random() < 0.4:  # a whole or nearly whole tag somewhere
            tag, at = rng.choice(TAGS), rng.randint(0, len(text))
            text = text[:at] + tag[:rng.randint(len(tag) - 2, len(tag))] + text[at:]
        assert bool(regex.fullmatch(text)) == (not any(tag in text for tag in TAGS)), text


# ---------------------------------------------------------------- unions

def test_a_union_takes_raw_strings_and_json_of_its_other_members():
    union = {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "integer"}, {"type": "null"}]}
    g = tool_call_grammar([Tool("t", {"type": "object", "properties": {"v": union}})], CallForm.XML, False)
    for value in ("abc", 12, None, "12x", "nonex"):
        assert accepts(g, xml_call("t", {"v": value})), value
    for raw in (" 7 ", "None", "NULL", "12\nx", "toolong"):  # raw text the parser would read otherwise
        assert not accepts(g, xml_call("t", {"v": raw})), raw


# ---------------------------------------------------------------- $ref

BOOKING = {"$ref": "#/$defs/Booking", "$defs": {
    "Booking": {"type": "object", "properties": {"guest": {"$ref": "#/$defs/Guest"},
                                                 "day": {"$ref": "#/$defs/Day"},
                                                 "room": {"$ref": "#/$defs/Room"}},
                "required": ["guest", "day"]},
    "Guest": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]},
    "Day": {"type": "string", "format": "date"},
    "Room": {"enum": ["single", "double"]}}}


@pytest.mark.parametrize("form", list(CallForm))
def test_parameters_reached_through_refs(form):
    g = tool_call_grammar([Tool("book", BOOKING)], form, False)
    write = xml_call if form is CallForm.XML else json_call
    assert accepts(g, write("book", {"guest": {"name": "Ann"}, "day": "2024-02-29", "room": "double"}))
    assert not accepts(g, write("book", {"guest": {"name": "Ann"}, "day": "2023-02-29"}))
    assert not accepts(g, write("book", {"guest": {}, "day": "2024-02-29"}))
    assert not accepts(g, write("book", {"guest": {"name": "Ann"}, "day": "2024-02-29", "room": "suite"}))


def test_a_recursive_schema_inside_a_json_value():
    tree = {"type": "object", "properties": {"root": {"$ref": "#/definitions/Node"}}, "definitions": {
        "Node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                  "kids": {"type": "array", "items": {"$ref": "#/definitions/Node"}}},
                 "required": ["v"]}}}
    for form in CallForm:
        g = tool_call_grammar([Tool("t", tree)], form, False)
        write = xml_call if form is CallForm.XML else json_call
        assert accepts(g, write("t", {"root": {"v": 1, "kids": [{"v": 2, "kids": []}]}}))
        assert not accepts(g, write("t", {"root": {"v": 1, "kids": [{"kids": []}]}}))


@pytest.mark.parametrize("parameters, why", [
    ({"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}}, "cycle"),
    ({"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"$ref": "#/$defs/P"}}}, "cycle"),
    ({"$ref": "#/$defs/nowhere"}, "names nothing"),
    ({"$ref": "other.json#/A"}, "not a reference inside"),
    ({"$ref": "#/$defs/d0", "$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(MAX_REF_DEPTH + 1)}},
     "in a row"),
])
def test_refs_that_cannot_be_followed_are_refused(parameters, why):
    with pytest.raises(SchemaError, match=why):
        tool_call_grammar([Tool("t", parameters)], CallForm.XML)


def test_a_parameters_object_the_form_cannot_hold_is_refused():
    for parameters, why in [({"type": "object", "anyOf": [{}]}, "anyOf"), ({"type": "array"}, "object schema"),
                            ({"type": "object", "required": ["x"]}, "do not declare")]:
        with pytest.raises(SchemaError, match=why):
            tool_call_grammar([Tool("t", parameters)], CallForm.XML)

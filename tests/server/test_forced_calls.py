"""Forced tool calls from random-weight models of every family, in both call forms, with schemas that use
pattern, format, minLength, enum, nested objects, arrays, unions and $ref (one written by pydantic): every
output is read back by the server's own tool-call parser and validates against the tool's schema under
jsonschema's format checkers (rfc3339-validator, fqdn, rfc3986-validator, ...), 100% of them; and the same
schemas as response_format's JSON."""

from __future__ import annotations

import datetime
import enum
import itertools
import json
import uuid

import jsonschema
import pytest
from pydantic import BaseModel, Field

from deltaserve.callforms import CallForm
from deltaserve.engine.grammar import Tool, json_grammar, tool_call_grammar
from deltaserve.engine.llm import LLM
from deltaserve.server.reasoning import CONTENT
from deltaserve.server.toolcalls import ARGUMENTS, CALL, ToolCallParser

from ..conftest import ARCHES

CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
pytestmark = pytest.mark.skipif(not {"date-time", "hostname", "uri", "duration"} <= set(CHECKER.checkers),
                                reason="jsonschema's format checkers need jsonschema[format-nongpl]")

EVENT = {"type": "object", "properties": {
    "title": {"type": "string", "minLength": 2, "maxLength": 8},
    "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
    "start": {"type": "string", "format": "date-time", "maxLength": 30},
    "day": {"type": "string", "format": "date"},
    "at": {"type": "string", "format": "time", "maxLength": 16},
    "id": {"type": "string", "format": "uuid"},
    "host": {"type": "string", "format": "ipv4"},
    "level": {"enum": ["low", "mid", "high"]},
    "priority": {"enum": [1, 2, "urgent"]},
    "note": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]}},
    "required": ["title", "code", "start", "day", "id", "level"]}
CONTACT = {"type": "object", "properties": {
    "email": {"type": "string", "format": "email", "maxLength": 20},
    "site": {"type": "string", "format": "uri", "maxLength": 20},
    "server": {"type": "string", "format": "hostname", "maxLength": 16},
    "v6": {"type": "string", "format": "ipv6", "maxLength": 16},
    "wait": {"type": "string", "format": "duration", "maxLength": 10},
    "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}},
    "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^\\d{5}$"},
                                                 "city": {"type": "string", "minLength": 1, "maxLength": 8}},
                "required": ["zip", "city"]}},
    "required": ["email", "tags", "address"]}


class Room(str, enum.Enum):
    single = "single"
    double = "double"


class Guest(BaseModel):
    name: str = Field(min_length=1, max_length=6)
    code: str = Field(pattern="^[A-Z]{2}[0-9]$")


class Booking(BaseModel):
    guest: Guest
    day: datetime.date
    room: Room
    nights: int = Field(ge=1, le=9)
    ref: uuid.UUID
    note: str | None = Field(default=None, max_length=5)


def _booking() -> dict:
    """Booking's schema as pydantic writes it, with the parameters object itself behind a $ref too."""
    schema = Booking.model_json_schema()
    defs = schema.pop("$defs")
    return {"$ref": "#/$defs/Booking", "$defs": {**defs, "Booking": schema}}


TOOLS = {"add_event": EVENT, "add_contact": CONTACT, "book": _booking()}


@pytest.mark.parametrize("arch", ARCHES)
def test_every_forced_call_of_a_random_model_validates(arch, model_path):
    llm = LLM(model_path(arch), max_len=1024)
    tok = llm.tokenizer
    openai_tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS.items()]
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Book it."}], enable_thinking=False))
    seeds = itertools.count()
    for form, (name, parameters) in itertools.product(CallForm, TOOLS.items()):
        grammar = tool_call_grammar([Tool(name, parameters)], form, parallel=False)
        out = llm.generate(prompt, max_tokens=600, temperature=1.0, seed=next(seeds), grammar=grammar)
        assert out.finish_reason == "stop", (arch, form, name, out.text)
        parser = ToolCallParser(form, openai_tools, new_id=lambda: "call_0")
        events = parser.feed(out.text) + parser.finish()
        assert not [e for e in events if e[0] == CONTENT], out.text  # the whole reply is the call
        assert [e[3] for e in events if e[0] == CALL] == [name], out.text
        arguments = json.loads("".join(e[2] for e in events if e[0] == ARGUMENTS))
        jsonschema.validate(arguments, parameters, format_checker=CHECKER)
    # response_format json_schema: the same schemas, as JSON
    for name, schema in TOOLS.items():
        out = llm.generate(prompt, max_tokens=600, temperature=1.0, seed=next(seeds), grammar=json_grammar(schema))
        assert out.finish_reason == "stop", (arch, name, out.text)
        jsonschema.validate(json.loads(out.text), schema, format_checker=CHECKER)

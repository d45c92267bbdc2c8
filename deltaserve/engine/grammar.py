"""Grammars for structured output, as llguidance grammars (Lark with inline JSON schemas): a JSON value of a
schema (`response_format`), or calls of given tools in the call form of the model's chat template
(`tool_choice` "required" or a named function).

- JSON is written on one line with Python's json.dumps separators (", " and ": ") and no other whitespace:
  that is how the templates render JSON (`tojson`), and a model free to add whitespace can add it for ever
  (a random-weight one does).
- XML calls (<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n...</function>\\n</tool_call>):
  the parameters in the order of the schema's `properties`, the required ones always, the others optionally,
  no undeclared ones. A value of a string parameter is raw text (bounded by minLength / maxLength, or one of
  its enum / const values; `pattern` and `format` are not enforced in raw text); any other value is JSON of
  its schema.
- JSON calls (<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>): the arguments are JSON of the
  tool's parameter schema.
- Objects are closed: where a schema lists `properties` and says nothing of `additionalProperties`, no
  other key is written (as xgrammar's strict mode does). The output still validates against the schema
  as given, and a model cannot wander off into keys nobody asked for.
- Several calls (parallel_tool_calls) are separated by a newline, as the templates render them.

Thinking: when the prompt leaves the model inside a <think> block (Qwen3.5's generation prompt opens one),
the grammar lets it think freely until it writes </think>, then takes the template's "\\n\\n" and the
constrained answer. The answer is therefore what follows the thinking, as the reasoning parser splits it;
a reply cut off by max_tokens while thinking holds no answer (ask with enable_thinking false for the
answer alone).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from llguidance import LLMatcher

from deltaserve.callforms import (CALL_CLOSE, CALL_OPEN, FUNCTION_CLOSE, FUNCTION_OPEN, PARAMETER_CLOSE,
                                  PARAMETER_OPEN, THINK_CLOSE, CallForm)

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}  # response_format json_object


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name and the JSON schema of its arguments (an object)."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: dict(ANY_OBJECT))


def json_grammar(schema: dict[str, Any] | None = None, thinking: bool = False) -> str:
    """A JSON value of `schema` (None: any JSON object)."""
    return _compile(["answer: " + _json(ANY_OBJECT if schema is None else schema)], thinking)


def tool_call_grammar(tools: list[Tool], form: CallForm, parallel: bool = True, thinking: bool = False) -> str:
    """One call (or, parallel, one or more) of one of `tools`, written in `form`."""
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    more = ' ("\\n" call)*' if parallel else ""
    rules = ["answer: call" + more, "call: " + " | ".join(f"call{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        rules += _xml_call(i, tool) if form is CallForm.XML else _json_call(i, tool)
    return _compile(rules, thinking)


def _compile(rules: list[str], thinking: bool) -> str:
    start = f"start: think {_lit(chr(10) * 2)} answer" if thinking else "start: answer"
    # lazy: the thinking ends at the first </think>
    think = [f"think[lazy]: /(?s:.*){_regex(THINK_CLOSE)}/"] if thinking else []
    return LLMatcher.grammar_from_lark("\n".join([start, *think, *rules]) + "\n")


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**closed(schema), "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


_SUBSCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` wherever it lists properties and leaves that open."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = closed(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _lit(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def _regex(text: str) -> str:
    """`text` as a literal inside /.../ (Rust regex syntax)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in r"\.+*?()|[]{}^$#&-~/" else c for c in text)


def _json_call(i: int, tool: Tool) -> list[str]:
    call = {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}
    return [f"call{i}: {_lit(CALL_OPEN + chr(10))} body{i} {_lit(chr(10) + CALL_CLOSE)}", f"body{i}: {_json(call)}"]


def _xml_call(i: int, tool: Tool) -> list[str]:
    properties = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or ())
    head = _lit(f"{CALL_OPEN}\n{FUNCTION_OPEN}{tool.name}>\n")
    parts, rules = [head], []
    for j, (key, schema) in enumerate(properties.items()):
        p = f"p{i}_{j}"
        parts.append(p if key in required else p + "?")
        rules.append(f"{p}: {_lit(f'{PARAMETER_OPEN}{key}>' + chr(10))} v{p}")
        rules.append(_xml_value(f"v{p}", schema if isinstance(schema, dict) else {}))
    parts.append(_lit(f"{FUNCTION_CLOSE}\n{CALL_CLOSE}"))
    return [f"call{i}: " + " ".join(parts), *rules]


def _xml_value(rule: str, schema: dict[str, Any]) -> str:
    """The value of one XML parameter, with the "\\n</parameter>\\n" that ends it."""
    end = _lit(f"\n{PARAMETER_CLOSE}\n")
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if schema.get("type") == "string" or (choices and all(isinstance(c, str) for c in choices)):
        if choices:
            return f"{rule}: ({' | '.join(_lit(c) for c in choices)}) {end}"
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        length = f"{{{int(low)},{'' if high is None else int(high)}}}"
        # lazy: raw text up to the first line that closes the parameter
        return f"{rule}[lazy]: /(?s:.){length}{_regex(chr(10) + PARAMETER_CLOSE + chr(10))}/"
    return f"{rule}: {rule}_json {end}\n{rule}_json: {_json(schema)}"

"""Grammars for structured output, as llguidance grammars (Lark with inline JSON schemas): a JSON value of a
schema (`response_format`), or calls of given tools in the call form of the model's chat template
(`tool_choice` "required" or a named function).

- JSON is written on one line with Python's json.dumps separators (engine.lark), its schema prepared by
  engine.schema: objects closed where the schema leaves them open, string formats as our own patterns.
- XML calls (<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n...</function>\\n</tool_call>):
  engine.xmlcall (raw string values held to the schema's pattern, format and lengths).
- JSON calls (<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>): the arguments are JSON of the
  tool's parameter schema, whose $refs still resolve inside the call's schema.
- Several calls (parallel_tool_calls) are separated by a newline, as the templates render them.

A schema that cannot be followed is a SchemaError (engine.schema) naming the tool and the parameter.

Thinking: when the prompt leaves the model inside a <think> block (Qwen3.5's generation prompt opens one),
the grammar lets it think freely until it writes </think>, then takes the template's "\\n\\n" and the
constrained answer. The answer is therefore what follows the thinking, as the reasoning parser splits it;
a reply cut off by max_tokens while thinking holds no answer (ask with enable_thinking false for the
answer alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llguidance import LLMatcher

from deltaserve.callforms import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, CallForm

from .lark import json_value, literal, regex_literal
from .schema import closed, embedded, prepared, ref_to
from .xmlcall import xml_call_rules

__all__ = ["ANY_OBJECT", "Tool", "closed", "json_grammar", "tool_call_grammar"]

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
        rules += xml_call_rules(i, tool) if form is CallForm.XML else _json_call(i, tool)
    return _compile(rules, thinking)


def _compile(rules: list[str], thinking: bool) -> str:
    start = f"start: think {literal(chr(10) * 2)} answer" if thinking else "start: answer"
    # lazy: the thinking ends at the first </think>
    think = [f"think[lazy]: /(?s:.*){regex_literal(THINK_CLOSE)}/"] if thinking else []
    return LLMatcher.grammar_from_lark("\n".join([start, *think, *rules]) + "\n")


def _json(schema: dict[str, Any]) -> str:
    return json_value(prepared(schema))


def _json_call(i: int, tool: Tool) -> list[str]:
    call = {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": ref_to("")},
            "required": ["name", "arguments"], "additionalProperties": False}
    return [f"call{i}: {literal(CALL_OPEN + chr(10))} body{i} {literal(chr(10) + CALL_CLOSE)}",
            f"body{i}: {json_value(embedded(tool.parameters, call))}"]

"""The two forms in which Qwen models write tool calls, and their thinking markers: the one definition that the
preset templates (convert.templates), the output parsers (server.toolcalls) and constrained decoding share.

- XML (vLLM's `qwen3_coder` parser; Qwen3.5, Qwen3-Coder):
  <tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>
  where a value is raw text (a string as it is, anything else as JSON).
- JSON (vLLM's `hermes` parser; Qwen3, Qwen3-Next):
  <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"  # XML: <function=NAME>
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"  # XML: <parameter=NAME>


class CallForm(str, Enum):
    """A tool-call form, named as vLLM's `--tool-call-parser` names its parser."""

    XML = "qwen3_coder"
    JSON = "hermes"


def form_of_template(template: str | None) -> CallForm | None:
    """The form a chat template teaches its model (None: it renders no tool calls): a template that writes
    `<function=` writes XML calls, one that only writes <tool_call> writes JSON ones."""
    if not template or CALL_OPEN not in template:
        return None
    return CallForm.XML if FUNCTION_OPEN in template else CallForm.JSON


def parameter_text(value: Any) -> str:
    """An argument as the XML form writes it: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def xml_call(name: str, arguments: dict[str, Any]) -> str:
    params = "".join(f"{PARAMETER_OPEN}{key}>\n{parameter_text(value)}\n{PARAMETER_CLOSE}\n"
                     for key, value in arguments.items())
    return f"{CALL_OPEN}\n{FUNCTION_OPEN}{name}>\n{params}{FUNCTION_CLOSE}\n{CALL_CLOSE}"


def json_call(name: str, arguments: dict[str, Any]) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def render_call(form: CallForm, name: str, arguments: dict[str, Any]) -> str:
    """One call as a model of that form writes it (what the parsers read back)."""
    return xml_call(name, arguments) if form is CallForm.XML else json_call(name, arguments)

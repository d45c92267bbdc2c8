"""Structured output of a chat request: `response_format` (json_object, json_schema) and a forced
`tool_choice` ("required", or {"type": "function", "function": {"name": ...}}) become the grammar its
output follows (engine.grammar). "text", "none" and "auto" need none.

Every schema is checked against JSON Schema's meta-schema and compiled for this model's vocabulary before
the request is queued, so a bad one is a 400 naming the parameter, never a failure in the engine.
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema

from deltaserve.callforms import THINK_CLOSE, THINK_OPEN, CallForm, form_of_template
from deltaserve.engine.constrain import grammar_error
from deltaserve.engine.grammar import Tool, json_grammar, tool_call_grammar
from deltaserve.engine.schema import SchemaError
from deltaserve.tokenizer import Tokenizer

from .errors import APIError

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for schema and function names
_FORMATS = ("text", "json_object", "json_schema")


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt leaves the model inside a <think> block."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def chat_grammar(body, tokenizer: Tokenizer, prompt_ids: list[int], n_vocab: int) -> str | None:
    """The grammar a chat request's output must follow (None: free text). Raises APIError(400) naming
    response_format, tools or tool_choice. Compiles the grammar: call it off the event loop."""
    tools = _tools(body.tools)
    forced = _forced_tools(body.tool_choice, tools)
    schema = _response_schema(body.response_format)
    if forced is not None and schema is not None:
        raise APIError(400, "tool_choice forces a tool call, which response_format cannot also shape; "
                            "give one of them", "tool_choice")
    if forced is None and schema is None:
        return None
    thinking = opens_thinking(tokenizer.decode(prompt_ids))
    if forced is not None:
        form = form_of_template(tokenizer.chat_template) or CallForm.JSON
        try:
            grammar = tool_call_grammar(forced, form, parallel=body.parallel_tool_calls is not False,
                                        thinking=thinking)
        except SchemaError as e:
            raise APIError(400, f"tools: the schema cannot be used for constrained decoding: {e}", "tools") from None
        param = "tools"
    else:
        grammar, param = json_grammar(schema or None, thinking), "response_format"
    error = grammar_error(grammar, tokenizer, n_vocab)
    if error:
        raise APIError(400, f"{param}: the schema cannot be used for constrained decoding: {error}", param)
    return grammar


def _response_schema(fmt: Any) -> dict | None:
    """None: free text; {}: any JSON object; else the schema."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in _FORMATS:
        raise APIError(400, f"response_format must be an object whose type is one of {', '.join(_FORMATS)}",
                       "response_format")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not _NAME.fullmatch(spec["name"]):
        raise APIError(400, "response_format.json_schema must be an object with a name of 1 to 64 letters, "
                            "digits, '_' or '-'", "response_format")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise APIError(400, "response_format.json_schema.strict must be a boolean", "response_format")
    return _checked_schema(spec.get("schema", {"type": "object"}), "response_format",
                           "response_format.json_schema.schema") or {"type": "object"}


def _tools(tools: Any) -> list[Tool]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of functions", "tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.fullmatch(fn["name"]):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                                f"with a name of 1 to 64 letters, digits, '_' or '-'", "tools")
        parameters = _checked_schema(fn.get("parameters", {"type": "object"}), "tools", f"tools[{i}].function.parameters")
        out.append(Tool(fn["name"], parameters or {"type": "object"}))
    return out


def _forced_tools(choice: Any, tools: list[Tool]) -> list[Tool] | None:
    """The tools one of which the output must call (None: the output is free)."""
    if choice is None or choice in ("none", "auto"):
        return None
    if choice == "required":
        if not tools:
            raise APIError(400, "tool_choice 'required' needs tools", "tool_choice")
        return tools
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", "tool_choice")
    named = [t for t in tools if t.name == name]
    if not named:
        raise APIError(400, f"tool_choice names the function '{name[:64]}', which is not in tools", "tool_choice")
    return named[:1]


def _checked_schema(schema: Any, param: str, where: str) -> dict:
    if not isinstance(schema, dict):
        raise APIError(400, f"{where} must be a JSON schema (an object)", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise APIError(400, f"{where} is not a valid JSON schema: {e.message[:300]}", param) from None
    return schema

"""What a chat request hands the chat template, checked: its messages (assistant tool calls with their
arguments as objects, tool results, earlier reasoning), its `tools`, `chat_template_kwargs`, and whether
the prompt asks for a new turn or continues the final assistant message.

A tool call's arguments travel as JSON text in the OpenAI API; templates iterate them as a mapping (Qwen3.5's
writes one <parameter=...> per key), so they are decoded here, as vLLM does. The tools reach the template
as the client wrote them (a template renders them with tojson: its model reads them as sent)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import APIError
from .schemas import ChatBody

MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # OpenAI's rule, with the '.' and ':' of MCP tool names
# variables the server sets: a request's chat_template_kwargs may not replace them
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token"})
TOOL_CHOICES = ("none", "auto", "required")
# OpenAI's reasoning_effort: these models think or do not, so "none" and "minimal" switch thinking off
# (enable_thinking: false, unless chat_template_kwargs says otherwise) and the others leave it on
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass
class ChatInputs:
    messages: list[dict]
    tools: list[dict] | None = None  # None when tool_choice is "none": no call is looked for in the reply
    options: dict[str, Any] = field(default_factory=dict)  # Tokenizer.chat_prompt's keyword arguments
    tool_choice: str = "auto"  # "none", "auto", "required", or the name of the one function to call


def chat_inputs(body: ChatBody) -> ChatInputs:
    """The template's inputs of a valid request; APIError 400 naming the parameter otherwise."""
    tools = _tools(body.tools)
    kwargs = dict(body.chat_template_kwargs or {})
    if bad := sorted(RESERVED & set(kwargs)):
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(bad)}: the request's own fields do",
                       "chat_template_kwargs")
    if body.reasoning_effort is not None:
        if body.reasoning_effort not in EFFORTS:
            raise APIError(400, f"reasoning_effort must be one of {', '.join(EFFORTS)}", "reasoning_effort")
        kwargs.setdefault("enable_thinking", body.reasoning_effort not in ("none", "minimal"))
    choice = _tool_choice(body.tool_choice, tools)
    messages = [_message(i, m) for i, m in enumerate(body.messages)]
    continuing = bool(body.continue_final_message)
    if continuing and (messages[-1]["role"] != "assistant" or body.add_generation_prompt):
        raise APIError(400, "continue_final_message needs a final assistant message and add_generation_prompt "
                            "false", "continue_final_message")
    options = {**kwargs, "tools": tools, "add_generation_prompt": body.add_generation_prompt is not False,
               "continue_final": continuing}
    return ChatInputs(messages, tools if choice != "none" else None, options, choice)


def _tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", f"tools[{i}]")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise APIError(400, f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '-', '.' or ':'",
                           f"tools[{i}].function.name")
        if not isinstance(function.get("parameters", {}), dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           f"tools[{i}].function.parameters")
        if not isinstance(function.get("description", ""), str):
            raise APIError(400, f"tools[{i}].function.description must be a string", f"tools[{i}].function.description")
    return tools


def _tool_choice(choice: str | dict | None, tools: list[dict] | None) -> str:
    """"none", "auto" or "required", or the name of the function the request names."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise APIError(400, f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function, got "
                                f"'{choice[:64]}'", "tool_choice")
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice 'required' needs tools", "tool_choice")
        return choice
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(400, "tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools or []}:
        raise APIError(400, f"tool_choice names the function '{name[:64]}', which is not in tools", "tool_choice")
    return name


def _message(index: int, message) -> dict:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        if message.role != "assistant":
            raise APIError(400, f"messages[{index}]: only assistant messages carry tool_calls",
                           f"messages[{index}].tool_calls")
        out["tool_calls"] = [_call(index, j, call) for j, call in enumerate(message.tool_calls)]
    for key in ("tool_call_id", "name"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    return out


def _call(index: int, j: int, call: dict) -> dict:
    where = f"messages[{index}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{where} must have a function with a name", where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object (as text)", f"{where}.function.arguments")
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}

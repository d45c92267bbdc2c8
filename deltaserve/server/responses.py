"""OpenAI's Responses API (POST /v1/responses), the one the openai SDK's `client.responses` and agent frameworks
call, over the chat completions path: the request's `instructions` and `input` items become chat messages, its
function tools chat tools, `text.format` a response_format and `reasoning.effort` a reasoning_effort; the reply
(its thinking, text and function calls) becomes output items, and a stream of chat chunks the Responses events.

Nothing is stored: `previous_response_id`, `conversation`, `background` and `store: true` are refused (send the
whole conversation as `input`, as with `store: false`: a response's output items go back as input items).
Reasoning is returned in the clear as a reasoning item's `reasoning_text`, and read back from input items."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from pydantic import Field, ValidationError, field_validator

from deltaserve.tokenizer import Tokenizer

from .errors import APIError
from .generation import ClosingStream
from .schemas import ChatBody, RequestBody

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
# include values that ask for nothing this server leaves out (reasoning comes back in the clear)
INCLUDES = ("reasoning.encrypted_content",)
# parameters this server cannot honour: (why, the one value it takes besides null)
REFUSED = {
    "previous_response_id": ("stored responses (send the whole conversation as input)", None),
    "conversation": ("stored conversations (send the whole conversation as input)", None),
    "background": ("responses answered later (they are answered in the request)", False),
    "prompt": ("stored prompt templates (send instructions and input)", None),
    "max_tool_calls": ("a bound on tool calls (the reply's calls are all returned)", None),
    "top_logprobs": ("logprobs in responses (the chat completions route returns them)", None),
    "truncation": ("truncation 'auto': input items are not dropped (a prompt past the context is refused)",
                   "disabled"),
}


class ResponsesBody(RequestBody):
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=0)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    reasoning: dict | None = None
    include: list[str] | None = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    truncation: Any = None

    @field_validator(*REFUSED, mode="before")
    @classmethod
    def _refused(cls, value, info):
        reason, default = REFUSED[info.field_name]
        if value not in (None, default):
            raise ValueError(f"not supported by this server: {reason}")
        return value

    @field_validator("include")
    @classmethod
    def _included(cls, values):
        if bad := [v for v in values or [] if v not in INCLUDES]:
            raise ValueError(f"not supported by this server: {', '.join(map(str, bad))}")
        return values


def install_responses(app: FastAPI, engine, chat) -> None:
    """POST /v1/responses over `chat`, the app's chat completions route (its body, the request)."""

    @app.post("/v1/responses")
    async def responses(body: ResponsesBody, request: Request):
        response = Response(body, engine.model_name, engine.tokenizer)
        out = await chat(chat_body(body), request)  # the chat completion, or its stream
        return response.stream(out) if body.stream else response.of_chat(out)


def chat_body(body: ResponsesBody) -> ChatBody:
    """The chat completions request of a Responses request; APIError 400 naming what was wrong."""
    if body.n not in (None, 1):
        raise APIError(400, "a response has one output: send n requests for n answers", "n")
    shared = body.model_dump(include=set(RequestBody.model_fields) - {"max_tokens", "n", "stream_options"},
                             exclude_none=True)
    fields = dict(shared, messages=_messages(body.instructions, body.input),
                  max_completion_tokens=body.max_output_tokens, parallel_tool_calls=body.parallel_tool_calls,
                  tools=[_tool(i, t) for i, t in enumerate(body.tools)] if body.tools else None,
                  tool_choice=_tool_choice(body.tool_choice), response_format=_format(body.text),
                  reasoning_effort=(body.reasoning or {}).get("effort"))
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    try:
        return ChatBody.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{where}: {str(first.get('msg')).removeprefix('Value error, ')}", where) from None


def _messages(instructions: str | None, items: str | list[dict]) -> list[dict]:
    """Chat messages of the input items: messages, function calls (into the assistant message before them),
    function call outputs (tool messages) and reasoning (the next assistant message's reasoning_content)."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    messages: list[dict] = []
    thought = None
    for i, item in enumerate(items):
        kind, role = item.get("type", "message"), item.get("role")
        if kind == "message":
            role = ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise APIError(400, f"input[{i}]: role must be one of {', '.join(ROLES)}", f"input[{i}].role")
            messages.append({"role": role, "content": _text(i, item.get("content"))})
        elif kind == "function_call":
            call = {"id": _string(i, item, "call_id"), "type": "function",
                    "function": {"name": _string(i, item, "name"), "arguments": _string(i, item, "arguments")}}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(i, item, "call_id"),
                             "content": output if isinstance(output, str) else _text(i, output)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thought = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)) \
                if isinstance(parts, list) else ""
            continue
        else:
            raise APIError(400, f"input[{i}]: items of type {json.dumps(kind)[:40]} are not supported (message, "
                                "function_call, function_call_output, reasoning)", f"input[{i}].type")
        if thought is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = thought
        thought = None
    if instructions is not None:  # before everything, in the system message the template puts first
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = instructions + "\n\n" + messages[0]["content"]
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    if not messages:
        raise APIError(400, "input holds no message", "input")
    return messages


def _text(i: int, content) -> str:
    """A message's text: a string, or its text parts joined (the models served read text only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{i}]: content must be a string or a list of text parts", f"input[{i}].content")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str)):
            raise APIError(400, f"input[{i}].content[{j}]: only text parts ({', '.join(TEXT_PARTS)}) are supported",
                           f"input[{i}].content[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _string(i: int, item: dict, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"input[{i}]: a {item.get('type')} item needs '{key}' as a string", f"input[{i}].{key}")
    return value


def _tool(i: int, tool: dict) -> dict:
    """A Responses function tool ({type, name, description, parameters, strict}) as a chat tool."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(400, f"tools[{i}]: only function tools are supported", f"tools[{i}].type")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if k in tool}}


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: dict | None) -> dict | None:
    """text.format as a response_format: text (none), json_object, or json_schema {name, schema, strict}."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return {"type": fmt.get("type")}


class Response:
    """The response object: its fields from the request, its output items from a chat reply."""

    def __init__(self, body: ResponsesBody, model: str, tokenizer: Tokenizer):
        self.body, self.model, self.tokenizer = body, model, tokenizer
        self.id, self.created = "resp_" + uuid.uuid4().hex[:24], int(time.time())

    def of_chat(self, completion: dict) -> dict:
        """The whole response of a chat completion."""
        choice = completion["choices"][0]
        message, output = choice["message"], []
        if message.get("reasoning_content"):
            output.append(reasoning_item(message["reasoning_content"]))
        if message.get("content") or not (output or message.get("tool_calls")):  # (nothing at all: an empty message)
            output.append(message_item(message.get("content") or ""))
        output += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"])
                   for c in message.get("tool_calls") or []]
        return self.object(output, choice["finish_reason"], completion["usage"])

    def object(self, output: list[dict], finish: str | None, usage: dict | None) -> dict:
        """The response with these output items; finish None: still in progress."""
        status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": {"effort": (body.reasoning or {}).get("effort"),
                                                            "summary": None},
                "store": False, "temperature": body.temperature, "top_p": body.top_p,
                "text": body.text or {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
                "tools": body.tools or [], "truncation": "disabled", "user": body.user,
                "usage": self._usage(usage, output) if usage else None}

    def _usage(self, usage: dict, output: list[dict]) -> dict:
        # the reasoning's tokens: its text encoded again (the ids it was generated as are not kept apart)
        reasoning = sum(len(self.tokenizer.encode(part["text"])) for item in output if item["type"] == "reasoning"
                        for part in item["content"])
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": min(reasoning, usage["completion_tokens"])},
                "total_tokens": usage["total_tokens"]}

    def stream(self, chunks: ClosingStream) -> ClosingStream:
        """The Responses events of a stream of chat completion chunks (which runs its own cleanup)."""
        return ClosingStream(_Events(self).of(chunks.body_iterator), chunks.on_close,
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or "rs_" + uuid.uuid4().hex[:24], "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or "msg_" + uuid.uuid4().hex[:24], "status": "completed",
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or "fc_" + uuid.uuid4().hex[:24], "call_id": call_id,
            "name": name, "arguments": arguments, "status": "completed"}


class _Events:
    """Chat chunks in, Responses events out: an output item is opened when the reply turns to another kind of
    text (reasoning, content, a new function call), its text streamed as deltas, and closed with its whole
    item; response.completed (or .incomplete) carries the whole response."""

    def __init__(self, response: Response):
        self.response = response
        self.seq = itertools.count()
        self.items: list[dict] = []
        self.open: dict | None = None  # {"kind", "id", "text"} (+ "call_id", "name" of a function call)

    def event(self, kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(self.seq), **fields})}\n\n"

    async def of(self, chunks):
        yield self.event("response.created", response=self.response.object([], None, None))
        yield self.event("response.in_progress", response=self.response.object([], None, None))
        finish, usage = None, None
        async for raw in chunks:
            for line in raw.splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:  # the chat stream's last word: the response failed
                    for text in self.close():
                        yield text
                    error = chunk["error"]
                    yield self.event("error", code=error.get("code"), message=error.get("message"), param=None)
                    failed = dict(self.response.object(self.items, "stop", None), status="failed",
                                  error={"code": error.get("code"), "message": error.get("message")})
                    yield self.event("response.failed", response=failed)
                    return
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    for text in self.delta(choice["delta"]):
                        yield text
                    finish = choice.get("finish_reason") or finish
        if not self.items and self.open is None:  # nothing at all: an empty message, as the whole response has
            for text in self.start("message"):
                yield text
        for text in self.close():
            yield text
        done = self.response.object(self.items, finish or "stop", usage)
        yield self.event("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                         response=done)

    def delta(self, delta: dict):
        if delta.get("reasoning_content"):
            yield from self.text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            yield from self.text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a new call: its first delta has its id and name
                yield from self.close()
                self.open = {"kind": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "text": "",
                             "call_id": call["id"], "name": call["function"]["name"]}
                yield self.added(call_item(call["id"], call["function"]["name"], "", self.open["id"]))
            piece = call.get("function", {}).get("arguments")
            if piece and self.open and self.open["kind"] == "function_call":
                self.open["text"] += piece
                yield self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                 output_index=len(self.items), delta=piece)

    def text(self, kind: str, piece: str):
        if not (self.open and self.open["kind"] == kind):
            yield from self.start(kind)
        self.open["text"] += piece
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        yield self.event(name, **self.at(), delta=piece, **({"logprobs": []} if kind == "message" else {}))

    def start(self, kind: str):
        """Open a reasoning or message item."""
        yield from self.close()
        prefix = "rs_" if kind == "reasoning" else "msg_"
        self.open = {"kind": kind, "id": prefix + uuid.uuid4().hex[:24], "text": ""}
        empty = (reasoning_item if kind == "reasoning" else message_item)("", self.open["id"])
        yield self.added(dict(empty, status="in_progress"))
        if kind == "message":
            yield self.event("response.content_part.added", **self.at(), part=empty["content"][0])

    def added(self, item: dict) -> str:
        return self.event("response.output_item.added", output_index=len(self.items), item=item)

    def at(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}

    def close(self):
        """The events that end the open item, which joins the output."""
        if self.open is None:
            return
        kind, text, item_id = self.open["kind"], self.open["text"], self.open["id"]
        if kind == "reasoning":
            item = reasoning_item(text, item_id)
            yield self.event("response.reasoning_text.done", **self.at(), text=text)
        elif kind == "message":
            item = message_item(text, item_id)
            yield self.event("response.output_text.done", **self.at(), text=text, logprobs=[])
            yield self.event("response.content_part.done", **self.at(), part=item["content"][0])
        else:
            item = call_item(self.open["call_id"], self.open["name"], text, item_id)
            yield self.event("response.function_call_arguments.done", item_id=item_id, output_index=len(self.items),
                             arguments=text)
        yield self.event("response.output_item.done", output_index=len(self.items), item=item)
        self.items.append(item)
        self.open = None

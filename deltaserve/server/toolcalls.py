"""Tool calls read out of a reply's text as it streams in, in either form of deltaserve.callforms.

Events, in order: (CONTENT, text), (CALL, index, id, name) when a call's function is known, then
(ARGUMENTS, index, fragment) pieces whose concatenation is the call's arguments as a JSON object. An XML
call's parameters arrive as text and are typed by the tool's JSON schema ("3" -> 3 for an integer; $refs
followed); each one goes out when its </parameter> arrives. A JSON call goes out whole at its </tool_call>.
A block that is not a call (no <function=NAME> header, JSON that does not parse) stays in the content as
written; a call cut off by the length limit keeps the parameters it completed. The whitespace that
separates calls from the text around them is layout and is dropped.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

from deltaserve.callforms import (CALL_CLOSE, CALL_OPEN, FUNCTION_CLOSE, FUNCTION_OPEN, PARAMETER_CLOSE,
                                  PARAMETER_OPEN, CallForm)
from deltaserve.engine.schema import resolved_properties

from .reasoning import CONTENT, held_back

CALL, ARGUMENTS = "call", "arguments"
MAX_NAME = 256  # characters of a function or parameter name: a header longer than this is not one
_INTEGER = re.compile(r"[-+]?\d+")
_XML_TAGS = (PARAMETER_OPEN, FUNCTION_CLOSE, CALL_CLOSE)
_LONGEST_TAG = max(map(len, (*_XML_TAGS, PARAMETER_CLOSE)))


def schemas_of(tools: list[dict] | None) -> dict[str, dict]:
    """Function name -> its parameters' JSON schema, from a request's `tools`."""
    found = {}
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            found[function["name"]] = params if isinstance(params, dict) else {}
    return found


def _types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    kinds = schema.get("type")
    found = [kinds] if isinstance(kinds, str) else [k for k in kinds or [] if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            found += _types(option)
    return found


def _choices(schema: Any) -> list:
    """The enum / const values of a schema and of its union's members."""
    if not isinstance(schema, dict):
        return []
    found = [schema["const"]] if "const" in schema else list(schema.get("enum") or [])
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            found += _choices(option)
    return found


def typed_value(text: str, schema: Any) -> Any:
    """An XML parameter's text as its schema's type; text that is none of the types stays a string. Where the
    schema lists values that are not all strings (enum [1, "auto"]), text that is the JSON of one of them
    is that value (the grammar writes such an enum as JSON)."""
    value = text.strip()
    choices = _choices(schema)
    if any(not isinstance(c, str) for c in choices):
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = text
        if any(type(c) is type(parsed) and c == parsed for c in choices):
            return parsed
    for kind in _types(schema):
        if kind == "integer" and _INTEGER.fullmatch(value):
            return int(value)
        if kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(value) if _INTEGER.fullmatch(value) else number
        if kind == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if kind == "null" and value.lower() in ("null", "none"):
            return None
        if kind in ("object", "array"):
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
    return text


class ToolCallParser:
    """feed(text) / finish() -> events (module docstring)."""

    def __init__(self, form: CallForm, tools: list[dict] | None, new_id: Callable[[], str]):
        self.form, self.schemas, self.new_id = form, schemas_of(tools), new_id
        self.properties: dict[str, dict] = {}  # function name -> its parameters' schemas, $refs followed
        self.buf = ""
        self.in_call = False  # inside <tool_call>: buf holds the block read so far
        self.calls = 0
        self.header = False  # (XML) the current call's <function=NAME> was read and its CALL event sent
        self.params = 0  # (XML) parameters of the current call sent so far
        self.name = ""
        self.gap = ""  # the whitespace before the current block: content again if the block is no call
        self.after_call = False
        # waiting for the tag that ends a parameter's value or a JSON block: until text brings a '<' (every
        # tag starts with one), it only grows the buffer; a long value is not searched again per token
        self.in_value = False

    def feed(self, text: str) -> list[tuple]:
        tail = self.buf[-_LONGEST_TAG:]
        self.buf += text
        if self.in_value and "<" not in text and "<" not in tail:
            return []
        self.in_value = False
        out: list[tuple] = []
        while self.buf:
            if not self.in_call:
                if not self._text(out):
                    break
            elif not (self._xml(out) if self.form is CallForm.XML else self._json(out)):
                break
        return out

    def finish(self) -> list[tuple]:
        out: list[tuple] = []
        if self.in_call and self.form is CallForm.JSON and self._json(out, final=True):
            return out
        if self.in_call and self.header:  # cut off inside a call: the parameters it completed
            out.append((ARGUMENTS, self.calls - 1, "}" if self.params else "{}"))
        elif self.in_call:
            self._not_a_call(out, self.buf)
        elif self.buf and not (self.calls and not self.buf.strip()):
            out.append((CONTENT, self.buf))
        self.buf = ""
        return out

    def _text(self, out: list) -> bool:
        """Content up to the next <tool_call>: True if one opened. Whitespace next to a call is its layout:
        trailing whitespace waits, and is dropped if a call follows or nothing but whitespace does."""
        if self.after_call:
            if not self.buf.strip():
                return False
            self.after_call = False
        start = self.buf.find(CALL_OPEN)
        if start < 0:
            keep = held_back(self.buf, (CALL_OPEN,))
            ready = self.buf[:len(self.buf) - keep].rstrip()
            if ready:
                out.append((CONTENT, ready))
            self.buf = self.buf[len(ready):]
            return False
        before = self.buf[:start].rstrip()
        if before:
            out.append((CONTENT, before))
        self.gap = self.buf[len(before):start]
        self.buf, self.in_call, self.header, self.params = self.buf[start + len(CALL_OPEN):], True, False, 0
        return True

    def _not_a_call(self, out: list, text: str = "") -> None:
        """The block is content as written (`text`: the part of it read so far that is not read again)."""
        out.append((CONTENT, self.gap + CALL_OPEN + text))
        self.in_call = False

    def _xml(self, out: list) -> bool:
        """One step through an XML call; False: wait for more text."""
        head = self.buf.lstrip()
        if not self.header:
            if FUNCTION_OPEN.startswith(head):
                return False
            end = head.find(">")
            name = head[len(FUNCTION_OPEN):end] if end >= 0 else head[len(FUNCTION_OPEN):]
            if not head.startswith(FUNCTION_OPEN) or not _is_name(name, complete=end >= 0):
                self._not_a_call(out)
                return True
            if end < 0:
                return False
            self.buf, self.header, self.name = head[end + 1:], True, name
            self.calls += 1
            out.append((CALL, self.calls - 1, self.new_id(), name))
            return True
        if head.startswith(PARAMETER_OPEN):
            return self._parameter(head, out)
        if head.startswith(FUNCTION_CLOSE):
            self.buf = head[len(FUNCTION_CLOSE):]
            return True
        if head.startswith(CALL_CLOSE):
            out.append((ARGUMENTS, self.calls - 1, "}" if self.params else "{}"))
            self.buf, self.in_call, self.after_call = head[len(CALL_CLOSE):], False, True
            return True
        if any(tag.startswith(head) for tag in _XML_TAGS):
            return False
        cut = head.find("<", 1)  # text that is no tag inside a call: skipped
        self.buf = head[cut:] if cut > 0 else ""
        return cut > 0

    def _parameter(self, head: str, out: list) -> bool:
        end = head.find(">")
        name = head[len(PARAMETER_OPEN):end] if end >= 0 else head[len(PARAMETER_OPEN):]
        if not _is_name(name, complete=end >= 0):  # not a parameter tag: skipped like other stray text
            self.buf = head[len(PARAMETER_OPEN):]
            return True
        if end < 0:
            return False
        body = head[end + 1:]
        # the value ends at its </parameter>, or where the next tag shows that it was left unclosed
        stop, tag = min(((i, t) for t in (PARAMETER_CLOSE, *_XML_TAGS) if (i := body.find(t)) >= 0),
                        default=(-1, ""))
        if stop < 0:
            self.in_value = True
            return False
        value = body[:stop].removeprefix("\n").removesuffix("\n")
        if self.name not in self.properties:
            self.properties[self.name] = resolved_properties(self.schemas.get(self.name, {}))
        typed = typed_value(value, self.properties[self.name].get(name))
        piece = f"{json.dumps(name, ensure_ascii=False)}: {json.dumps(typed, ensure_ascii=False)}"
        out.append((ARGUMENTS, self.calls - 1, ("{" if not self.params else ", ") + piece))
        self.params += 1
        self.buf = body[stop + len(PARAMETER_CLOSE):] if tag == PARAMETER_CLOSE else body[stop:]
        return True

    def _json(self, out: list, final: bool = False) -> bool:
        """A JSON call once its block is complete (or at the end); False: wait for more text."""
        end = self.buf.find(CALL_CLOSE)
        if end < 0 and not final:
            self.in_value = True
            return False
        block = self.buf if end < 0 else self.buf[:end]
        call = _json_call(block)
        if call is None:
            if final:
                return False
            self._not_a_call(out, block + CALL_CLOSE)
        else:
            self.calls += 1
            out.append((CALL, self.calls - 1, self.new_id(), call[0]))
            out.append((ARGUMENTS, self.calls - 1, call[1]))
            self.after_call = True
        self.buf, self.in_call = "" if end < 0 else self.buf[end + len(CALL_CLOSE):], False
        return True


def _is_name(name: str, complete: bool = True) -> bool:
    """Whether `name` is a function or parameter name (complete: False, may still become one)."""
    return (0 < len(name) or not complete) and len(name) <= MAX_NAME and not any(c in "<>" or c.isspace() for c in name)


def _json_call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a JSON call's block, None if it is not one."""
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not _is_name(call["name"]):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # arguments written as a JSON string, as the OpenAI API carries them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)

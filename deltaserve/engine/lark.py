"""Pieces of llguidance's Lark grammars shared by engine.grammar and engine.xmlcall."""

from __future__ import annotations

import json
from typing import Any

# JSON on one line with Python's json.dumps separators (", " and ": ") and no other whitespace: that is how
# the templates render JSON (`tojson`), and a model free to add whitespace can add it for ever
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_value(document: dict[str, Any]) -> str:
    """An inline JSON value of a prepared schema document (engine.schema.prepared / embedded)."""
    return "%json " + json.dumps({**document, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def literal(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def regex_literal(text: str) -> str:
    """`text` as a literal inside /.../ (Rust regex syntax)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in r"\.+*?()|[]{}^$#&-~/" else c for c in text)

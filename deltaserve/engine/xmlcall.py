"""The grammar of one call in the XML form (Qwen3.5's `qwen3_coder`):
<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n...</function>\\n</tool_call>

The parameters come in the order of the schema's `properties` (reached through `$ref`s where the schema
has them), the required ones always, the others optionally, no undeclared ones. A value is what
server.toolcalls reads back into a value of the parameter's schema:

- a string is raw text that meets everything the schema asks of it: minLength / maxLength, `pattern`
  (engine.patterns), `format` (engine.formats), enum / const. A schema this form cannot hold in raw text
  (a pattern with look-around, an unknown format, allOf on a string) is a SchemaError naming the tool and
  the parameter, never a value left unconstrained;
- any other value is JSON of its schema (with the tool's $defs beside it, so its $refs resolve);
- a union (anyOf / oneOf / a list of types) takes either: raw text for its string members, JSON for the
  rest; the raw text may not be one the parser would read as another member's kind ("3" where an integer
  is allowed too reads as 3);
- no value holds one of the form's tags (</parameter>, <parameter=, </function>, </tool_call>), raw or
  inside a JSON string: the parser would end the value there.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from llguidance import regex_to_lark

from deltaserve.callforms import CALL_CLOSE, CALL_OPEN, FUNCTION_CLOSE, FUNCTION_OPEN, PARAMETER_CLOSE, PARAMETER_OPEN

from .formats import FORMATS, MAX_LENGTH, format_regex
from .lark import json_value, literal, regex_literal
from .patterns import PatternError, avoiding, pattern_regex
from .schema import ANNOTATIONS, SchemaError, embedded, ref_to, resolve

TAGS = (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE, CALL_CLOSE)
NO_TAGS = avoiding(TAGS)
_END = "\n" + PARAMETER_CLOSE + "\n"
_WS = "[\\s\\x1c-\\x1f]*"  # what str.strip() strips
_DIGITS = "\\d(?:_?\\d)*"
# text that server.toolcalls.typed_value reads as a value of that kind rather than as a string (a little
# more, where that keeps the regex simple: nothing a string needs is lost)
CLAIMS = {
    "integer": f"{_WS}[-+]?\\d+{_WS}",
    "number": f"{_WS}[-+]?(?:{_DIGITS}(?:\\.(?:{_DIGITS})?)?|\\.{_DIGITS})(?:[eE][-+]?{_DIGITS})?{_WS}",
    "boolean": f"{_WS}(?i:true|false){_WS}",
    "null": f"{_WS}(?i:null|none){_WS}",
    "object": f"{_WS}[\\[{{](?s:.*)",
    "array": f"{_WS}[\\[{{](?s:.*)",
}
# keywords of a tool's parameters object that the form cannot follow (it writes a fixed list of parameters)
_OBJECT_UNSUPPORTED = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "patternProperties",
                       "dependentRequired", "dependentSchemas", "minProperties", "maxProperties", "propertyNames",
                       "unevaluatedProperties")
# keywords that would constrain a string further than raw text can be held to here
_RAW_UNSUPPORTED = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "contentSchema")


def xml_call_rules(i: int, tool) -> list[str]:
    """The rules of `call{i}`, a call of `tool` (engine.grammar.Tool)."""
    root, where = tool.parameters, f"tool '{tool.name}'"
    params, pointer = resolve(root, root, "", where)
    if params is True:
        params = {}
    if not isinstance(params, dict) or params.get("type", "object") not in ("object", ["object"]):
        raise SchemaError(f"{where}: its parameters must be an object schema")
    unsupported = [k for k in _OBJECT_UNSUPPORTED if k in params]
    if unsupported:
        raise SchemaError(f"{where}: the XML call form cannot constrain parameters with {', '.join(unsupported)}")
    properties = params.get("properties") or {}
    required = set(params.get("required") or ())
    if required - set(properties):
        raise SchemaError(f"{where}: requires {sorted(required - set(properties))}, which its properties do "
                          f"not declare")
    parts, rules = [literal(f"{CALL_OPEN}\n{FUNCTION_OPEN}{tool.name}>\n")], []
    for j, (key, schema) in enumerate(properties.items()):
        at = f"{where}, parameter '{key}'"
        if not key or any(c in "<>" or c.isspace() for c in key):
            raise SchemaError(f"{at}: the XML call form cannot name a parameter with spaces, '<' or '>'")
        if schema is False:
            if key in required:
                raise SchemaError(f"{at}: required, but its schema (false) admits no value")
            continue
        p = f"p{i}_{j}"
        parts.append(p if key in required else p + "?")
        rules.append(f"{p}: {literal(f'{PARAMETER_OPEN}{key}>' + chr(10))} v{p}")
        rules += _value(f"v{p}", root, schema, f"{pointer}/properties/{_escaped(key)}", at)
    parts.append(literal(f"{FUNCTION_CLOSE}\n{CALL_CLOSE}"))
    return [f"call{i}: " + " ".join(parts), *rules]


def _escaped(key: str) -> str:
    """A property name as a JSON pointer token inside a URI fragment (RFC 6901)."""
    return quote(key.replace("~", "~0").replace("/", "~1"), safe="!$&'()*+,;=:@-._~")


def _value(rule: str, root: dict, schema: Any, pointer: str, where: str) -> list[str]:
    """Rules of one parameter's value with the "\\n</parameter>\\n" that ends it."""
    schema, pointer = resolve(root, schema, pointer, where)
    strings, others, kinds = _members(root, {} if schema is True else schema, pointer, where)
    options, rules = [], []
    if strings:
        name = rule.upper()
        rules += _raw(name, strings, [CLAIMS[k] for k in sorted(kinds) if k in CLAIMS], where)
        options.append(name)
    if others:
        node = others[0] if len(others) == 1 else {"anyOf": others}
        rules.append(f"{rule}_json: {json_value(embedded(root, node, avoid=NO_TAGS))}")
        options.append(f"{rule}_json {literal(_END)}")
    return [f"{rule}: {' | '.join(options)}", *rules]


def _members(root: dict, schema: dict, pointer: str, where: str) -> tuple[list[dict], list[dict], set[str]]:
    """(string members, written raw; the other members, as $refs for JSON; the kinds of the other members),
    of a parameter's schema: itself, or the members of its union."""
    union = next((k for k in ("anyOf", "oneOf") if isinstance(schema.get(k), list)), None)
    if union is not None:
        if set(schema) - ANNOTATIONS - {union}:
            raise SchemaError(f"{where}: a union ({union}) beside other keywords cannot be written here")
        strings, others, kinds = [], [], set()
        for j, member in enumerate(schema[union]):
            member, at = resolve(root, member, f"{pointer}/{union}/{j}", where)
            member = {} if member is True else member
            if _is_string(member):
                strings.append(member)
            elif member is not False:
                others.append(ref_to(at))
                kinds |= _kinds(member)
        if union == "oneOf" and len(strings) > 1:
            raise SchemaError(f"{where}: a oneOf of several strings cannot be written here")
        return strings, others, kinds
    types = schema.get("type")
    if isinstance(types, list) and "string" in types:
        rest = [t for t in types if t != "string"]
        others = [{**ref_to(pointer), "type": rest}] if rest else []
        return [{**schema, "type": "string"}], others, set(rest)
    if _is_string(schema):
        return [schema], [], set()
    return [], [ref_to(pointer)], _kinds(schema)


def _is_string(schema: dict) -> bool:
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if schema.get("type") == "string":
        return True
    return "type" not in schema and bool(choices) and all(isinstance(c, str) for c in choices)


def _kinds(schema: dict) -> set[str]:
    kinds = schema.get("type")
    return {kinds} if isinstance(kinds, str) else {k for k in kinds or () if isinstance(k, str)}


def _raw(name: str, members: list[dict], claims: list[str], where: str) -> list[str]:
    """Terminal `name`: raw text of one of the string `members`, none of the `claims`, no tag, then the end."""
    rules = [f"{name}_{k}: {' & '.join(_string_regexes(member, where))}" for k, member in enumerate(members)]
    content = f"({' | '.join(f'{name}_{k}' for k in range(len(members)))}) & /{NO_TAGS}/"
    if claims:
        # nor a claimed text followed by a line: the JSON member's value ends where such a line starts, and
        # the lexer, which takes the longest match, would otherwise keep reading raw text past it
        content += f" & ~/(?:{'|'.join(claims)})(?:\\n(?s:.*))?/"
    return [*rules, f"{name}_TEXT: {content}", f"{name}: {name}_TEXT {literal(_END)}"]


def _string_regexes(schema: dict, where: str) -> list[str]:
    """Lark regexes a string of `schema` matches whole, all of them."""
    unsupported = [k for k in _RAW_UNSUPPORTED if k in schema]
    if unsupported:
        raise SchemaError(f"{where}: a string with {', '.join(unsupported)} cannot be written as raw text here")
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if choices is not None:
        strings = [c for c in choices if isinstance(c, str)]
        return ["/(?:" + "|".join(regex_literal(c) for c in strings) + ")/" if strings else "/[^\\s\\S]/"]
    low, high = _bound(schema, "minLength", 0, where), _bound(schema, "maxLength", None, where)
    fmt = schema.get("format")
    if fmt is not None:
        if not isinstance(fmt, str) or format_regex(fmt) is None:
            raise SchemaError(f"{where}: format {str(fmt)[:50]!r} is not one constrained decoding knows "
                              f"({', '.join(sorted(FORMATS))})")
        if fmt in MAX_LENGTH:
            high = MAX_LENGTH[fmt] if high is None else min(high, MAX_LENGTH[fmt])
    out = [f"/(?s:.){{{low},{'' if high is None else high}}}/"]
    if fmt is not None:
        out.append(f"/{regex_to_lark(format_regex(fmt), '')}/")  # (escapes its '/')
    if "pattern" in schema:
        try:
            out.append(f"/{pattern_regex(str(schema['pattern']))}/")
        except PatternError as e:
            raise SchemaError(f"{where}: pattern {str(schema['pattern'])[:100]!r} cannot be used: {e}") from None
    return out


def _bound(schema: dict, key: str, default: int | None, where: str) -> int | None:
    value = schema.get(key, default)
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise SchemaError(f"{where}: {key} must be a non-negative integer")
    return value


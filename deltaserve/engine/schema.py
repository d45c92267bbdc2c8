"""JSON schemas made ready for llguidance, and walked where a grammar must look inside them.

- `prepared`: every schema node rewritten in one pass: objects closed (no keys beyond `properties` where
  the schema leaves `additionalProperties` open, as xgrammar's strict mode does: the output still validates
  and a model cannot wander off into keys nobody asked for); `format` turned into our own `pattern`
  (engine.formats), so that both call forms and response_format write the same, always valid, strings;
  local `$ref`s moved under a new root where the schema is embedded in a larger one; optionally every
  string kept free of some words (the XML form's tags).
- `resolve`: a node's `$ref` chain followed to the schema it names, bounded, cycles refused.
- `embedded`: a document made of references to nodes of a schema (a tool's parameter, the alternatives of
  a union), with that whole schema beside it, so that the nodes' own `$ref`s (to `#/$defs/...` of the
  tool's schema) still resolve.
"""

from __future__ import annotations

from typing import Any, Callable
from urllib.parse import unquote

from deltaserve.errors import DeltaserveError

from .formats import MAX_LENGTH, format_regex

MAX_REF_DEPTH = 32  # $refs followed in a row before a schema is refused
EMBED = "__schema"  # the $defs key that holds an embedded schema
ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$schema", "$id", "$anchor", "contentMediaType", "contentEncoding",
                         "$defs", "definitions"))  # keywords that constrain no value
_SUBSCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")  # items: a list in drafts 4-7
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


class SchemaError(DeltaserveError):
    """A schema that constrained decoding cannot follow (what and where, in the message)."""


def mapped(schema: Any, fn: Callable[[dict], dict]) -> Any:
    """`schema` with fn applied to every schema node (a copy; children first). Values that are data, not
    schemas (const, enum, default, examples), and the property names of maps, are left alone."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = mapped(out[key], fn)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [mapped(s, fn) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: mapped(s, fn) for name, s in out[key].items()}
    return fn(out)


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` wherever it lists properties and leaves that open."""
    return mapped(schema, _close)


def _close(node: dict) -> dict:
    if "properties" in node and "additionalProperties" not in node:
        node["additionalProperties"] = False
    return node


def prepared(schema: Any, rebase: str | None = None, avoid: str | None = None) -> Any:
    """`schema` closed, its formats as patterns; rebase: a prefix for its local $refs (it is embedded
    under that pointer); avoid: a regex every string must match (besides its own constraints)."""
    def node(n: dict) -> dict:
        n = _with_format(_close(n))
        if rebase is not None and isinstance(n.get("$ref"), str) and n["$ref"].startswith("#"):
            n["$ref"] = rebase + n["$ref"][1:]
        if avoid is not None and _may_be_string(n):
            _add_pattern(n, f"^{avoid}$")
        return n
    return mapped(schema, node)


def _with_format(node: dict) -> dict:
    """A string `format` we know as a pattern (an unknown one stays, for llguidance to refuse)."""
    regex = format_regex(node["format"]) if isinstance(node.get("format"), str) else None
    if regex is None:
        return node
    name = node.pop("format")
    _add_pattern(node, f"^{regex}$")
    if name in MAX_LENGTH:
        node["maxLength"] = min(node.get("maxLength", MAX_LENGTH[name]), MAX_LENGTH[name])
    return node


def _add_pattern(node: dict, pattern: str) -> None:
    """A second pattern goes into allOf: the string must match both."""
    if "pattern" in node:
        node["allOf"] = [*node.get("allOf", []), {"pattern": pattern}]
    else:
        node["pattern"] = pattern


def _may_be_string(node: dict) -> bool:
    """Whether a node itself admits strings it does not fix (a typed string, or an untyped leaf)."""
    kinds = node.get("type")
    if kinds is not None:
        return kinds == "string" or isinstance(kinds, list) and "string" in kinds
    return not any(k in node for k in ("$ref", "enum", "const", "anyOf", "oneOf", "allOf", "not"))


def resolve(root: dict, node: Any, pointer: str, where: str) -> tuple[Any, str]:
    """(the schema `node` names through its $ref chain, its pointer in `root`); `node` itself if it has no
    $ref. A $ref beside other validating keywords, one outside `root`, a cycle or a chain longer than
    MAX_REF_DEPTH is a SchemaError naming `where`. A lone allOf of one schema counts as a $ref to it."""
    seen = {pointer}
    while isinstance(node, dict):
        rest = set(node) - ANNOTATIONS
        if rest == {"allOf"} and isinstance(node["allOf"], list) and len(node["allOf"]) == 1:
            node, pointer = node["allOf"][0], f"{pointer}/allOf/0"
            continue
        if "$ref" not in node:
            break
        ref = node["$ref"]
        if rest != {"$ref"}:
            raise SchemaError(f"{where}: a $ref beside other keywords ({', '.join(sorted(rest - {'$ref'}))}) "
                              f"cannot be followed here")
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"{where}: $ref {str(ref)[:100]!r} is not a reference inside the schema (#/...)")
        pointer = ref[1:]
        if pointer in seen:
            raise SchemaError(f"{where}: $ref {ref[:100]!r} refers back to itself (a cycle of $refs)")
        if len(seen) > MAX_REF_DEPTH:
            raise SchemaError(f"{where}: more than {MAX_REF_DEPTH} $refs in a row")
        seen.add(pointer)
        node = _at(root, pointer, where)
    return node, pointer


def _at(root: Any, pointer: str, where: str) -> Any:
    """The value at a JSON pointer (RFC 6901, as a URI fragment) of `root`."""
    node = root
    for raw in pointer.split("/")[1:] if pointer else []:
        key = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise SchemaError(f"{where}: $ref '#{pointer[:100]}' names nothing in the schema")
    return node


def ref_to(pointer: str) -> dict:
    """A $ref to the node at `pointer` of the schema an `embedded` document holds."""
    return {"$ref": f"#/$defs/{EMBED}{pointer}"}


def embedded(root: dict, node: dict, avoid: str | None = None) -> dict:
    """`node` (built of `ref_to`s into `root`) as a document with all of `root` under $defs, so that every
    $ref of `root` still resolves; `root` prepared (module docstring)."""
    return {**node, "$defs": {EMBED: prepared(root, rebase=f"#/$defs/{EMBED}", avoid=avoid)}}


def resolved_properties(root: Any) -> dict[str, Any]:
    """A tool's parameters by name, each schema (and the members of its union) with its $refs followed: what
    the XML form's parser types raw values by. A schema whose $refs cannot be followed types nothing ({})."""
    def follow(node: Any, pointer: str) -> tuple[Any, str]:
        try:
            return resolve(root, node, pointer, "")
        except SchemaError:
            return {}, pointer

    params, pointer = follow(root, "")
    properties = params.get("properties") if isinstance(params, dict) else None
    out = {}
    for name, schema in (properties or {}).items() if isinstance(properties, dict) else ():
        node, at = follow(schema, f"{pointer}/properties/{name}")
        if isinstance(node, dict):
            node = dict(node)
            for key in ("anyOf", "oneOf"):
                if isinstance(node.get(key), list):
                    node[key] = [follow(m, f"{at}/{key}/{j}")[0] for j, m in enumerate(node[key])]
        out[name] = node
    return out

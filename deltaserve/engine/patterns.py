"""Regular expressions for raw text under a grammar (Rust regex syntax, as llguidance reads them, always matched
against the whole text):

- `pattern_regex`: a JSON Schema `pattern` (ECMA-262 syntax, found anywhere in the string unless anchored)
  as a regex the whole string matches. Escapes take the meaning that is narrower between ECMA-262 and
  Python's `re` (what jsonschema validates with): \\d and \\w are ASCII, \\D and \\W exclude every
  Unicode digit or word character (inside a negated class the other way round), so that whatever
  matches also validates under both.
- `avoiding`: the strings in which none of some words occurs (the XML call form's tags, which would end a
  value early), written without the negation llguidance's Lark terminals have, so that it also serves
  as a JSON Schema `pattern`.
"""

from __future__ import annotations

from deltaserve.errors import DeltaserveError

ANY = "(?s:.*)"
_SPACE = "\\t\\n\\x0b\\x0c\\r "  # where ECMA-262's and Python's \s agree
_ANY_SPACE = "\\s\\x1c-\\x1f\\x{feff}"  # what either takes for a space
# an escape as the smallest set of characters both readings give it, and as the largest (the one a
# negated class must subtract, so that what it leaves is again the smallest)
_NARROW = {"d": "0-9", "w": "0-9A-Za-z_", "s": _SPACE, "D": "\\D", "W": "\\W", "S": f"[^{_ANY_SPACE}]"}
_WIDE = {"d": "\\d", "w": "\\w", "s": _ANY_SPACE, "D": "[^0-9]", "W": "[^0-9A-Za-z_]", "S": f"[^{_SPACE}]"}
_UNSUPPORTED = {"b": "a word boundary (\\b)", "B": "a word boundary (\\B)", "k": "a named back-reference (\\k)"}


class PatternError(DeltaserveError):
    """A pattern that cannot be matched by a regex without look-around (why, in the message)."""


def pattern_regex(pattern: str) -> str:
    """`pattern` as a regex of the whole string. Anchors (^, $) may only open or close the pattern or one of
    its top-level alternatives; look-around and back-references are refused (PatternError)."""
    alternatives = [[]]  # top-level alternatives, as lists of translated pieces
    depth, i = 0, 0
    anchored = [[False, False]]  # per alternative: starts with ^, ends with $
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            piece, i = _escape(pattern, i, in_class=False)
        elif c == "[":
            piece, i = _char_class(pattern, i)
        elif c == "(":
            if pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
                raise PatternError("look-around ((?=, (?!, (?<=, (?<!) cannot be matched here")
            depth += 1
            piece, i = c, i + 1
        elif c == ")":
            depth -= 1
            piece, i = c, i + 1
        elif c == "|" and depth == 0:
            alternatives.append([])
            anchored.append([False, False])
            i += 1
            continue
        elif c in "^$":
            at_start = c == "^" and depth == 0 and not alternatives[-1]
            at_end = c == "$" and depth == 0 and (i + 1 == len(pattern) or pattern[i + 1] == "|")
            if not (at_start or at_end):
                raise PatternError(f"'{c}' is an anchor only at the start or end of the pattern here")
            anchored[-1][c == "$"] = True
            i += 1
            continue
        elif c == "/":  # the end of a Lark regex literal otherwise
            piece, i = "\\/", i + 1
        else:
            piece, i = c, i + 1
        alternatives[-1].append(piece)
    if depth != 0:
        raise PatternError("unbalanced parentheses")
    whole = [("" if start else ANY) + "(?:" + "".join(body) + ")" + ("" if end else ANY)
             for body, (start, end) in zip(alternatives, anchored)]
    return "(?:" + "|".join(whole) + ")"


def _escape(pattern: str, i: int, in_class: bool, negated: bool = False) -> tuple[str, int]:
    """The escape at pattern[i] ('\\'), translated (in_class: inside a class, negated or not); and the index
    after it."""
    if i + 1 >= len(pattern):
        raise PatternError("the pattern ends with a lone backslash")
    c = pattern[i + 1]
    if c == "0" or in_class and c == "b":  # NUL; inside a class \b is a backspace
        return "\\x00" if c == "0" else "\\x08", i + 2
    if c in _UNSUPPORTED or c.isdigit():
        raise PatternError(f"{_UNSUPPORTED.get(c, 'a back-reference')} cannot be matched here")
    if c in _NARROW:
        if in_class:
            return (_WIDE if negated else _NARROW)[c], i + 2
        return _NARROW[c] if c in "DW" else f"[{_NARROW[c]}]", i + 2
    if c == "u" and pattern[i + 2:i + 3] != "{":  # \uXXXX
        return "\\x{" + pattern[i + 2:i + 6] + "}", i + 6
    if c == "/":
        return "\\/", i + 2
    return pattern[i:i + 2], i + 2


def _char_class(pattern: str, i: int) -> tuple[str, int]:
    """The character class opening at pattern[i] ('['), translated; and the index after it. In ECMA-262 a
    '[' inside a class is a plain character, in Rust it opens a nested class: it is escaped."""
    out, i = ["["], i + 1
    if pattern[i:i + 1] == "^":
        out.append("^")
        i += 1
    if pattern[i:i + 1] == "]":  # ECMA-262's [] and [^] (nothing, anything)
        return ("[^\\s\\S]" if out == ["["] else "(?s:.)"), i + 1
    while i < len(pattern) and pattern[i] != "]":
        if pattern[i] == "\\":
            piece, i = _escape(pattern, i, in_class=True, negated=out[:2] == ["[", "^"])
        else:
            piece, i = {"[": "\\[", "&": "\\&", "~": "\\~", "-": "-", "/": "\\/"}.get(pattern[i], pattern[i]), i + 1
        out.append(piece)
    if i >= len(pattern):
        raise PatternError("a character class is not closed")
    return "".join(out) + "]", i + 1


def avoiding(words: tuple[str, ...]) -> str:
    """A regex of the strings in which no word of `words` occurs. Each word must start with the same
    character, found nowhere else in the words (every tag of the XML form starts with '<')."""
    lead = words[0][0]
    if any(w[0] != lead or lead in w[1:] for w in words):
        raise ValueError("the words must share their first character and not hold it again")
    trie: dict = {}
    for word in words:
        node = trie
        for c in word[1:]:
            node = node.setdefault(c, {})
        node.clear()
        node[None] = True  # a word ends here: the path may not reach it
    esc = _literal
    lead_re = esc(lead)

    def prefix(node: dict) -> str:  # a path into the trie that completes no word (maybe empty)
        branches = [esc(c) + prefix(child) for c, child in node.items() if c is not None and None not in child]
        return f"(?:{'|'.join(branches)})?" if branches else ""

    def leave(node: dict) -> str:  # a path into the trie, then a character that leaves it (not `lead`)
        other = "[^" + "".join(esc(c) for c in (lead, *(c for c in node if c is not None))) + "]"
        branches = [esc(c) + leave(child) for c, child in node.items() if c is not None and None not in child]
        return "(?:" + "|".join([other, *branches]) + ")"

    restart = f"(?:{prefix(trie)}{lead_re})*"  # back to the start of a word at each new `lead`
    return f"(?:[^{lead_re}]|{lead_re}{restart}{leave(trie)})*(?:{lead_re}{restart}{prefix(trie)})?"


def _literal(text: str) -> str:
    """`text` as a regex matching itself (also inside a character class, and inside /.../)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)

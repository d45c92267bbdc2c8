"""Chat templates rendered within a budget: a template is code that ships inside a checkpoint, so a hostile
one must not take the process down with it.

jinja2's ImmutableSandboxedEnvironment already keeps a template away from Python's internals; this adds
bounds on what it may spend. Each render gets a deadline, a number of loop iterations and a number of
characters (for any one value it builds and for all the text it emits), checked where a template spends
them: at every loop iteration, call, filter, operator, attribute access and emitted piece. Work that one
step could blow up is estimated before it runs ('a' * 10**9, 'x'.center(10**9), s.replace('', big),
sep.join(items)), so a step never allocates more than a few times the budget. Going past a bound raises
ChatTemplateError, a DeltaserveError: the server answers 400 and goes on.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.runtime import LoopContext, Namespace
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import pass_context
from jinja2.visitor import NodeTransformer

from deltaserve.errors import ChatTemplateError

MAX_SECONDS = 2.0  # a real template renders in milliseconds
MAX_ITERATIONS = 1_000_000  # loop iterations per render, over all loops
MAX_CHARS = 2 * 2**20  # characters of any value and of all emitted text, plus 4x the text handed in
MAX_SOURCE = 2**20  # characters of template source (real ones are a few thousand)
MAX_INT_BITS = 4096  # of an integer a template computes (10**1233): '**' and '*' cannot make a huge one

_LOOP, _CONCAT, _EMIT = "deltaserve_loop", "deltaserve_concat", "deltaserve_emit"  # filters the guards insert
_NUMBERS = re.compile(r"\d+")


@dataclass
class Budget:
    """What one render may still spend."""

    deadline: float
    chars: int  # the bound on any one value and on all emitted text
    iterations: int = MAX_ITERATIONS
    emitted: int = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template ran past its time limit ({MAX_SECONDS:g} s)")

    def iterate(self) -> None:
        self.iterations -= 1
        if self.iterations < 0:
            raise ChatTemplateError(f"chat template ran more than {MAX_ITERATIONS} loop iterations")
        self.tick()

    def room(self, size: int, what: str, items: bool = False) -> None:
        """A value of `size` characters (items: of a list, tuple, dict or set) may be made. A container's items
        cost tens of bytes each and a sort or a filter walks them in Python: they get an eighth of the room."""
        limit = self.chars // 8 if items else self.chars
        if size > limit:
            unit = "items" if items else "characters"
            raise ChatTemplateError(f"chat template would build {what} of {size} {unit} (limit {limit})")

    def emit(self, size: int) -> None:
        self.emitted += size
        if self.emitted > self.chars:
            raise ChatTemplateError(f"chat template emitted more than {self.chars} characters")
        self.tick()


_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)


def _budget() -> Budget:
    """The current render's budget; outside a render (filters folded while compiling) a fresh one, so that
    sizes are bounded all the same."""
    return _BUDGET.get() or Budget(deadline=float("inf"), chars=MAX_CHARS)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set)) else 0


def _volume(value: Any, depth: int = 0) -> int:
    """Characters of text in a render's arguments (messages, tools): the output may be a few times that."""
    if isinstance(value, str):
        return len(value)
    if depth > 16:
        return 0
    if isinstance(value, dict):
        return sum(_volume(k, depth + 1) + _volume(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_volume(v, depth + 1) for v in value)
    return 0


def _check_value(value: Any, what: str) -> Any:
    _budget().room(_size(value), what, items=isinstance(value, (list, tuple, dict, set)))
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ChatTemplateError(f"chat template computed an integer of {value.bit_length()} bits")
    return value


def _widths(fmt: str) -> int:
    """The characters the widths and precisions written in a format string may add (any number in it may be
    one; a number of 12 digits or more counts as 10**12 without being converted)."""
    return sum(int(n) if len(n) < 12 else 10**12 for n in _NUMBERS.findall(fmt))


def _percent_size(fmt: str, args: Any) -> int:
    """An upper bound on the size of fmt % args: '*' widths come from the integer arguments."""
    ints = sum(x for x in (args if isinstance(args, tuple) else (args,)) if isinstance(x, int))
    return len(fmt) + _widths(fmt) + _volume(args) + ints


def _estimate(name: str, target: Any, args: tuple, kwargs: dict) -> int:
    """An upper bound on the size of what str method (or filter) `name` makes of `target`, for the calls whose
    output can be far larger than their input; 0 for the others (their result is checked after the call)."""
    ints = [a for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
    if name in ("center", "ljust", "rjust", "zfill", "batch", "slice"):
        return max(ints, default=0) + _size(target)
    if not isinstance(target, (str, bytes)):
        return 0
    if name == "indent":  # the width (spaces or a string) is added to every line
        width = next((len(a) if isinstance(a, str) else a for a in (*args, *kwargs.values())
                      if isinstance(a, (str, int)) and not isinstance(a, bool)), 4)
        return len(target) + width * (target.count("\n") + 1)
    if name == "expandtabs":
        return len(target) + target.count("\t") * max(ints, default=8)
    if name in ("format", "format_map"):  # widths written in the string or passed as arguments
        values = [v for a in args if isinstance(a, dict) for v in a.values()] + [*args, *kwargs.values()]
        return len(target) + _widths(target) + sum(_size(v) + (v if isinstance(v, int) else 0) for v in values)
    if name == "replace" and len(args) >= 2:
        count = len(target) + 1 if not args[0] else target.count(args[0])
        return len(target) + count * _size(args[1])
    if name == "join" and args and isinstance(args[0], (list, tuple)):
        return sum(_size(x) or len(str(x)) for x in args[0]) + len(target) * max(0, len(args[0]) - 1)
    if name == "translate" and args and isinstance(args[0], dict):
        return len(target) * max([_size(v) for v in args[0].values()] + [1])
    return 0


def _guard_filter(name: str, func):
    """A filter that checks the budget and the sizes before and after it runs."""
    offset = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0  # context / environment first

    @functools.wraps(func)
    def guarded(*args, **kwargs):
        budget = _budget()
        budget.tick()
        value, rest = (args[offset], args[offset + 1:]) if len(args) > offset else (None, ())
        if name in ("join", "sum") and value is not None and not isinstance(value, (list, tuple)):
            value = _materialize(value)  # a generator is read once: read it here, counted
            args = (*args[:offset], value, *rest)
        if name == "join":
            sep = rest[0] if rest else kwargs.get("d", "")
            budget.room(_estimate("join", str(sep), (value,), {}), "the result of filter 'join'")
        elif name == "sum" and isinstance(kwargs.get("start", rest[1] if len(rest) > 1 else 0), (list, tuple, str)):
            total = sum(_size(x) for x in value or ())  # sums of sequences copy: n pieces cost n * total
            budget.room(total * len(value or ()), "the result of filter 'sum'")
        elif name == "tojson":
            indent = kwargs.get("indent", rest[1] if len(rest) > 1 else None)
            width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
            if width > 64:  # added once per nesting level to every line of the output
                raise ChatTemplateError(f"chat template asks tojson for an indent of {width}")
        else:
            budget.room(_estimate(name, value, rest, kwargs), f"the result of filter '{name}'")
        return _check_value(func(*args, **kwargs), f"the result of filter '{name}'")
    return guarded


def _materialize(iterable: Any) -> list:
    """The items of an iterable as a list: a generator's read through the loop guard (it may be endless)."""
    if isinstance(iterable, (str, bytes, dict, set, frozenset)):
        return list(iterable)
    return list(_loop(None, iterable))


@pass_context
def _loop(context, iterable):
    """Every {% for %} iterates through this: each step counts against the budget."""
    budget = _budget()
    if isinstance(iterable, GuardedRange):  # counted here, not twice
        iterable = iterable._range
    for item in iterable:
        budget.iterate()
        yield item


@pass_context
def _concat(context, values):
    """The '~' operator: the pieces are joined only while their sum fits."""
    budget, pieces, size = _budget(), [], 0
    for value in values:
        pieces.append(str(value))
        size += len(pieces[-1])
        budget.room(size, "a joined string")
    return "".join(pieces)


@pass_context
def _emit(context, value):
    """Every piece of text a template emits, into the output or into a block it captures."""
    text = str(value)
    _budget().emit(len(text))
    return text


class _Guards(NodeTransformer):
    """Rewrites a parsed template so that loops, '~' and emitted text pass through the guard filters."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _LOOP, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), _CONCAT, [], [], None, None,
                            lineno=node.lineno)

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        node = self.generic_visit(node)
        node.nodes = [nodes.Filter(nodes.Const(n.data, lineno=n.lineno) if isinstance(n, nodes.TemplateData) else n,
                                   _EMIT, [], [], None, None, lineno=n.lineno) for n in node.nodes]
        return node


class GuardedRange(Sequence):
    """range() for templates: any length, but iterating it counts against the budget (jinja's own range
    refuses more than 100000 items with an OverflowError, which a server reports as a 500)."""

    def __init__(self, *args: int):
        self._range = range(*args)

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index):
        item = self._range[index]
        return GuardedRange(item.start, item.stop, item.step) if isinstance(item, range) else item

    def __iter__(self):
        return _loop(None, self._range)

    def __contains__(self, value) -> bool:
        return value in self._range

    def __repr__(self) -> str:
        return repr(self._range)


class GuardedNamespace(Namespace):
    """namespace(): a value set on it ({% set ns.text = ns.text ~ ns.text %}) is checked like any other."""

    def __setitem__(self, name: str, value: Any) -> None:
        _budget().tick()
        super().__setitem__(name, _check_value(value, f"namespace value '{name}'"))


class BoundedTemplate(jinja2.Template):
    """A template whose render runs within a fresh Budget."""

    def render(self, *args: Any, **kwargs: Any) -> str:
        context = dict(*args, **kwargs)
        budget = Budget(deadline=time.monotonic() + MAX_SECONDS, chars=MAX_CHARS + 4 * _volume(context))
        token = _BUDGET.set(budget)
        try:
            return "".join(self.generate(context))
        finally:
            _BUDGET.reset(token)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the budget checked in its hooks (calls, operators, attribute access)."""

    template_class = BoundedTemplate
    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.filters.update({_LOOP: _loop, _CONCAT: _concat, _EMIT: _emit})
        self.globals.pop("lipsum", None)  # paragraphs of filler on demand: nothing a chat needs
        self.globals.update(range=GuardedRange, namespace=GuardedNamespace)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        if len(source) > MAX_SOURCE:
            raise ChatTemplateError(f"chat template is {len(source)} characters long (at most {MAX_SOURCE})")
        tree = _Guards().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's own signature)
        budget = _budget()
        budget.tick()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level iterates through the guard
            args = (_loop(None, args[0]), *args[1:])
        for value in (*args, *kwargs.values()):
            _check_value(value, "a call argument")
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format on access
        target, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if isinstance(target, (str, bytes)):
            if name == "join" and args and not isinstance(args[0], (list, tuple)):
                args = (_materialize(args[0]), *args[1:])  # read once, here, counted
            budget.room(_estimate(name, target, args, kwargs), f"the result of str.{name}")
        return _check_value(super().call(__context, __obj, *args, **kwargs), "the result of a call")

    def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.tick()
        if op == "*" and isinstance(right, (str, bytes, list, tuple)):
            left, right = right, left
        if op == "*" and isinstance(left, (str, bytes, list, tuple)) and isinstance(right, int):
            budget.room(len(left) * max(right, 0), "a repeated sequence", items=isinstance(left, (list, tuple)))
        elif op == "*" and isinstance(left, int) and isinstance(right, int):
            _check_bits(left.bit_length() + right.bit_length())
        elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            _check_bits(abs(left).bit_length() * right)
        elif op == "%" and isinstance(left, str):
            budget.room(_percent_size(left, right), "a formatted string")
        elif op == "+":
            budget.room(_size(left) + _size(right), "a joined sequence", items=isinstance(left, (list, tuple)))
        return _check_value(self.binop_table[op](left, right), "the result of an operator")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().tick()
        return super().getitem(obj, argument)


def _check_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise ChatTemplateError(f"chat template would compute an integer of about {bits} bits "
                                f"(limit {MAX_INT_BITS})")


def compile_chat_template(source: str) -> BoundedTemplate:
    """The template in the environment transformers renders chat templates in (sandboxed, trim_blocks,
    lstrip_blocks, loop controls, raise_exception, tojson, strftime_now), with the budget's guards."""
    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which chat templates do not want
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _guard_filter("tojson", tojson)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"chat template does not parse: {error} (line {error.lineno})") from error
    except (RecursionError, SyntaxError) as error:  # nesting deeper than Python's parser or compiler takes
        raise ChatTemplateError(f"chat template cannot be compiled: {type(error).__name__}: {error}") from error


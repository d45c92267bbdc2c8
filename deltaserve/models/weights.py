"""A model family's checkpoint contract, written once: a table that maps each internal parameter to the
tensors it is made of in a Hugging Face checkpoint and in a GGUF file, through small invertible transforms.

Loading reads the table forwards (`read`: file tensors -> parameter); the writers in `deltaserve.convert`
read it backwards (`write`: parameter -> file tensors). A layout is a tree:

    Leaf(name, shape, fn)    one file tensor of `shape`, through fn (norm + 1, A = -exp(A_log), a head reorder)
    Cat(parts, dim)          the parameter is its parts concatenated along dim (fused projections)
    Stack(parts)             ... stacked along a new first axis (MoE experts)
    Either(options)          alternative layouts of the same parameter: loading takes the first whose
                             tensors are all in the file, writing always writes the first

Every transform has an exact inverse (permutations, reshapes, +1 / -1, exp / log), so a checkpoint
written from a model and read again gives the same parameters (bit-exact up to the float32 rounding of
exp / log and +1 / -1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from deltaserve.errors import ModelLoadError

# -- transforms -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fn:
    """An invertible map of one tensor: forward (file -> parameter) and inverse (parameter -> file)."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    inverse: Callable[[torch.Tensor], torch.Tensor]
    name: str = "fn"
    # Set when the map only reorders whole slices along this axis (0: rows, 1: columns) and works at any
    # size of the other axes: weights kept in quantised blocks can then be reordered without decoding.
    axis: int | None = None

    def __rshift__(self, then: Fn) -> Fn:
        """self, then `then` (the inverse runs the other way round)."""
        if self is IDENTITY or then is IDENTITY:
            return then if self is IDENTITY else self
        return Fn(lambda t: then.forward(self.forward(t)), lambda t: self.inverse(then.inverse(t)),
                  f"{self.name} >> {then.name}", self.axis if self.axis == then.axis else None)


IDENTITY = Fn(lambda t: t, lambda t: t, "identity")
PLUS_ONE = Fn(lambda t: t + 1, lambda t: t - 1, "+1")  # zero-centred RMSNorm weights: the multiplier is 1 + w
NEG_EXP = Fn(lambda t: -torch.exp(t), lambda t: torch.log(-t), "-exp")  # A = -exp(A_log)


def reshape(file_shape: Sequence[int], shape: Sequence[int]) -> Fn:
    """A tensor stored as file_shape, held as shape (conv [C, 1, W] -> [C, W], kv_b rows -> [nh, d, R])."""
    file_shape, shape = tuple(file_shape), tuple(shape)
    if file_shape == shape:
        return IDENTITY
    return Fn(lambda t: t.reshape(shape), lambda t: t.reshape(file_shape), f"reshape{list(shape)}")


def transpose(d0: int, d1: int) -> Fn:
    return Fn(lambda t: t.transpose(d0, d1).contiguous(), lambda t: t.transpose(d0, d1).contiguous(),
              f"transpose({d0}, {d1})")


def _on_slice(fn: Callable[[torch.Tensor], torch.Tensor], dim: int, start: int) -> Callable:
    """fn applied to the part of a tensor from `start` on along dim, the rest left as it is."""
    if start == 0:
        return fn
    return lambda t: torch.cat([t.narrow(dim, 0, start), fn(t.narrow(dim, start, t.shape[dim] - start))], dim)


def tiled_heads(dim: int, H: int, r: int, head: int, start: int = 0) -> Fn:
    """Value heads along `dim` (from `start` on) stored tiled (head j reads key head j % H, ggml's broadcast
    order) and held grouped (j // r, transformers' order)."""
    if r == 1:
        return IDENTITY

    def grouped(t):  # [.., r, H, head, ..] -> [.., H, r, head, ..]
        return t.unflatten(dim, (r, H, head)).transpose(dim, dim + 1).flatten(dim, dim + 2)

    def tiled(t):
        return t.unflatten(dim, (H, r, head)).transpose(dim, dim + 1).flatten(dim, dim + 2)
    return Fn(_on_slice(grouped, dim, start), _on_slice(tiled, dim, start), "tiled->grouped", dim)


def per_head(heads: int, sizes: Sequence[int], stop: int | None = None) -> Fn:
    """Rows stored per head as [part0 | part1 | ..] (Qwen's q_proj [query | gate], Qwen3-Next's in_proj_qkvz),
    held part by part with all heads' rows together: [all part0 | all part1 | ..]. Only the first
    heads * sum(sizes) rows take part when `stop` says the tensor goes on."""
    sizes = list(sizes)
    if heads == 1 or len(sizes) == 1:
        return IDENTITY
    n = heads * sum(sizes)

    def grouped(t):
        head, rest = t[:n], t[n:]
        parts = head.reshape(heads, sum(sizes), *t.shape[1:]).split(sizes, dim=1)
        return torch.cat([p.reshape(heads * s, *t.shape[1:]) for p, s in zip(parts, sizes)] + [rest])

    def interleaved(t):
        head, rest = t[:n], t[n:]
        parts = [p.reshape(heads, s, *t.shape[1:]) for p, s in zip(head.split([heads * s for s in sizes]), sizes)]
        return torch.cat([torch.cat(parts, dim=1).reshape(n, *t.shape[1:]), rest])
    return Fn(grouped, interleaved, f"per_head({heads}, {sizes})", 0)


# -- layouts ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    name: str
    shape: tuple[int, ...]
    fn: Fn = IDENTITY


@dataclass(frozen=True)
class Cat:
    parts: tuple[Layout, ...]
    dim: int = 0


@dataclass(frozen=True)
class Stack:
    parts: tuple[Layout, ...]


@dataclass(frozen=True)
class Either:
    options: tuple[Layout, ...]


Layout = Leaf | Cat | Stack | Either


def leaf(name: str, *shape: int, fn: Fn = IDENTITY) -> Leaf:
    return Leaf(name, tuple(shape), fn)


def cat(*parts: Layout, dim: int = 0) -> Layout:
    return parts[0] if len(parts) == 1 else Cat(tuple(parts), dim)


def stack(parts: Sequence[Layout]) -> Stack:
    return Stack(tuple(parts))


def either(*options: Layout) -> Layout:
    return options[0] if len(options) == 1 else Either(tuple(options))


@dataclass(frozen=True)
class Param:
    """One internal parameter and its layouts in each format (None: the format does not carry it)."""

    name: str
    hf: Layout | None
    gguf: Layout | None


def names(layout: Layout) -> list[str]:
    """The file tensors of a layout (of each Either's first option: what writers write)."""
    if isinstance(layout, Leaf):
        return [layout.name]
    if isinstance(layout, Either):
        return names(layout.options[0])
    return [n for p in layout.parts for n in names(p)]


def available(layout: Layout, has: Callable[[str], bool]) -> bool:
    """Whether a file whose tensors `has` tells holds the layout (some option of each Either)."""
    if isinstance(layout, Leaf):
        return has(layout.name)
    if isinstance(layout, Either):
        return any(available(o, has) for o in layout.options)
    return all(available(p, has) for p in layout.parts)


def chosen(layout: Layout, has: Callable[[str], bool]) -> Layout:
    """The layout with each Either resolved to its first option whose tensors are all present (else its
    first, so that a missing tensor is named by the layout writers use)."""
    if isinstance(layout, Either):
        option = next((o for o in layout.options if available(o, has)), layout.options[0])
        return chosen(option, has)
    if isinstance(layout, (Cat, Stack)):
        return replace(layout, parts=tuple(chosen(p, has) for p in layout.parts))
    return layout


def shape_of(layout: Layout) -> tuple[int, ...]:
    """The parameter's shape, found by running the transforms on meta tensors."""
    if isinstance(layout, Leaf):
        return tuple(layout.fn.forward(torch.empty(layout.shape, device="meta")).shape)
    if isinstance(layout, Either):
        return shape_of(layout.options[0])
    shapes = [shape_of(p) for p in layout.parts]
    if isinstance(layout, Stack):
        return (len(shapes), *shapes[0])
    out = list(shapes[0])
    out[layout.dim] = sum(s[layout.dim] for s in shapes)
    return tuple(out)


# -- reading and writing ----------------------------------------------------------------------------


def read(layout: Layout, ckpt):
    """The parameter from an opened checkpoint: float32, or `Rows` (read a block of rows at a time) where
    a large 2-D tensor passes through unchanged (see models.common.Rows)."""
    from deltaserve.models.common import dense, fetch, fetch_rows, stack_rows

    layout = chosen(layout, ckpt.has)
    if isinstance(layout, Leaf):
        if layout.fn is IDENTITY and len(layout.shape) == 2:
            return fetch_rows(ckpt, layout.name, *layout.shape)
        return layout.fn.forward(fetch(ckpt, layout.name, *layout.shape))
    parts = [read(p, ckpt) for p in layout.parts]
    if isinstance(layout, Stack):
        return torch.stack([dense(p) for p in parts])
    if layout.dim == 0 and all(p.dim() == 2 for p in parts):
        return stack_rows(parts)
    return torch.cat([dense(p) for p in parts], dim=layout.dim)


def write(layout: Layout, x: torch.Tensor, option: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The file tensors (name, tensor) that hold parameter x in this layout: each Either's first option
    (option=-1: its last, the older or rarer layout a reader must also accept)."""
    if isinstance(layout, Either):
        yield from write(layout.options[option], x, option)
        return
    if isinstance(layout, Leaf) and tuple(x.shape) != shape_of(layout):
        raise ModelLoadError("writer", f"parameter of shape {list(x.shape)} does not fit its layout "
                                       f"{list(shape_of(layout))}", tensor=names(layout)[0])
    if isinstance(layout, Leaf):
        yield layout.name, layout.fn.inverse(x).contiguous()
    elif isinstance(layout, Stack):
        for part, xi in zip(layout.parts, x.unbind(0)):
            yield from write(part, xi, option)
    else:
        sizes = [shape_of(p)[layout.dim] for p in layout.parts]
        for part, xi in zip(layout.parts, x.split(sizes, dim=layout.dim)):
            yield from write(part, xi, option)


def load_params(table: Sequence[Param], ckpt, fmt: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(internal name, tensor or Rows) for each parameter of `table`, read from ckpt in format fmt
    ("hf" or "gguf")."""
    for p in table:
        layout = getattr(p, fmt)
        if layout is None:
            raise ModelLoadError(ckpt.path, f"parameter {p.name} has no {fmt} layout")
        yield p.name, read(layout, ckpt)


def file_tensors(table: Sequence[Param], params, fmt: str, option: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(file name, tensor) for every tensor that format fmt stores, from params (internal name -> tensor,
    a dict or anything indexable; only the parameters of `table` are read, in its order). option: which
    option of each Either (see write)."""
    for p in table:
        layout = getattr(p, fmt)
        if layout is not None:
            yield from write(layout, params[p.name].detach().float(), option)

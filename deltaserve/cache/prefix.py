"""Prefix store: checkpoints of token prefixes that every sequence slot can restore, in a byte budget.

A trie of blocks of `interval` tokens, keyed by their token ids. The block that ends at position p
holds the KV rows of its own tokens, so the blocks from the root rebuild the KV cache of the whole
prefix in any slot, and the recurrent state (conv and delta-rule, every layer) after p tokens.
Between block boundaries a `Mark` hangs off a block (or the root): the few tokens after it with their KV
rows and the recurrent state after them. Marks sit where conversations diverge (where an assistant turn
starts, the end of a prompt, the end of an answer), so a prompt that leaves the cached tokens there
restores all it shares instead of the last block boundary before it.
While the slot that took a checkpoint still holds its prefix, the checkpoint's KV rows are views of that
slot's cache (a long prompt's checkpoints would otherwise copy its whole KV cache); they are copied out,
and counted, when the slot is about to write over them (`detach`).
Over budget, the least recently used checkpoint goes first: a mark or a leaf is dropped whole, an inner
block only drops its recurrent state (the blocks and marks below it still need its KV rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from deltaserve.errors import DeltaserveError

from deltaserve.models.state import RecurrentCopy

KV = tuple[list[torch.Tensor | None], list[torch.Tensor | None]]  # keys, values per attention layer


@dataclass(eq=False)
class Block:
    tokens: tuple[int, ...]  # the block's own tokens
    end: int  # prefix length after this block
    parent: Block | None
    k: list[torch.Tensor | None]  # per attention layer: [interval, n_kv, head_dim] keys of these tokens
    v: list[torch.Tensor | None]
    recurrent: RecurrentCopy | None  # the state after `end` tokens; None once evicted
    children: dict[tuple[int, ...], Block] = field(default_factory=dict)
    marks: dict[tuple[int, ...], Mark] = field(default_factory=dict)  # keyed by their tail tokens
    last_used: int = 0

    def nbytes(self) -> int:
        return _kv_bytes(self.k, self.v) + (self.recurrent.nbytes() if self.recurrent is not None else 0)


@dataclass(eq=False)
class Mark:
    """A checkpoint between block boundaries: `block`'s prefix, then `tail` (shorter than a block)."""

    block: Block
    tail: tuple[int, ...]
    k: list[torch.Tensor | None]  # per attention layer: [len(tail), n_kv, head_dim] keys of the tail
    v: list[torch.Tensor | None]
    recurrent: RecurrentCopy  # the state after `end` tokens
    last_used: int = 0

    @property
    def end(self) -> int:
        return self.block.end + len(self.tail)

    def nbytes(self) -> int:
        return _kv_bytes(self.k, self.v) + self.recurrent.nbytes()


def _kv_bytes(k, v) -> int:
    """Bytes of the KV rows a checkpoint owns: rows still viewed in a slot's cache cost nothing extra."""
    return sum(t.numel() * t.element_size() for t in k + v if t is not None and t._base is None)


class PrefixStore:
    def __init__(self, interval: int, budget_bytes: int):
        if interval < 1 or budget_bytes < 0:
            raise DeltaserveError(f"prefix store needs interval >= 1 and budget >= 0, got {interval} and {budget_bytes}")
        self.interval, self.budget = interval, budget_bytes
        self.root = Block((), 0, None, [], [], None)
        self.blocks: set[Block] = set()
        self.nbytes = 0
        self._clock = 0

    @property
    def checkpoints(self) -> int:
        return sum(b.recurrent is not None for b in self.blocks) + len(self.marks())

    def marks(self) -> list[Mark]:
        return [m for b in (self.root, *self.blocks) for m in b.marks.values()]

    def checkpoint_path(self, tokens: Sequence[int], limit: int) -> list[Block]:
        """The blocks from the root to the deepest checkpoint (a block with a recurrent state) of a prefix
        of `tokens` no longer than `limit`; [] when there is none."""
        path = self._path(tokens[:limit])
        while path and path[-1].recurrent is None:
            path.pop()
        return path

    def put(self, tokens: Sequence[int], read_kv: Callable[[int, int], KV],
            read_recurrent: Callable[[], RecurrentCopy]) -> None:
        """Checkpoint the prefix `tokens` (a multiple of interval long). read_kv(start, end) gives the KV
        rows of positions [start, end) for the blocks not stored yet; read_recurrent() the state after it."""
        if not tokens or len(tokens) % self.interval:
            raise DeltaserveError(f"checkpoints sit every {self.interval} tokens, not after {len(tokens)}")
        path = self._blocks(tokens, read_kv)
        node = path[-1]
        if node.recurrent is None:
            node.recurrent = read_recurrent()
            self.nbytes += node.recurrent.nbytes()
        self.touch(path)
        self.enforce_budget()

    def put_mark(self, tokens: Sequence[int], read_kv: Callable[[int, int], KV],
                 read_recurrent: Callable[[], RecurrentCopy]) -> None:
        """Checkpoint the prefix `tokens` of any length: at a block boundary as `put` does, else as a mark."""
        if len(tokens) % self.interval == 0:
            if tokens:
                self.put(tokens, read_kv, read_recurrent)
            return
        full = len(tokens) - len(tokens) % self.interval
        path = self._blocks(tokens[:full], read_kv) if full else []
        block, tail = (path[-1] if path else self.root), tuple(tokens[full:])
        if tail not in block.marks:
            mark = Mark(block, tail, *read_kv(full, len(tokens)), read_recurrent())
            block.marks[tail] = mark
            self.nbytes += mark.nbytes()
        self.touch(path + [block.marks[tail]])
        self.enforce_budget()

    def best_mark(self, tokens: Sequence[int], limit: int) -> tuple[list[Block], Mark] | None:
        """The deepest mark on the path of `tokens` that ends by `limit`, with the blocks that lead to it."""
        path, best = self._path(tokens[:limit]), None
        for depth, block in enumerate([self.root, *path]):
            for tail, mark in block.marks.items():
                fits = mark.end <= limit and tuple(tokens[block.end:mark.end]) == tail
                if fits and (best is None or mark.end > best[1].end):
                    best = (path[:depth], mark)
        return best

    def _blocks(self, tokens: Sequence[int], read_kv: Callable[[int, int], KV]) -> list[Block]:
        """The blocks of `tokens` (a multiple of interval long) from the root, those missing made with their
        KV rows only."""
        n, path = self.interval, self._path(tokens)
        node = path[-1] if path else self.root
        while node.end < len(tokens):
            key = tuple(tokens[node.end:node.end + n])
            child = Block(key, node.end + n, node, *read_kv(node.end, node.end + n), None)
            node.children[key] = child
            self.blocks.add(child)
            self.nbytes += child.nbytes()
            path.append(node := child)
        return path

    def _path(self, tokens: Sequence[int]) -> list[Block]:
        """Stored blocks matching whole blocks of `tokens`, from the root down."""
        path, node, n = [], self.root, self.interval
        while node.end + n <= len(tokens):
            node = node.children.get(tuple(tokens[node.end:node.end + n]))
            if node is None:
                break
            path.append(node)
        return path

    def touch(self, path: list[Block | Mark]) -> None:
        """Mark the blocks (and marks) of a path used (a restore, a new checkpoint)."""
        for block in path:  # deeper blocks count as more recent: their state saves more work
            self._clock += 1
            block.last_used = self._clock

    def detach(self, overwritten: Callable[[torch.Tensor], bool]) -> None:
        """Give every checkpoint whose KV rows are views (see CacheManager) for which `overwritten(view)` holds
        its own copy of them, counted from now on (then the budget may evict others)."""
        holders = [*self.blocks, *self.marks()]
        for h in holders:
            for rows in (h.k, h.v):
                for i, t in enumerate(rows):
                    if t is not None and t._base is not None and overwritten(t):
                        rows[i] = t.clone()
                        self.nbytes += t.numel() * t.element_size()
        self.enforce_budget()

    def clear(self) -> None:
        self.root = Block((), 0, None, [], [], None)
        self.blocks, self.nbytes = set(), 0

    def enforce_budget(self) -> None:
        """Evict least recently used checkpoints until the store fits its budget."""
        while self.nbytes > self.budget:
            candidates = [b for b in self.blocks if b.recurrent is not None or not (b.children or b.marks)]
            victim = min(candidates + self.marks(), key=lambda b: b.last_used)
            if isinstance(victim, Mark):
                self.nbytes -= victim.nbytes()
                del victim.block.marks[victim.tail]
                if victim.block is not self.root and not self._needed(victim.block):
                    self._remove(victim.block)
            elif victim.children or victim.marks:  # an inner block: those below still need its KV rows
                self.nbytes -= victim.recurrent.nbytes()
                victim.recurrent = None
            else:
                self._remove(victim)

    @staticmethod
    def _needed(block: Block) -> bool:
        return bool(block.children or block.marks or block.recurrent is not None)

    def _remove(self, leaf: Block) -> None:
        """Drop a leaf, then each parent left with neither children nor a state."""
        while True:
            parent = leaf.parent
            self.nbytes -= leaf.nbytes()
            self.blocks.remove(leaf)
            del parent.children[leaf.tokens]
            if parent is self.root or self._needed(parent):
                return
            leaf = parent

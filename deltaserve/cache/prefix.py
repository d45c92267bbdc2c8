"""Prefix store: checkpoints of token prefixes that every sequence slot can restore, in a byte budget.

A trie of blocks of `interval` tokens, keyed by their token ids. The block that ends at position p
holds the KV rows of its own tokens, so the blocks from the root rebuild the KV cache of the whole
prefix in any slot, and the recurrent state (conv and delta-rule, every layer) after p tokens.
Over budget, the least recently used block goes first: a leaf is dropped whole, an inner block only
drops its recurrent state (the blocks below it still need its KV rows).
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
    last_used: int = 0

    def nbytes(self) -> int:
        kv = sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)
        return kv + (self.recurrent.nbytes() if self.recurrent is not None else 0)


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
        return sum(b.recurrent is not None for b in self.blocks)

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
        n = self.interval
        if not tokens or len(tokens) % n:
            raise DeltaserveError(f"checkpoints sit every {n} tokens, not after {len(tokens)}")
        path = self._path(tokens)
        node = path[-1] if path else self.root
        while node.end < len(tokens):  # blocks missing above the checkpoint keep only their KV rows
            key = tuple(tokens[node.end:node.end + n])
            child = Block(key, node.end + n, node, *read_kv(node.end, node.end + n), None)
            node.children[key] = child
            self.blocks.add(child)
            self.nbytes += child.nbytes()
            path.append(node := child)
        if node.recurrent is None:
            node.recurrent = read_recurrent()
            self.nbytes += node.recurrent.nbytes()
        self.touch(path)
        self._evict()

    def _path(self, tokens: Sequence[int]) -> list[Block]:
        """Stored blocks matching whole blocks of `tokens`, from the root down."""
        path, node, n = [], self.root, self.interval
        while node.end + n <= len(tokens):
            node = node.children.get(tuple(tokens[node.end:node.end + n]))
            if node is None:
                break
            path.append(node)
        return path

    def touch(self, path: list[Block]) -> None:
        """Mark the blocks of a path used (a restore, a new checkpoint)."""
        for block in path:  # deeper blocks count as more recent: their state saves more work
            self._clock += 1
            block.last_used = self._clock

    def _evict(self) -> None:
        while self.nbytes > self.budget:
            victim = min((b for b in self.blocks if b.recurrent is not None or not b.children),
                         key=lambda b: b.last_used)
            if victim.children:  # an inner block: the blocks below still need its KV rows
                self.nbytes -= victim.recurrent.nbytes()
                victim.recurrent = None
            else:
                self._remove(victim)

    def _remove(self, leaf: Block) -> None:
        """Drop a leaf, then each parent left with neither children nor a state."""
        while True:
            parent = leaf.parent
            self.nbytes -= leaf.nbytes()
            self.blocks.remove(leaf)
            del parent.children[leaf.tokens]
            if parent is self.root or parent.children or parent.recurrent is not None:
                return
            leaf = parent

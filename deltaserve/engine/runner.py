"""ModelRunner: feeds token chunks to the model over the cache manager's slots.

Forward passes stop at checkpoint positions (every `checkpoint_interval` tokens of a slot) so the
manager can save the recurrent state there; `verify` runs draft tokens in one pass that keeps a
snapshot after each of them, and `rollback` keeps the accepted ones.
"""

from __future__ import annotations

import torch

from deltaserve.cache.manager import CacheManager
from deltaserve.models.state import HybridState


class ModelRunner:
    def __init__(self, model, n_slots: int = 1, max_len: int = 4096, checkpoint_interval: int = 512,
                 cache_budget_mb: float = 1024.0, mtp: bool = False):
        """mtp: the slots carry the model's MTP layer's cache too, for speculative 'mtp' (engine/mtp_draft.py)."""
        self.model = model
        self.cache = CacheManager(model, n_slots, max_len, checkpoint_interval, cache_budget_mb, mtp=mtp)

    @property
    def state(self) -> HybridState:
        return self.cache.state

    @property
    def history(self) -> list[list[int]]:
        return self.cache.history

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def n_slots(self) -> int:
        return self.cache.n_slots

    @property
    def can_rollback(self) -> bool:
        """Whether the model keeps per-token snapshots (forward(..., snapshots=K)), which `verify` needs."""
        return getattr(self.model, "supports_snapshots", False)

    def free_slots(self) -> int:
        return self.cache.free_slots()

    def acquire(self, prompt: list[int], marks: tuple[int, ...] = ()) -> tuple[int, int]:
        """A free slot for `prompt` and how many of its tokens that slot already holds (from its live state
        or a checkpoint of the prefix store). marks: positions to checkpoint on the way (CacheManager)."""
        return self.cache.acquire(prompt, marks=marks)

    def rebuild(self, slot: int, tokens: list[int]) -> int:
        """Set the reset slot `slot` (still held) up for `tokens` from the newest checkpoint on their path;
        how many of them it now holds (at most all but the last)."""
        return self.cache.acquire(tokens, slot=slot)[1]

    def fork(self, slot: int) -> int:
        """A free slot, now busy, holding a copy of `slot`'s state and tokens."""
        return self.cache.fork(slot)

    def release(self, slot: int, checkpoint: bool = False) -> None:
        self.cache.release(slot, checkpoint)

    def reset(self, slot: int) -> None:
        self.cache.reset(slot)

    def room(self, slot: int) -> int:
        """Tokens the slot can still take."""
        return self.cache.room(slot)

    def forward(self, slots: list[int], tokens: list[list[int]], logits: str = "last") -> torch.Tensor:
        """Feed tokens[i] (all rows the same length) to slots[i]; float32 logits [N, V] (or [N, T, V]).
        The pass is cut wherever a row reaches a checkpoint position, and the checkpoint saved."""
        T = len(tokens[0])
        cuts = sorted({c for s in slots for c in self.cache.boundaries(s, T)} | {T})
        outs, begin = [], 0
        self.state.snapshots = None  # these passes change the slots: older snapshots no longer apply
        for end in cuts:
            piece = [t[begin:end] for t in tokens]
            outs.append(self.model(torch.tensor(piece, dtype=torch.long), self.state,
                                   torch.tensor(slots, dtype=torch.long), logits=logits))
            self.cache.advance(slots, piece)
            begin = end
        return outs[-1] if logits == "last" else torch.cat(outs, dim=1)

    def verify(self, slots: list[int], tokens: list[list[int]]) -> torch.Tensor:
        """Feed tokens[i] (all rows the same length T) to slots[i] in one pass that keeps the state after each
        token; float32 logits [N, T, V]. Follow with `rollback` for every row."""
        T = len(tokens[0])
        out = self.model(torch.tensor(tokens, dtype=torch.long), self.state, torch.tensor(slots, dtype=torch.long),
                         logits="all", snapshots=T)
        self.cache.advance(slots, tokens, checkpoint=False)
        return out

    def mtp_step(self, slots: list[int], pending: list[int], ks: list[int]) -> list[tuple[list[int], list[int]]] | None:
        """A greedy speculative step with the model's MTP drafts in one call (HybridModel.mtp_greedy_step): slot
        slots[i] with pending token pending[i] drafts ks[i] >= 1 tokens, which the model verifies; it keeps the
        pending token and the accepted drafts. Per slot (its drafts, the tokens verification produced: the
        accepted drafts and the model's next token); None where the model has no such call or the pass would
        reach a checkpoint position (saved from a verify pass's snapshots: the caller then drafts and verifies)."""
        if any(self.cache.boundaries(s, 1 + max(ks)) for s in slots):
            return None
        out = self.model.mtp_greedy_step(self.state, torch.tensor(slots, dtype=torch.long),
                                         torch.tensor(pending, dtype=torch.long), ks)
        if out is None:
            return None
        drafts, accepted, following = (t.tolist() for t in out)
        self.cache.advance(slots, [[p, *d[:a]] for p, d, a in zip(pending, drafts, accepted)])
        return [(d[:k], [*d[:a], f]) for d, k, a, f in zip(drafts, ks, accepted, following)]

    def rollback(self, slot: int, length: int) -> None:
        """After `verify`: keep the slot's first `length` tokens (at least those before the verified ones
        and the first of them), without recompute."""
        self.cache.rollback(slot, length)

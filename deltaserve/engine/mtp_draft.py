"""Drafts from the model's own multi-token-prediction layer (`--spec mtp`; models/mtp.py).

The layer's KV cache and the trunk's last hidden state live in the runner's own state, one more entry after
the trunk's layers, which every forward pass extends and every rollback, reset and prefix checkpoint keeps
in step with the trunk. Drafting reads that state (models/mtp.draft): the first draft token comes from the trunk's
hidden state after the slot's last token and the pending token, each further one from the layer's own output and
the token it just drafted (k = 1..4 chained steps over every drafting slot, in one C++ call where the model has
one). The draft steps write the layer's cache at the drafted positions, which the verifying pass writes again.
"""

from __future__ import annotations

import torch

from deltaserve.errors import DeltaserveError
from deltaserve.models.mtp import draft, has_mtp


class MTPDrafter:
    """Greedy chained drafts of the runner's model's MTP layer (see the module's docstring)."""

    def __init__(self, runner):
        if getattr(runner.model, "mtp", None) is None:
            raise DeltaserveError("speculative 'mtp': the model has no multi-token-prediction layer (its checkpoint "
                                  "carries no mtp.* tensors, or no GGUF blk.N.nextn.* block after the trunk)")
        if not has_mtp(runner.model, runner.state):
            raise DeltaserveError("speculative 'mtp' needs a runner made with mtp=True (the MTP layer's cache)")
        self.runner = runner

    def propose(self, slots: list[int], contexts: list[list[int]], ks: list[int]) -> list[list[int]]:
        state, model = self.runner.state, self.runner.model
        for s, ctx in zip(slots, contexts):  # the slot holds every token of the context but its last
            if int(state.lengths[s]) != len(ctx) - 1:
                raise DeltaserveError(f"mtp drafter: slot {s} holds {int(state.lengths[s])} tokens, but its "
                                      f"context has {len(ctx)}")
        ids = torch.tensor([ctx[-1] for ctx in contexts], dtype=torch.long)
        return draft(model, state, torch.tensor(slots, dtype=torch.long), ids, ks)

    def step(self, slots: list[int], pending: list[int], ks: list[int]) -> list[tuple[list[int], list[int]]] | None:
        """Draft, verify and keep in one call for greedy sequences, where the model has one (ModelRunner.mtp_step):
        per slot (drafts, tokens produced), or None (propose, then the scheduler verifies)."""
        return self.runner.mtp_step(slots, pending, ks)

    def reset(self, slots: list[int]) -> None:
        pass  # it keeps nothing of its own: its cache is the runner's state

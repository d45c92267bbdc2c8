"""ModelRunner: owns the model, its per-slot state, and which tokens each slot's state holds."""

from __future__ import annotations

import torch


class ModelRunner:
    def __init__(self, model, n_slots: int = 1, max_len: int = 4096):
        self.model = model
        self.state = model.new_state(n_slots, max_len)
        self.max_len = self.state.max_len or max_len
        self.history: list[list[int]] = [[] for _ in range(n_slots)]  # tokens whose effect each slot holds
        self.busy = [False] * n_slots
        self._last_used = [0] * n_slots
        self._clock = 0

    @property
    def n_slots(self) -> int:
        return len(self.busy)

    def free_slots(self) -> int:
        return self.busy.count(False)

    def acquire(self, prompt: list[int]) -> tuple[int, int]:
        """A free slot for `prompt` and how many of its tokens that slot already holds. A slot whose history
        the prompt extends continues from its live state; otherwise the least recently used one starts over."""
        free = [s for s in range(self.n_slots) if not self.busy[s]]

        def reusable(s):
            h = self.history[s]
            return len(h) if len(h) < len(prompt) and prompt[:len(h)] == h else -1

        slot = max(free, key=lambda s: (reusable(s), -self._last_used[s]))
        if reusable(slot) <= 0:
            slot = min(free, key=lambda s: self._last_used[s])
            self.reset(slot)
        self.busy[slot] = True
        return slot, len(self.history[slot])

    def release(self, slot: int) -> None:
        """The slot is free again; its state stays, so a prompt that extends it can continue from it."""
        self.busy[slot] = False
        self._clock += 1
        self._last_used[slot] = self._clock

    def reset(self, slot: int) -> None:
        self.state.reset([slot])
        self.history[slot] = []

    def room(self, slot: int) -> int:
        """Tokens the slot can still take."""
        return self.max_len - len(self.history[slot])

    def forward(self, slots: list[int], tokens: list[list[int]], logits: str = "last") -> torch.Tensor:
        """Feed tokens[i] (all rows the same length) to slots[i]; float32 logits [N, V] (or [N, T, V])."""
        x = torch.tensor(tokens, dtype=torch.long)
        out = self.model(x, self.state, torch.tensor(slots, dtype=torch.long), logits=logits)
        for s, t in zip(slots, tokens):
            self.history[s].extend(t)
        return out

"""Per-slot decoding state of a hybrid model: one slot per sequence, every tensor indexed by slot first.

Recurrent layers keep the last W-1 inputs of their short convolution and the delta-rule state;
attention layers keep a fixed-length KV cache. `lengths` counts the tokens each slot has consumed,
which is also the position of its next token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deltaserve.errors import DeltaserveError


@dataclass
class HybridState:
    conv: list[torch.Tensor | None]  # per layer: [n_slots, W-1, conv_dim] on recurrent layers, else None
    ssm: list[torch.Tensor | None]  # per layer: [n_slots, HV, K, V] float32 on recurrent layers
    k: list[torch.Tensor | None]  # per layer: [n_slots, max_len, n_kv, head_dim] on attention layers
    v: list[torch.Tensor | None]  # per layer: [n_slots, max_len, n_kv, v_head_dim] on attention layers
    lengths: torch.Tensor  # [n_slots] int64

    @classmethod
    def allocate(cls, recurrent: Sequence[bool], n_slots: int, max_len: int, *, conv: tuple[int, int],
                 ssm: tuple[int, int, int], k: tuple[int, int], v: tuple[int, int],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> HybridState:
        """Zeroed state. conv = (W-1, conv_dim), ssm = (HV, K, V), k/v = (n_kv, head_dim) per token."""
        if n_slots < 1 or max_len < 1:
            raise DeltaserveError(f"state needs n_slots >= 1 and max_len >= 1, got {n_slots} and {max_len}")

        def zeros(*shape, dtype=dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            conv=[zeros(n_slots, *conv) if r else None for r in recurrent],
            ssm=[zeros(n_slots, *ssm, dtype=torch.float32) if r else None for r in recurrent],
            k=[None if r else zeros(n_slots, max_len, *k) for r in recurrent],
            v=[None if r else zeros(n_slots, max_len, *v) for r in recurrent],
            lengths=zeros(n_slots, dtype=torch.long),
        )

    @property
    def n_slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        """Tokens a slot can hold (unbounded, reported as 0, for a model without attention layers)."""
        return next((t.shape[1] for t in self.k if t is not None), 0)

    def tensors(self) -> list[torch.Tensor]:
        return [t for group in (self.conv, self.ssm, self.k, self.v) for t in group if t is not None]

    def reset(self, slots: Sequence[int] | torch.Tensor | None = None) -> None:
        """Forget the sequences in `slots` (all slots when None): zero their tensors and lengths."""
        if slots is None:
            for t in self.tensors():
                t.zero_()
            self.lengths.zero_()
            return
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.lengths.device).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.n_slots):
            raise DeltaserveError(f"reset: slots {idx.tolist()} out of range [0, {self.n_slots})")
        for t in self.tensors():
            t.index_fill_(0, idx.to(t.device), 0)
        self.lengths.index_fill_(0, idx, 0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors() + [self.lengths])

"""Per-slot decoding state of a hybrid model: one slot per sequence, every tensor indexed by slot first.

Recurrent layers keep the last W-1 inputs of their short convolution and the delta-rule state;
attention layers keep a fixed-length KV cache. `lengths` counts the tokens each slot has consumed,
which is also the position of its next token.

The KV cache can be cut to any prefix by lowering `lengths` (rows past it are never read, and are
overwritten before they are read again); the recurrent state summarises the whole prefix and cannot
be cut, so it is copied out (`save_recurrent`) and back in (`load_recurrent`), or taken from the
per-token snapshots a forward pass kept (`rollback`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deltaserve.errors import DeltaserveError
from deltaserve.loader.memory import lazy_zeros


@dataclass
class RecurrentCopy:
    """The conv and delta-rule state of one slot, every recurrent layer, after its first `length` tokens."""

    conv: list[torch.Tensor | None]  # per layer: [W-1, conv_dim] on recurrent layers, else None
    ssm: list[torch.Tensor | None]  # per layer: [HV, K, V] float32
    length: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.ssm if t is not None)


@dataclass
class Snapshots:
    """What one forward pass over T tokens kept for rollback: per row, the delta-rule state after each of
    its last K tokens, newest first (entries older than the pass hold the state before it), and the
    conv inputs from which the conv state after any of its tokens is read."""

    slots: list[int]  # row n of every tensor is slot slots[n]
    lengths: list[int]  # each slot's length right after the pass
    tokens: int  # T, the tokens of the pass
    depth: int  # K
    conv: list[torch.Tensor | None]  # per layer: [N, W-1+T, conv_dim] = [conv state before | conv inputs]
    ssm: list[torch.Tensor | None]  # per layer: [N, K, HV, K, V] float32 on recurrent layers


@dataclass
class HybridState:
    conv: list[torch.Tensor | None]  # per layer: [n_slots, W-1, conv_dim] on recurrent layers, else None
    ssm: list[torch.Tensor | None]  # per layer: [n_slots, HV, K, V] float32 on recurrent layers
    k: list[torch.Tensor | None]  # per layer: [n_slots, max_len, n_kv, head_dim] on attention layers
    v: list[torch.Tensor | None]  # per layer: [n_slots, max_len, n_kv, v_head_dim] on attention layers
    lengths: torch.Tensor  # [n_slots] int64
    snapshots: Snapshots | None = None  # kept by the last forward pass that asked for them

    @classmethod
    def allocate(cls, recurrent: Sequence[bool], n_slots: int, max_len: int, *, conv: tuple[int, int],
                 ssm: tuple[int, int, int], k: tuple[int, int], v: tuple[int, int],
                 dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> HybridState:
        """Zeroed state. conv = (W-1, conv_dim), ssm = (HV, K, V), k/v = (n_kv, head_dim) per token; conv in
        `dtype`, the KV cache in `kv_dtype` (default `dtype`), the delta-rule state float32."""
        if n_slots < 1 or max_len < 1:
            raise DeltaserveError(f"state needs n_slots >= 1 and max_len >= 1, got {n_slots} and {max_len}")

        def zeros(*shape, dtype=dtype):  # on CPU in pages that count only once written
            cpu = torch.device(device).type == "cpu"
            return lazy_zeros(shape, dtype) if cpu else torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            conv=[zeros(n_slots, *conv) if r else None for r in recurrent],
            ssm=[zeros(n_slots, *ssm, dtype=torch.float32) if r else None for r in recurrent],
            k=[None if r else zeros(n_slots, max_len, *k, dtype=kv_dtype or dtype) for r in recurrent],
            v=[None if r else zeros(n_slots, max_len, *v, dtype=kv_dtype or dtype) for r in recurrent],
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
        """Forget the sequences in `slots` (all slots when None): zero their recurrent state, their KV entries
        up to their length, and the length. Attention never reads past a slot's length; zeroing whole slots of
        max_len would make memory resident that the cache otherwise takes only as it fills."""
        if slots is None:
            slots = range(self.n_slots)
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.lengths.device).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.n_slots):
            raise DeltaserveError(f"reset: slots {idx.tolist()} out of range [0, {self.n_slots})")
        for t in self.conv + self.ssm:
            if t is not None:
                t.index_fill_(0, idx.to(t.device), 0)
        for slot, length in zip(idx.tolist(), self.lengths[idx].tolist()):
            for t in self.k + self.v:
                if t is not None:
                    t[slot, :length].zero_()
        self.lengths.index_fill_(0, idx, 0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors() + [self.lengths])

    # ------------------------------------------------------------------ one slot at a time
    def truncate(self, slot: int, length: int) -> None:
        """Cut the slot's KV cache to its first `length` tokens. The recurrent state is left as it is: the
        caller sets it to match (load_recurrent, rollback) or the slot is reset."""
        old = int(self.lengths[slot])
        if not 0 <= length <= old:
            raise DeltaserveError(f"truncate: slot {slot} holds {old} tokens, cannot cut to {length}")
        for t in self.k + self.v:  # past a length the cache holds zeros (see reset)
            if t is not None:
                t[slot, length:old].zero_()
        self.lengths[slot] = length

    def save_recurrent(self, slot: int) -> RecurrentCopy:
        """A copy of the slot's conv and delta-rule states (every recurrent layer) and its length."""
        return RecurrentCopy([None if t is None else t[slot].clone() for t in self.conv],
                             [None if t is None else t[slot].clone() for t in self.ssm], int(self.lengths[slot]))

    def load_recurrent(self, slot: int, saved: RecurrentCopy) -> None:
        """Set the slot's recurrent states to `saved` and its length to saved.length. KV rows up to that
        length must already hold the same tokens (copied in with write_kv, or never changed)."""
        for mine, theirs in zip(self.conv + self.ssm, saved.conv + saved.ssm):
            if mine is not None:
                mine[slot].copy_(theirs)
        self.lengths[slot] = saved.length

    def read_kv(self, slot: int, start: int, end: int, copy: bool = True) -> tuple[list[torch.Tensor | None],
                                                                                  list[torch.Tensor | None]]:
        """The slot's keys and values at positions [start, end), per attention layer [end-start, n_kv, d]:
        copies, or with copy=False views of the cache rows (valid until those rows are written again)."""
        def rows(t):
            return None if t is None else t[slot, start:end].clone() if copy else t[slot, start:end]
        return [rows(t) for t in self.k], [rows(t) for t in self.v]

    def write_kv(self, slot: int, start: int, k: list[torch.Tensor | None], v: list[torch.Tensor | None]) -> None:
        """Put keys and values (as read_kv returns them) at positions start, start+1, ... of the slot."""
        for cache, rows in zip(self.k + self.v, k + v):
            if cache is not None:
                cache[slot, start:start + rows.shape[0]].copy_(rows)

    def rollback(self, slot: int, length: int) -> None:
        """Put the slot back to just after its first `length` tokens, using the snapshots of the last forward
        pass: no recompute. `length` may be any of the last K positions that pass went through."""
        snaps = self.snapshots
        if snaps is None or slot not in snaps.slots:
            raise DeltaserveError(f"rollback: the last forward pass kept no snapshots for slot {slot}")
        row = snaps.slots.index(slot)
        end, now = snaps.lengths[row], int(self.lengths[slot])
        oldest = end - min(snaps.depth - 1, snaps.tokens)
        if now > end or not oldest <= length <= end:
            raise DeltaserveError(f"rollback: slot {slot} can go back to lengths {oldest}..{end} (now at {now}), "
                                  f"not {length}")
        back = end - length  # snapshot index: 0 is the state after the pass's last token
        if back == 0 and now == end:  # every token kept and the slot not moved since: its state is the pass's own
            return
        T = snaps.tokens
        for mine, tape in zip(self.conv, snaps.conv):  # after token t: the W-1 inputs ending at t
            if mine is not None:
                mine[slot].copy_(tape[row, T - back:T - back + mine.shape[1]])
        for mine, kept in zip(self.ssm, snaps.ssm):
            if mine is not None:
                mine[slot].copy_(kept[row, back])
        self.lengths[slot] = length

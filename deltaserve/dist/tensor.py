"""Tensor parallel: every rank holds every layer, a 1/N share of each by heads, columns and experts.

What each family's layers split by is in dist/tensor_plan.py. Each rank's output projections (out_proj,
o_proj, down, its experts) give a partial sum: one all-reduce after each mixer and each MLP or MoE makes it
whole, and the embedding's rows (zero on the ranks that do not hold a token) are summed the same way. The
state splits with the heads (Kimi's MLA latent cache, every head's, is kept whole on every rank). Every rank
runs the same pass on the same tokens (rank 0 broadcasts them); rank 0 gathers the head's vocabulary shards.

Quantised files stay in their blocks: a row share (output features) is whole rows; a column share (input
features of an output projection) must fall on the blocks of 32 or 256 values that share a scale, or the
load stops with an error naming the tensor and the block size (models/packed.take_columns). A fallback that
split such a matrix by rows instead would need its sharded input gathered whole on every rank first and its
output gathered after: two collectives where one all-reduce serves, for a shape that any other --tp avoids.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from deltaserve.dist import group
from deltaserve.dist.spread import SpreadModel, SpreadState, work
from deltaserve.dist.tensor_plan import TRUNK, WHOLE, Share, kv_shared, layer_shares, small_model
from deltaserve.errors import DeltaserveError
from deltaserve.models import packed
from deltaserve.models.base import HybridModel
from deltaserve.models.common import dense, lm_logits
from deltaserve.models.layers import embed_tokens
from deltaserve.models.state import HybridState, Snapshots


class TensorPart:
    """models.common.build's `part` for rank `rank` of `world_size`: the model of 1/N-sized heads and
    columns, and each parameter's share of the file's tensor."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.full = None  # the checkpoint's config, set by cut
        self.shares: dict[str, Share] = {}
        self.kv_shared = False
        self.reduced = self.reductions = 0  # bytes this rank put into all-reduces so far, and how many

    def cut(self, model: HybridModel) -> HybridModel:
        self.full, self.shares, self.kv_shared = model.config, layer_shares(model), kv_shared(model)
        return small_model(model, self.rank, self.world_size)

    def share(self, name: str) -> Share:
        m = re.fullmatch(r"layers\.\d+\.(.+)", name)
        return self.shares.get(m.group(1), WHOLE) if m else TRUNK.get(name, WHOLE)

    def shard(self, name: str, t, block: int = 1, source: str = ""):
        """This rank's share of parameter `name`. t: the whole, float32 or Rows (row shares are sliced from
        Rows, so only this rank's rows are read and widened), or packed in the file's blocks (the share stays
        packed). block: the values that share a scale in the form a float share is then stored in (a Q8_0
        file's 32): a column share must fall on those blocks. source: the file's tensors, for errors."""
        share, n, N = self.share(name), self.rank, self.world_size
        is_packed = packed.is_packed(t)
        shape = t.packing.shape if is_packed else t.shape
        if share.columns:
            K = shape[-1]
            lo, hi = n * K // N, (n + 1) * K // N
            if is_packed:
                return packed.take_columns(t, lo, hi, f"{name} ({source})")
            if (K // N) % block:
                raise DeltaserveError(f"{name} ({source}): --tp {N} gives each rank {K // N} of its {K} columns, "
                                      f"not whole blocks of {block} values sharing a scale; use another --tp or --pp")
            return dense(t)[..., lo:hi]
        if share is WHOLE:
            return t if is_packed else dense(t)
        ranges = share.ranges(n, N, shape[0])
        pad = -(-shape[0] // N) - (ranges[0][1] - ranges[0][0]) if share.vocab else 0
        if is_packed and len(shape) > 2:  # stacked matrices: this rank's experts
            (lo, hi), = ranges
            return packed.take_matrices(t, lo, hi)
        if is_packed:
            return packed.take_rows(t, ranges, pad)
        pieces = [t[a:b] for a, b in ranges] + ([torch.zeros(pad, *shape[1:])] if pad else [])
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


class Summed(nn.Module):
    """A mixer or an MLP whose output (the first of a tuple) is summed over the ranks in place; `part.reduced`
    counts the bytes each rank puts into all-reduces."""

    def __init__(self, inner: nn.Module, part: TensorPart):
        super().__init__()
        self.inner, self.part = inner, part

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        all_reduce(out[0] if isinstance(out, tuple) else out, self.part)
        return out


def all_reduce(t: torch.Tensor, part: TensorPart) -> None:
    dist.all_reduce(t)
    part.reduced += t.numel() * t.element_size()
    part.reductions += 1


def sum_outputs(model: HybridModel, part: TensorPart) -> None:
    """After loading: one all-reduce after each output projection (mixers and MLPs)."""
    for layer in model.layers:
        layer.mixer, layer.ffn = Summed(layer.mixer, part), Summed(layer.ffn, part)


def tp_forward(model: HybridModel, part: TensorPart, ids: torch.Tensor, state: HybridState, slots: torch.Tensor,
               logits: str, snapshots: int) -> torch.Tensor:
    """This rank's share of HybridModel.forward: the same bookkeeping, whole hidden states on every rank,
    and this rank's vocabulary shard of the logits [N, V/N] (or [N, T, V/N])."""
    with torch.inference_mode():
        start = state.lengths[slots]  # [N]
        N, T = ids.shape
        n = len(model.layers)
        snaps = Snapshots(slots.tolist(), (start + T).tolist(), T, snapshots, [None] * n, [None] * n) \
            if snapshots else None
        rope = model.rope(start[:, None] + torch.arange(T))
        per = model.config.vocab_size
        local = ids - part.rank * per
        mine = (local >= 0) & (local < per)
        h = embed_tokens(model.embed.weight, local.clamp(0, per - 1), model.compute_dtype) * mine[..., None]
        all_reduce(h, part)
        h = model.run_layers(h, rope, state, slots, start, snaps, range(n))
        state.lengths[slots] = start + T
        state.snapshots = snaps
        return lm_logits(model, model.norm(h[:, -1] if logits == "last" else h))


class TensorModel(SpreadModel):
    def __init__(self, inner: HybridModel, part: TensorPart, link: group.Link):
        super().__init__(inner, link, part.world_size, config=part.full)
        self.part, self.kv_shared = part, part.kv_shared

    def held(self, rank: int) -> range:
        return range(len(self.inner.layers))

    def local_state(self, n_slots: int, max_len: int) -> HybridState:
        return self.inner.new_state(n_slots, max_len)

    def forward(self, input_ids: torch.Tensor, state: SpreadState, slots=None, logits: str = "last",
                snapshots: int = 0) -> torch.Tensor:
        with torch.inference_mode():
            input_ids, slots = self.checked(input_ids, state, slots, logits)
            with self.link.command("forward", input_ids.tolist(), slots.tolist(), logits, snapshots):
                mine = tp_forward(self.inner, self.part, input_ids, state.local, slots, logits, snapshots)
                shards = [torch.empty_like(mine) for _ in range(self.world_size)]
                dist.gather(mine, shards, dst=0)
                self.link.bytes_received += sum(s.numel() * s.element_size() for s in shards[1:])
            return torch.cat(shards, dim=-1)[..., :self.config.vocab_size]


def work_shard(model: HybridModel, part: TensorPart, timeout_s: float) -> None:
    """A worker rank of tensor parallel: its share of every command until rank 0 stops."""

    def forward(state: HybridState, ids: list[list[int]], slots: list[int], logits: str, snapshots: int) -> None:
        mine = tp_forward(model, part, torch.tensor(ids, dtype=torch.long), state,
                          torch.tensor(slots, dtype=torch.long), logits, snapshots)
        dist.gather(mine, dst=0)

    work(model, model.new_state, forward, part.rank, timeout_s)

"""A pipeline stage: the contiguous range of layers one rank holds, their weights and their state.

Rank 0 also holds the embedding, the final norm and the output head: the hidden state that comes back to it
after the last stage is E floats a token, where logits would be a whole vocabulary (248k floats for the
Qwen3.5 models), and a tied head is the embedding it already has. The layers are split so that each rank
holds about the same bytes of weights, rank 0's embedding and head counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deltaserve.errors import DeltaserveError
from deltaserve.models.base import HybridModel
from deltaserve.models.state import HybridState, Snapshots


@dataclass(frozen=True)
class Stage:
    rank: int
    world_size: int
    layers: range  # the layers this rank holds

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world_size - 1


class Elsewhere(nn.Module):
    """The place of a layer another rank holds: no weights, only the kind of state it keeps there."""

    def __init__(self, recurrent: bool):
        super().__init__()
        self.recurrent = recurrent


def split_layers(model: HybridModel, world_size: int) -> list[range]:
    """Contiguous layer ranges, one a rank, of about equal parameter counts; rank 0's count starts with the
    embedding, final norm and head. Every rank gets at least one layer."""
    n = len(model.layers)
    if not 1 <= world_size <= n:
        raise DeltaserveError(f"--pp {world_size}: the model has {n} layers, so at most {n} pipeline stages")
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    outside = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("layers."))
    total = outside + sum(sizes)
    cuts, at = [0], outside
    for i, size in enumerate(sizes):
        r = len(cuts)  # the rank whose first layer is still to be found
        if r < world_size and at + size / 2 >= r * total / world_size and i > cuts[-1]:
            cuts.append(i)
        at += size
    while len(cuts) < world_size:  # too few cuts where the last layers are the largest: one layer each
        cuts.append(n - (world_size - len(cuts)))
    for r in range(1, world_size):  # leave a layer for every later rank
        cuts[r] = min(max(cuts[r], cuts[r - 1] + 1), n - (world_size - r))
    return [range(a, b) for a, b in zip(cuts, cuts[1:] + [n])]


class StagePart:
    """models.common.build's `part` for rank `rank` of a `world_size`-stage pipeline: the layers are split
    (`stages`, the same on every rank) when the model is known, and what other ranks hold is dropped."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.stages: list[range] = []

    @property
    def stage(self) -> Stage:
        return Stage(self.rank, self.world_size, self.stages[self.rank])

    def cut(self, model: HybridModel) -> HybridModel:
        self.stages = split_layers(model, self.world_size)
        for i, layer in enumerate(model.layers):
            if i not in self.stage.layers:
                model.layers[i] = Elsewhere(layer.recurrent)
        if not self.stage.first:
            model.embed = model.norm = model.lm_head = None
        return model

    def shard(self, name: str, t, block: int = 1, source: str = ""):
        return t  # a stage holds its parameters whole


def stage_state(model: HybridModel, stage: Stage, n_slots: int, max_len: int) -> HybridState:
    """A HybridState with tensors for the stage's layers only (None at the others) and every slot's length."""
    s = model.state_sizes()
    device = next(model.parameters()).device
    own = HybridState.allocate([model.layers[i].recurrent for i in stage.layers], n_slots, max_len, conv=s["conv"],
                               ssm=s["ssm"], k=s["k"], v=s["v"], dtype=model.compute_dtype,
                               kv_dtype=model.cache_dtype, device=device)
    n = len(model.layers)

    def placed(tensors):
        full = [None] * n
        full[stage.layers.start:stage.layers.stop] = tensors
        return full
    return HybridState(placed(own.conv), placed(own.ssm), placed(own.k), placed(own.v), own.lengths)


def stage_forward(model: HybridModel, x: torch.Tensor, state: HybridState, slots: torch.Tensor, snapshots: int,
                  stage: Stage) -> torch.Tensor:
    """The stage's part of HybridModel.forward: ids [N, T] (first stage, embedded here) or hidden states
    [N, T, E] through the stage's layers, the slots' state advanced; hidden states [N, T, E] out.
    snapshots=K keeps per-token states for rollback as forward does (none kept: older ones are dropped)."""
    with torch.inference_mode():
        start = state.lengths[slots]  # [N]
        N, T = x.shape[:2]
        n = len(model.layers)
        snaps = Snapshots(slots.tolist(), (start + T).tolist(), T, snapshots, [None] * n, [None] * n) \
            if snapshots else None
        attends = any(not model.layers[i].recurrent for i in stage.layers)
        rope = model.rope(start[:, None] + torch.arange(T, device=start.device)) if attends else None
        h = model.embed(x, model.compute_dtype) if stage.first else x
        h = model.run_layers(h, rope, state, slots, start, snaps, stage.layers)
        state.lengths[slots] = start + T
        state.snapshots = snaps
        return h


def micro_batches(n: int, m: int) -> list[int]:
    """Row counts of min(n, m) contiguous micro-batches of a pass over n slots, as even as they go (the
    first ones a row larger): m = 1, or one slot, is the pass unsplit."""
    m = max(1, min(n, m))
    return [n // m + (i < n % m) for i in range(m)]


def merged(kept: list[Snapshots | None]) -> Snapshots | None:
    """One pass's snapshots from those its micro-batches kept (contiguous rows, in order): per layer, their
    rows stacked, which is what the pass unsplit keeps (each row's tensors depend on its own slot only)."""
    if kept[0] is None or len(kept) == 1:
        return kept[0]

    def rows(tensors):
        return None if tensors[0] is None else torch.cat(tensors)
    return Snapshots([s for k in kept for s in k.slots], [n for k in kept for n in k.lengths], kept[0].tokens,
                     kept[0].depth, [rows(t) for t in zip(*(k.conv for k in kept))],
                     [rows(t) for t in zip(*(k.ssm for k in kept))])


def state_shapes(model: HybridModel, layers, recurrent: list[bool], tokens: int | None = None):
    """(shape, dtype) of one slot's conv and delta-rule states (tokens None) or of `tokens` KV rows (k, then
    v), for each of `layers` that has them, in order: what a rank sends of one slot."""
    s = model.state_sizes()
    kv_dtype = model.cache_dtype or model.compute_dtype
    out = []
    for i in layers:
        if recurrent[i] and tokens is None:
            out += [((*s["conv"],), model.compute_dtype), ((*s["ssm"],), torch.float32)]
        elif not recurrent[i] and tokens is not None:
            out += [((tokens, *s["k"]), kv_dtype), ((tokens, *s["v"]), kv_dtype)]
    return out

"""Pipeline parallel: each rank runs a contiguous range of layers (dist/stage.py); rank 0 also the rest.

A forward pass carries the hidden states rank to rank, 0 -> 1 -> ... -> N-1 -> 0 (point to point, E values
a token each hop); rank 0 ends it with the final norm and the head. With micro_batches m > 1 (--micro-batches)
a pass over n sequences is cut into min(n, m) micro-batches of whole sequences, and the hops are non-blocking:
rank r runs micro-batch i while rank r + 1 runs i - 1, and rank 0 runs the head of each as it comes back.
One command carries the cut, so every rank makes the same; a sequence's state rows lie in one micro-batch,
and the micro-batches' per-token snapshots are stacked into the pass's (rollback reads them as before). The
result is bitwise one process's running the same micro-batches in turn (not the pass unsplit: CPU GEMMs
round a row's sums by the rows they get). Measured on one loaded 2-core machine, the stages overlap but the
pass is no faster (README), so the default is 1: the stages take turns.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from deltaserve.dist import group
from deltaserve.dist.spread import SpreadModel, SpreadState, work
from deltaserve.dist.stage import Stage, merged, micro_batches, stage_forward, stage_state
from deltaserve.models.base import HybridModel
from deltaserve.models.common import lm_logits
from deltaserve.models.state import HybridState


class StageClock:
    """This process's (one rank's) recent passes: (tokens, seconds spent running its own stage) each. Beside
    a pass's wall time on rank 0, the rest of it is the time the stage waited on the others: what
    micro-batches fill (python -m deltaserve.bench.dist reports it)."""

    def __init__(self, keep: int = 4096):
        self.passes: deque[tuple[int, float]] = deque(maxlen=keep)

    def add(self, tokens: int, seconds: float) -> None:
        self.passes.append((tokens, seconds))


CLOCK = StageClock()  # one rank a process


class PipelineModel(SpreadModel):
    def __init__(self, inner: HybridModel, stages: list[range], link: group.Link, micro_batches: int = 1):
        """micro_batches: the most micro-batches a pass is split into (1: unsplit; README: when to split)."""
        super().__init__(inner, link, len(stages))
        self.stages = stages
        self.stage = Stage(0, len(stages), stages[0])
        self.micro_batches = micro_batches

    def held(self, rank: int) -> range:
        return self.stages[rank]

    def local_state(self, n_slots: int, max_len: int) -> HybridState:
        return stage_state(self.inner, self.stage, n_slots, max_len)

    def forward(self, input_ids: torch.Tensor, state: SpreadState, slots=None, logits: str = "last",
                snapshots: int = 0) -> torch.Tensor:
        """HybridModel.forward over the pipeline (a state is required: no training across ranks)."""
        with torch.inference_mode():
            input_ids, slots = self.checked(input_ids, state, slots, logits)
            N, T = input_ids.shape
            E, sizes = self.config.hidden_size, micro_batches(N, self.micro_batches)
            with self.link.command("forward", slots.tolist(), T, logits, snapshots, sizes):
                back = [self.link.irecv(((n, E) if logits == "last" else (n, T, E), self.compute_dtype),
                                        self.world_size - 1) for n in sizes]  # [n, E] | [n, T, E] each
                busy, sent, kept = 0.0, [], []
                for rows in _spans(sizes):  # stage 1 runs micro-batch i while this runs i + 1
                    began = time.perf_counter()
                    h = stage_forward(self.inner, input_ids[rows], state.local, slots[rows], snapshots, self.stage)
                    busy += time.perf_counter() - began
                    kept.append(state.local.snapshots)
                    sent.append(self.link.isend(h, 1))
                state.local.snapshots = merged(kept)
                outs = []
                for p in back:  # the head of micro-batch i while the last stage runs i + 1
                    h = p.wait()
                    began = time.perf_counter()
                    outs.append(lm_logits(self.inner, self.inner.norm(h)))
                    busy += time.perf_counter() - began
                for p in sent:
                    p.wait()
            CLOCK.add(N * T, busy)
            return outs[0] if len(outs) == 1 else torch.cat(outs)


def _spans(sizes: list[int]) -> list[slice]:
    """The rows of each micro-batch."""
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    return [slice(end - n, end) for n, end in zip(sizes, ends)]


def work_stage(model: HybridModel, stage: Stage, timeout_s: float) -> None:
    """A worker rank of the pipeline: its stage's share of every command until rank 0 stops."""

    def forward(state: HybridState, slots: list[int], T: int, logits: str, snapshots: int, sizes: list[int]) -> None:
        came = [group.irecv(((n, T, model.config.hidden_size), model.compute_dtype), stage.rank - 1) for n in sizes]
        slots, busy, sent, kept = torch.tensor(slots, dtype=torch.long), 0.0, [], []
        for rows, h in zip(_spans(sizes), came):  # the next rank runs micro-batch i while this runs i + 1
            h = h.wait()
            began = time.perf_counter()
            h = stage_forward(model, h, state, slots[rows], snapshots, stage)
            busy += time.perf_counter() - began
            kept.append(state.snapshots)
            if stage.last:
                sent.append(group.isend(h[:, -1] if logits == "last" else h, 0))
            else:
                sent.append(group.isend(h, stage.rank + 1))
        state.snapshots = merged(kept)
        CLOCK.add(len(slots) * T, busy)
        for p in sent:
            p.wait()

    work(model, lambda n_slots, max_len: stage_state(model, stage, n_slots, max_len), forward, stage.rank,
         timeout_s)

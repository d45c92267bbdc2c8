"""A model spread over ranks, seen from rank 0 as one model with one state; and the workers' loop.

Rank 0 holds a `SpreadModel` and the `SpreadState` it makes, which stand in for a HybridModel and its
HybridState: the engine, scheduler and cache manager run there unchanged. Each call they make (a forward
pass, a reset, a checkpoint's save or restore, a rollback) is done on rank 0's part and sent as a command
to the other ranks, which do the same call on theirs (`work`). How the model is spread decides only the
forward pass (pipeline.py, tensor.py) and which layers' state each rank holds (all of them, by heads, in
tensor parallel): a checkpoint gathers every rank's part of a slot's state to rank 0 (whole layers side by
side, or head shards concatenated along the heads) and a restore sends each rank its part back, so the
prefix store, its budget and its choices are rank 0's alone. Each checkpoint costs that transfer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from deltaserve.dist import group
from deltaserve.dist.stage import state_shapes
from deltaserve.models.base import HybridModel
from deltaserve.models.common import check_batch
from deltaserve.models.state import HybridState, RecurrentCopy

# the axis along which head shards of each kind of state are concatenated: conv channels, delta-rule
# heads, KV heads (tokens stay the first axis of KV rows, which the cache manager slices)
CONV_AXIS, SSM_AXIS, KV_AXIS = -1, 0, 1


class SpreadState:
    """Rank 0's view of a state spread over the ranks: HybridState's methods, each done on rank 0's part and
    sent to the others. Lengths and snapshots are rank 0's: every rank keeps the same."""

    def __init__(self, local: HybridState, model: SpreadModel, max_len: int):
        self.local, self.model, self._max_len, self.link = local, model, max_len, model.link

    lengths = property(lambda self: self.local.lengths)
    k = property(lambda self: self.local.k)  # rank 0's caches: read_kv never returns views of them
    v = property(lambda self: self.local.v)
    n_slots = property(lambda self: self.local.n_slots)
    max_len = property(lambda self: self._max_len)

    @property
    def snapshots(self):
        return self.local.snapshots

    @snapshots.setter
    def snapshots(self, value) -> None:  # only ever cleared: each rank's next pass sets its own
        self.local.snapshots = value

    def nbytes(self) -> int:
        """Bytes of rank 0's part."""
        return self.local.nbytes()

    def reset(self, slots=None) -> None:
        self.local.reset(slots)  # first: a bad argument is refused before any rank acts on it
        with self.link.command("reset", None if slots is None else torch.as_tensor(slots).tolist()):
            pass

    def truncate(self, slot: int, length: int) -> None:
        self.local.truncate(slot, length)
        with self.link.command("truncate", slot, length):
            pass

    def rollback(self, slot: int, length: int) -> None:
        self.local.rollback(slot, length)
        with self.link.command("rollback", slot, length):
            pass

    def save_recurrent(self, slot: int) -> RecurrentCopy:
        mine = self.local.save_recurrent(slot)
        with self.link.command("save_recurrent", slot):
            conv, ssm = self._gather(mine.conv, mine.ssm, None, CONV_AXIS, SSM_AXIS)
        return RecurrentCopy(conv, ssm, mine.length)

    def load_recurrent(self, slot: int, saved: RecurrentCopy) -> None:
        conv, ssm = self._pieces(saved.conv, CONV_AXIS), self._pieces(saved.ssm, SSM_AXIS)
        self.local.load_recurrent(slot, RecurrentCopy(conv[0], ssm[0], saved.length))
        with self.link.command("load_recurrent", slot, saved.length):
            for r in range(1, self.model.world_size):
                self.link.send(_pairs(conv[r], ssm[r]), r)

    def read_kv(self, slot: int, start: int, end: int, copy: bool = True):
        """Copies, whatever `copy` says: the other ranks' rows arrive as new tensors, and rank 0's are copied
        so that no checkpoint holds a view of part of a layer."""
        k, v = self.local.read_kv(slot, start, end)
        if self.model.kv_shared:  # every rank has these rows
            return k, v
        with self.link.command("read_kv", slot, start, end):
            return self._gather(k, v, end - start, KV_AXIS, KV_AXIS)

    def write_kv(self, slot: int, start: int, k, v) -> None:
        rows = next(t.shape[0] for t in k if t is not None)
        if self.model.kv_shared:
            k, v = [k] * self.model.world_size, [v] * self.model.world_size
        else:
            k, v = self._pieces(k, KV_AXIS), self._pieces(v, KV_AXIS)
        self.local.write_kv(slot, start, k[0], v[0])
        with self.link.command("write_kv", slot, start, rows):
            for r in range(1, self.model.world_size):
                self.link.send(_pairs(k[r], v[r]), r)

    def _gather(self, a: list, b: list, tokens: int | None, axis_a: int, axis_b: int) -> tuple[list, list]:
        """Per layer, every rank's part (rank 0's are a and b) side by side: (conv, ssm) of one slot
        (tokens None) or (k, v) of `tokens` rows, as the other ranks send them."""
        parts_a, parts_b = [[t] if t is not None else [] for t in a], [[t] if t is not None else [] for t in b]
        for r in range(1, self.model.world_size):
            got = iter(self.link.recv(self.model.shapes(r, tokens), r))
            for i in self.model.held(r):
                if (tokens is None) == self.model.recurrent[i]:
                    parts_a[i].append(next(got))
                    parts_b[i].append(next(got))
        return ([None if not p else p[0] if len(p) == 1 else torch.cat(p, axis_a) for p in parts_a],
                [None if not p else p[0] if len(p) == 1 else torch.cat(p, axis_b) for p in parts_b])

    def _pieces(self, whole: list, axis: int) -> list[list]:
        """_gather's inverse for one kind of state: per rank, its part of each layer (None where it holds none)."""
        out = [[None] * len(whole) for _ in range(self.model.world_size)]
        for i, t in enumerate(whole):
            if t is None:
                continue
            holders = [r for r in range(self.model.world_size) if i in self.model.held(r)]
            for r, piece in zip(holders, t.chunk(len(holders), axis) if len(holders) > 1 else [t]):
                out[r][i] = piece
        return out


def _pairs(a: list, b: list) -> list[torch.Tensor]:
    """[a[i], b[i] for every layer i with a part here]: the order tensors of one slot travel in."""
    return [t for x, y in zip(a, b) if x is not None for t in (x, y)]


class SpreadModel(nn.Module, ABC):
    """Rank 0's stand-in for the whole model: new_state, forward's checks, and what the engine reads."""

    def __init__(self, inner: HybridModel, link: group.Link, world_size: int, config=None):
        """config: the whole model's (default inner's)."""
        super().__init__()
        self.inner, self.link, self.world_size = inner, link, world_size
        self.recurrent = [layer.recurrent for layer in inner.layers]
        self.config, self.embed = config or inner.config, inner.embed
        self.compute_dtype, self.cache_dtype = inner.compute_dtype, inner.cache_dtype
        self.supports_snapshots = inner.supports_snapshots
        self.supports_training = False
        self.kv_shared = False  # whether every rank keeps the whole KV rows (then a checkpoint takes rank 0's)

    @abstractmethod
    def held(self, rank: int) -> range:
        """The layers whose state (or a share of it) `rank` holds."""

    def shapes(self, rank: int, tokens: int | None = None):
        return state_shapes(self.inner, self.held(rank), self.recurrent, tokens)

    def new_state(self, n_slots: int, max_len: int) -> SpreadState:
        """The state of n_slots slots on every rank; a rank keeps one, so this replaces any earlier one."""
        local = self.local_state(n_slots, max_len)
        with self.link.command("new_state", n_slots, max_len):
            pass
        return SpreadState(local, self, max_len)

    @abstractmethod
    def local_state(self, n_slots: int, max_len: int) -> HybridState:
        """Rank 0's part of a new state."""

    def checked(self, input_ids, state, slots, logits: str):
        if not isinstance(state, SpreadState):
            raise TypeError("a model spread over ranks runs on the state its new_state made")
        return check_batch(self, input_ids, state, slots, logits)


def work(model: HybridModel, new_state: Callable[[int, int], HybridState], forward: Callable, rank: int,
         timeout_s: float) -> None:
    """A worker rank's loop: do rank 0's commands on this rank's part until it says stop.
    forward(state, *args): this rank's share of a forward pass (the command's args)."""
    state = None
    while True:
        op, args = group.next_command(timeout_s)
        if op == "stop":
            return
        if op == "new_state":
            state = new_state(*args)
        elif op == "forward":
            forward(state, *args)
        elif op in ("reset", "truncate", "rollback"):
            getattr(state, op)(*args)
        elif op == "save_recurrent":
            copy = state.save_recurrent(*args)
            group.send(_pairs(copy.conv, copy.ssm), 0)
        elif op == "read_kv":
            group.send(_pairs(*state.read_kv(*args)), 0)
        elif op == "load_recurrent":
            slot, length = args
            conv, ssm = _received(model, None, state.conv, state.ssm)
            state.load_recurrent(slot, RecurrentCopy(conv, ssm, length))
        elif op == "write_kv":
            slot, start, rows = args
            state.write_kv(slot, start, *_received(model, rows, state.k, state.v))
        elif op != "ping":
            raise group.DistributedError(f"rank {rank}: unknown command {op!r} from rank 0 (another version?)")


def _received(model: HybridModel, tokens: int | None, mine_a: list, mine_b: list) -> tuple[list, list]:
    """This rank's part of one slot's (conv, ssm) (tokens None) or of `tokens` (k, v) rows, as rank 0 sends
    it; mine_a: this rank's state of that kind (None at the layers it does not hold)."""
    recurrent = [layer.recurrent for layer in model.layers]
    held = [i for i, t in enumerate(mine_a) if t is not None]
    got = iter(group.recv(state_shapes(model, held, recurrent, tokens), 0))
    a, b = [None] * len(mine_a), [None] * len(mine_b)
    for i in held:
        a[i], b[i] = next(got), next(got)
    return a, b

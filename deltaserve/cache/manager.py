"""CacheManager: the decoding memory of one model, per sequence slot, and the prefix checkpoints all slots share.

A slot holds the KV cache of the attention layers and the conv and delta-rule states of the recurrent
layers (one HybridState row) for exactly the tokens in `history[slot]`. A new prompt continues a slot
whose history it extends (the live state); otherwise it restores the newest checkpoint at or before the
point where it leaves the cached tokens (the recurrent state saved there and the KV rows of the prefix)
and only the rest is prefilled (checkpoints view the KV rows of the slot that took them until it writes over
them, see _release_rows). A checkpoint is taken whenever a slot's length reaches a multiple of
`interval` or a position its request marked (where the conversation may diverge next turn: the start
of the assistant's turn, the end of the prompt): the runner cuts its forward passes there, and `rollback`
saves the interval ones it steps back over. An answer's end is kept too, once its slot is about to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from deltaserve.errors import DeltaserveError, SlotBusyError

from deltaserve.models.state import RecurrentCopy

from . import persist
from .prefix import Block, Mark, PrefixStore


# Checkpoints this many tokens before the end of every prompt: a prompt that leaves another one near its end
# (an edited last line, a different last turn, a template that re-renders its last few tokens) restores
# one of them and prefills a few tokens, not everything since the last interval checkpoint (up to 511).
TAIL_MARKS = (8, 32, 128)


class CacheManager:
    def __init__(self, model, n_slots: int = 1, max_len: int = 4096, checkpoint_interval: int = 512,
                 budget_mb: float = 1024.0, tail_marks: Sequence[int] = TAIL_MARKS, mtp: bool = False):
        """model: anything with new_state(n_slots, max_len) -> HybridState. checkpoint_interval 0 or
        budget_mb 0 turn checkpoints off (live reuse still works). tail_marks: distances from the end of
        each prompt to checkpoint at, besides the positions each request marks. mtp: the state carries the
        model's MTP layer too (new_state(..., mtp=True)), which the checkpoints then keep like any layer."""
        if checkpoint_interval < 0 or budget_mb < 0:
            raise DeltaserveError(f"checkpoint_interval and cache budget must be >= 0, got {checkpoint_interval} "
                                  f"and {budget_mb} MB")
        self.state = model.new_state(n_slots, max_len, mtp=True) if mtp else model.new_state(n_slots, max_len)
        self.max_len = self.state.max_len or max_len
        self.history: list[list[int]] = [[] for _ in range(n_slots)]  # tokens whose effect each slot holds
        self.busy = [False] * n_slots
        self.interval = checkpoint_interval
        self.tail_marks = tuple(tail_marks)
        self.store = PrefixStore(checkpoint_interval, int(budget_mb * 2**20)) if checkpoint_interval and budget_mb \
            else None
        self.restored_tokens = 0  # prompt tokens taken from checkpoints instead of prefilled
        self.hits = 0  # prompts that restored a checkpoint
        self._wanted: list[set[int]] = [set() for _ in range(n_slots)]  # marked positions still to reach
        self._prompt_len = [0] * n_slots  # of each slot's current request
        self._owed = [False] * n_slots  # the slot holds an answer's end not checkpointed yet (see release)
        self._last_used = [0] * n_slots
        self._clock = 0

    @property
    def n_slots(self) -> int:
        return len(self.busy)

    def free_slots(self) -> int:
        return self.busy.count(False)

    def nbytes(self) -> int:
        """Bytes held: every slot's state plus the checkpoints."""
        return self.state.nbytes() + (self.store.nbytes if self.store is not None else 0)

    def room(self, slot: int) -> int:
        """Tokens the slot can still take."""
        return self.max_len - len(self.history[slot])

    # ------------------------------------------------------------------ slots
    def acquire(self, prompt: Sequence[int], slot: int | None = None, marks: Sequence[int] = ()) -> tuple[int, int]:
        """A free slot (or `slot` itself, which is not marked busy) set up for `prompt`, and how many of the
        prompt's tokens it now holds: a live slot whose history the prompt extends, else the newest
        checkpoint on the prompt's path, else nothing (the least recently used slot starts over).
        At least the last prompt token is always left to feed: its logits start the generation.
        marks: positions (1..len(prompt)) to checkpoint when the slot reaches them."""
        candidates = [slot] if slot is not None else [s for s in range(self.n_slots) if not self.busy[s]]
        if not candidates:
            raise DeltaserveError("acquire: every slot is busy")
        limit = len(prompt) - 1

        def live(s: int) -> int:
            h = self.history[s]
            return len(h) if len(h) <= limit and list(prompt[:len(h)]) == h else 0

        best = max(candidates, key=lambda s: (live(s), -self._last_used[s]))
        path, mark = self._restore_point(prompt, limit)
        end = mark.end if mark is not None else path[-1].end if path else 0
        if end > live(best):  # restore where the fewest KV rows must be copied, else into the oldest slot
            best = max(candidates, key=lambda s: (min(_common(self.history[s], prompt), end), -self._last_used[s]))
            self._settle(best)
            try:
                self._restore(best, prompt, path, mark)
            except BaseException:
                self.reset(best)  # a restore cut short leaves the slot half-written
                raise
        elif live(best) == 0:
            best = min(candidates, key=lambda s: self._last_used[s])
            self.reset(best)
        else:  # its conversation came back to the live slot: the answer's end needs no checkpoint
            self._owed[best] = False
        if slot is None:
            self.busy[best] = True
        held = len(self.history[best])
        self._prompt_len[best] = len(prompt)
        marks = [*marks, *(len(prompt) - d for d in self.tail_marks)]
        self._wanted[best] = {m for m in marks if held < m <= len(prompt)} if self.store is not None else set()
        return best, held

    def _restore_point(self, prompt: Sequence[int], limit: int) -> tuple[list[Block], Mark | None]:
        """The deepest checkpoint of the prompt's first `limit` tokens: the blocks to it, and the mark
        (None when a block boundary is the deepest)."""
        if self.store is None:
            return [], None
        path, found = self.store.checkpoint_path(prompt, limit), self.store.best_mark(prompt, limit)
        if found is not None and found[1].end > (path[-1].end if path else 0):
            return found
        return path, None

    def release(self, slot: int, checkpoint: bool = False) -> None:
        """The slot is free again; its state stays, so a prompt that extends it can continue from it.
        checkpoint: its state (the end of an answer) becomes a checkpoint once something else is about to
        change it (another prompt, a reset, the checkpoints written to disk), for when the conversation comes
        back after the slot was reused. Not now: the answer would wait for the copy (a 0.8B model's recurrent
        state is 18 MB: 4 ms, and 70-100 ms where the memory it takes faults slowly), and a conversation that
        comes back to its live slot never needs it."""
        self._owed[slot] = checkpoint and self.store is not None and bool(self.history[slot])
        self._wanted[slot] = set()
        self.busy[slot] = False
        self._clock += 1
        self._last_used[slot] = self._clock

    def fork(self, src: int) -> int:
        """A free slot (the least recently used) made a copy of busy slot `src`: its KV rows and recurrent
        state, for n choices of one prompt prefilled once. The copy is busy and has no marks to reach."""
        free = [s for s in range(self.n_slots) if not self.busy[s]]
        if not free:
            raise DeltaserveError("fork: every slot is busy")
        dst = min(free, key=lambda s: self._last_used[s])
        self.reset(dst)
        k, v = self.state.read_kv(src, 0, len(self.history[src]))
        self.state.write_kv(dst, 0, k, v)
        self.state.load_recurrent(dst, self.state.save_recurrent(src))
        self.history[dst] = list(self.history[src])
        self.busy[dst] = True
        self._prompt_len[dst] = self._prompt_len[src]
        return dst

    def reset(self, slot: int) -> None:
        self._settle(slot)
        self._release_rows(slot, 0)
        self.state.reset([slot])
        self.history[slot] = []
        self._wanted[slot] = set()

    # ------------------------------------------------------------------ after forward passes
    def boundaries(self, slot: int, n: int) -> list[int]:
        """Offsets in 1..n at which `n` more tokens would bring the slot to a checkpoint position."""
        if self.store is None:
            return []
        at = len(self.history[slot])
        regular = range(self.interval - at % self.interval, n + 1, self.interval)
        return sorted({k for k in regular if self._spaced(slot, at + k)}
                      | {m - at for m in self._wanted[slot] if 0 < m - at <= n})

    def _spaced(self, slot: int, position: int) -> bool:
        """Whether a checkpoint sits at `position` (a multiple of the interval). Every interval up to 4 of
        them, then intervals 6, 8, 12, 16, 24, 32, ... (the stride doubles every two: each a third or a half
        deeper than the one before), and every interval again over the last 4 of the prompt, where follow-up
        turns diverge. A 32k-token prompt keeps 15 recurrent states (about 20 MB each on 0.8B shapes), not 64:
        deep inside a long prompt a divergence is rare and costs at most a third more prefill."""
        n = position // self.interval
        stride = 1 << max(0, (n // 2).bit_length() - 1)
        return n % stride == 0 or self._prompt_len[slot] - position < 4 * self.interval

    def advance(self, slots: Sequence[int], tokens: Sequence[Sequence[int]], checkpoint: bool = True) -> None:
        """Record that slots[i] took tokens[i]; checkpoint those now at a checkpoint position."""
        for s, t in zip(slots, tokens):
            self.history[s].extend(t)
            at = len(self.history[s])
            if not checkpoint or self.store is None:
                continue
            if (at % self.interval == 0 and self._spaced(s, at)) or at in self._wanted[s]:
                self._wanted[s].discard(at)
                self._checkpoint(s)

    def rollback(self, slot: int, length: int) -> None:
        """After a forward pass that kept snapshots (and was recorded with checkpoint=False): the slot goes
        back to its first `length` tokens without recompute. Checkpoint positions the pass went through up
        to `length` are saved on the way, from their snapshots."""
        tokens = self.history[slot]
        snaps = self.state.snapshots
        if self.store is not None and snaps is not None:
            first = len(tokens) - snaps.tokens + 1
            for b in range(-(-first // self.interval) * self.interval, length + 1, self.interval):
                if not self._spaced(slot, b):
                    continue
                self.state.rollback(slot, b)
                self.history[slot] = tokens[:b]
                self._checkpoint(slot)
        self._release_rows(slot, length)  # the rows past `length` will be written again
        self.state.rollback(slot, length)
        self.history[slot] = tokens[:length]

    def save(self, slot: int) -> RecurrentCopy:
        """A copy of the slot's recurrent state, to come back to with `restore` (its KV rows stay in place)."""
        return self.state.save_recurrent(slot)

    def restore(self, slot: int, saved: RecurrentCopy) -> None:
        """Back to the point of `save`: only tokens were added to the slot since."""
        self._release_rows(slot, saved.length)
        self.state.load_recurrent(slot, saved)
        del self.history[slot][saved.length:]

    def save_checkpoints(self, folder, model) -> None:
        """Keep the prefix checkpoints in `folder` (cache/persist.py), to be loaded after a restart."""
        if self.store is not None:
            for slot in range(self.n_slots):
                self._settle(slot)
            persist.save(self.store, folder, persist.fingerprint(model))

    def load_checkpoints(self, folder, model) -> int:
        """Load the checkpoints kept in `folder` by a server of the same model; 0 (and a warning) for
        files that are damaged or another model's."""
        if self.store is None or self.store.blocks:
            return 0
        return persist.load(folder, persist.fingerprint(model), self.store, self.state.save_recurrent(0),
                            self.state.read_kv(0, 0, 1))

    def save_slot(self, slot: int, path, model) -> tuple[int, int]:
        """Write the slot's state to the file `path` (cache/persist.py); the tokens it held and the bytes
        written. The slot must not be serving a request."""
        tokens = self._idle(slot, "save")
        if not tokens:
            raise DeltaserveError(f"slot {slot} holds no tokens: nothing to save")
        k, v = self.state.read_kv(slot, 0, len(tokens))
        return len(tokens), persist.save_slot(path, tokens, k, v, self.state.save_recurrent(slot),
                                              persist.fingerprint(model))

    def load_slot(self, slot: int, path, model) -> tuple[int, int]:
        """Put the state kept in the file `path` by save_slot into the slot (a prompt that extends its
        tokens then continues from it); the tokens restored and the bytes read. A file that is damaged,
        another model's or too long for this context raises DeltaserveError and leaves the slot as it was."""
        self._idle(slot, "restore")
        path = Path(path)
        k_like, v_like = self.state.read_kv(0, 0, 1)
        per_token = sum(t.numel() * t.element_size() for t in k_like + v_like if t is not None)
        template = self.state.save_recurrent(0)
        limit = 2**20 + template.nbytes() + per_token * self.max_len  # the header, the state, a full context
        try:
            tokens, k, v, recurrent = persist.load_slot(path, persist.fingerprint(model), template, (k_like, v_like),
                                                        self.max_len - 1, limit)
        except (OSError, ValueError, KeyError, RuntimeError) as e:  # whatever a damaged file raises
            raise DeltaserveError(f"cannot restore {path}: {e}") from None
        self.reset(slot)
        self.state.write_kv(slot, 0, k, v)
        self.state.load_recurrent(slot, recurrent)
        self.history[slot] = tokens
        return len(tokens), path.stat().st_size

    def erase_slot(self, slot: int) -> int:
        """Forget the slot's state; the tokens it held."""
        n = len(self._idle(slot, "erase"))
        self.reset(slot)
        return n

    def _idle(self, slot: int, action: str) -> list[int]:
        if not 0 <= slot < self.n_slots:
            raise DeltaserveError(f"{action}: no slot {slot}; this server has slots 0..{self.n_slots - 1}")
        if self.busy[slot]:
            raise SlotBusyError(f"{action}: slot {slot} is serving a request")
        return self.history[slot]

    # ------------------------------------------------------------------ checkpoints
    def _settle(self, slot: int) -> None:
        """The checkpoint the slot owes (an answer's end, see release), taken before its state changes."""
        if self._owed[slot]:
            self._owed[slot] = False
            self._checkpoint(slot)

    def _checkpoint(self, slot: int) -> None:
        """A checkpoint of the slot as it is: a block at a multiple of the interval, else a mark."""
        self.store.put_mark(self.history[slot], lambda a, b: self.state.read_kv(slot, a, b, copy=False),
                            lambda: self.state.save_recurrent(slot))

    def _release_rows(self, slot: int, start: int) -> None:
        """The slot's KV rows from `start` on are about to be written: checkpoints still viewing them copy
        them first."""
        if self.store is None:
            return
        spans = []  # [lo, hi) byte addresses of those rows in each layer's cache
        for cache in self.state.k + self.state.v:
            if cache is not None and cache.numel():
                size, base = cache.element_size(), cache.data_ptr()
                spans.append((base + (slot * cache.stride(0) + start * cache.stride(1)) * size,
                              base + (slot + 1) * cache.stride(0) * size))

        def overwritten(view) -> bool:
            lo = view.data_ptr()
            hi = lo + view.numel() * view.element_size()
            return any(lo < b and a < hi for a, b in spans)

        self.store.detach(overwritten)

    def _restore(self, slot: int, prompt: Sequence[int], path: list[Block], mark: Mark | None) -> None:
        """Make the slot hold prompt[:end] from checkpoint blocks (and a mark after them): the KV rows it
        lacks, then the recurrent state."""
        end = mark.end if mark is not None else path[-1].end
        have = min(_common(self.history[slot], prompt), end)  # KV rows already right in this slot
        self._release_rows(slot, have)
        pieces = [(block.end - self.interval, block.k, block.v) for block in path]
        if mark is not None:
            pieces.append((mark.block.end, mark.k, mark.v))
        for start, k, v in pieces:
            size = next((t.shape[0] for t in k if t is not None), 0)
            if start + size > have:
                skip = max(have - start, 0)
                self.state.write_kv(slot, start + skip, [None if t is None else t[skip:] for t in k],
                                    [None if t is None else t[skip:] for t in v])
        self.state.load_recurrent(slot, (mark or path[-1]).recurrent)
        self.history[slot] = list(prompt[:end])
        self.store.touch(path + ([mark] if mark is not None else []))
        self.restored_tokens += end
        self.hits += 1


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of a and b."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

"""Continuous batching in plain Python: one step = one batched decode of every running request, then
prefill chunks of waiting prompts up to a token budget. Requests join and leave between steps.

A request added with a Speculator decodes speculatively: its drafts are verified in one batched pass
(rows padded to the longest draft; padding is never accepted) and each slot rolled back to what it kept.
"""

from __future__ import annotations

from collections import deque

import torch

from .request import Request
from .runner import ModelRunner
from .sampling import sample
from .speculative import Speculator, accept


class Scheduler:
    def __init__(self, runner: ModelRunner, prefill_chunk: int = 512):
        self.runner = runner
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.speculators: dict[Request, Speculator] = {}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request, speculator: Speculator | None = None) -> None:
        if len(req.prompt_ids) + 1 > self.runner.max_len:
            req.finish("error", f"the prompt has {len(req.prompt_ids)} tokens; the context holds "
                                f"{self.runner.max_len}")
            return
        if speculator is not None:
            self.speculators[req] = speculator
        self.waiting.append(req)

    def step(self) -> None:
        self._drop_finished()
        self._admit()
        self._decode()
        self._prefill()
        self._drop_finished()

    # ------------------------------------------------------------------ phases
    def _admit(self) -> None:
        while self.waiting and self.runner.free_slots():
            req = self.waiting.popleft()
            if req.cancelled:
                req.finish("cancelled")
                self.speculators.pop(req, None)
                continue
            req.slot, req.n_fed = self.runner.acquire(req.prompt_ids)
            self.running.append(req)

    def _decode(self) -> None:
        batch = [r for r in self.running if r.pending is not None and not r.cancelled]
        if not batch:
            return
        drafts = self._draft([r for r in batch if r in self.speculators])
        plain = [r for r in batch if r not in drafts]
        if plain:
            logits = self.runner.forward([r.slot for r in plain], [[r.pending] for r in plain])
            self._take_samples(plain, logits)
        if drafts:
            self._verify(drafts)

    def _draft(self, reqs: list[Request]) -> dict[Request, list[int]]:
        """Non-empty drafts of the requests that decode speculatively, each at most as long as its room,
        what it may still generate and its speculator's k allow."""
        drafts = {}
        for spec in dict.fromkeys(self.speculators[r] for r in reqs):
            mine = [r for r in reqs if self.speculators[r] is spec]
            ks = [min(spec.k, self.runner.room(r.slot) - 1, r.params.max_tokens - len(r.output_ids) - 1) for r in mine]
            mine, ks = [r for r, k in zip(mine, ks) if k > 0], [k for k in ks if k > 0]
            if not mine:
                continue
            proposed = spec.drafter.propose([r.slot for r in mine], [r.prompt_ids + r.output_ids for r in mine], ks)
            drafts.update((r, d) for r, d in zip(mine, proposed) if d)
        return drafts

    def _verify(self, drafts: dict[Request, list[int]]) -> None:
        reqs = list(drafts)
        T = 1 + max(len(d) for d in drafts.values())
        rows = [[r.pending, *d] + [d[-1]] * (T - 1 - len(d)) for r, d in drafts.items()]
        logits = self.runner.verify([r.slot for r in reqs], rows)  # [N, T, V]
        for req, row_logits in zip(reqs, logits):
            draft, spec = drafts[req], self.speculators[req]
            tokens = accept(row_logits, draft, req.params, req.generator)
            spec.proposed += len(draft)
            spec.accepted += len(tokens) - 1
            spec.steps += 1
            start = len(self.runner.history[req.slot]) - T  # the slot's length before the pass
            self.runner.rollback(req.slot, start + len(tokens))  # keeps [pending, accepted drafts]
            for i, token in enumerate(tokens):  # room as plain decoding would see it after token i
                req.add_token(token, room=self.runner.max_len - (start + 1 + i))
                if req.done is not None:
                    break

    def _prefill(self) -> None:
        budget = self.prefill_chunk
        for req in [r for r in self.running if r.prefilling and not r.cancelled]:
            if budget <= 0:
                break
            chunk = req.prompt_ids[req.n_fed:req.n_fed + budget]
            logits = self.runner.forward([req.slot], [chunk])
            req.n_fed += len(chunk)
            budget -= len(chunk)
            if not req.prefilling:
                if req.params.max_tokens == 0:
                    req.finish("length")
                else:
                    self._take_samples([req], logits)

    def _take_samples(self, reqs: list[Request], logits: torch.Tensor) -> None:
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        for req, token in zip(reqs, tokens):
            req.add_token(token, room=self.runner.room(req.slot))

    def _drop_finished(self) -> None:
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            req.finish("cancelled")
            self.speculators.pop(req, None)
        keep = []
        for req in self.running:
            if req.cancelled:
                req.finish("cancelled")
            if req.done is None:
                keep.append(req)
            else:
                self.runner.release(req.slot)
                self.speculators.pop(req, None)
        self.running = keep

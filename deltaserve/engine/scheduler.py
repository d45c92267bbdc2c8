"""Continuous batching in plain Python: one step = one batched decode of every running request, then
prefill chunks of waiting prompts up to a token budget. Requests join and leave between steps."""

from __future__ import annotations

from collections import deque

import torch

from .request import Request
from .runner import ModelRunner
from .sampling import sample


class Scheduler:
    def __init__(self, runner: ModelRunner, prefill_chunk: int = 512):
        self.runner = runner
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        if len(req.prompt_ids) + 1 > self.runner.max_len:
            req.finish("error", f"the prompt has {len(req.prompt_ids)} tokens; the context holds "
                                f"{self.runner.max_len}")
            return
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
                continue
            req.slot, req.n_fed = self.runner.acquire(req.prompt_ids)
            self.running.append(req)

    def _decode(self) -> None:
        batch = [r for r in self.running if r.pending is not None and not r.cancelled]
        if not batch:
            return
        logits = self.runner.forward([r.slot for r in batch], [[r.pending] for r in batch])
        self._take_samples(batch, logits)

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
        keep = []
        for req in self.running:
            if req.cancelled:
                req.finish("cancelled")
            if req.done is None:
                keep.append(req)
            else:
                self.runner.release(req.slot)
        self.running = keep

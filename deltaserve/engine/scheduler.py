"""Continuous batching in plain Python: one step = one batched decode of every running request, then
prefill chunks of waiting prompts up to a token budget. Requests join and leave between steps.

A request added with a Speculator decodes speculatively: its drafts are verified in one batched pass
(rows padded to the longest draft; padding is never accepted) and each slot rolled back to what it kept;
a drafter that can (MTPDrafter.step) does all of it in one call for greedy unconstrained requests.

A batched pass that raises (the model, a drafter) is run again for each of its requests alone, each slot
first brought back to the tokens it held before the pass; a pass that raises for one request (alone, or
in sampling, which is per request) ends that request with finish reason "error" and its slot starts
over. So a request fails only by itself, and the other requests go on.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from .constrain import Constraints
from .logits import process_logits, prompt_logprobs, token_logprob
from .request import Request
from .runner import ModelRunner
from .sampling import sample
from .speculative import Speculator, accept

log = logging.getLogger("deltaserve.engine")

# a prefill that reports prompt logprobs keeps logits for every position: [T, V] float32 (124 MB at 128 tokens
# of a 248k vocabulary), so it goes in chunks of at most this many tokens
LOGPROB_CHUNK = 128


class Scheduler:
    def __init__(self, runner: ModelRunner, prefill_chunk: int = 512, spec_max_batch: int | None = None):
        """spec_max_batch: a decode step of more sequences than this decodes them all plainly, without drafts
        (a batched pass is already many tokens wide, and verifying k more for each costs more than the
        accepted drafts save); None: draft at any batch size."""
        if prefill_chunk < 1:  # a budget of 0 would leave every prompt waiting for ever
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if spec_max_batch is not None and spec_max_batch < 1:
            raise ValueError(f"spec_max_batch must be >= 1, got {spec_max_batch}")
        self.runner = runner
        self.prefill_chunk = prefill_chunk
        self.spec_max_batch = spec_max_batch
        self.plain_steps = 0  # decode steps that drafted nothing because the batch was larger than spec_max_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.speculators: dict[Request, Speculator] = {}
        self.constraints = Constraints(runner.model.config.vocab_size)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request, speculator: Speculator | None = None) -> None:
        """Queue `req`; its followers (n > 1) come in with it and start from its prefilled state."""
        vocab = self.runner.model.config.vocab_size  # an id past the embedding would fail the whole batch
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        error = (f"the prompt has {len(req.prompt_ids)} tokens; the context holds {self.runner.max_len}"
                 if len(req.prompt_ids) + 1 > self.runner.max_len else
                 f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})" if bad else None)
        if error is None:
            try:
                self.constraints.get(req)  # a grammar that cannot be used fails its request here
            except Exception as e:
                error = f"grammar: {e}"
        for member in [req, *req.followers]:
            if error is not None:
                member.finish("error", error)
            elif speculator is not None and not (member.params.adjusts_logits or member.params.logprobs is not None):
                # verification samples from the raw logits, without penalties or logprobs: such requests
                # decode plainly (their output is the same either way)
                self.speculators[member] = speculator
        if error is None:
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
            with self._serving([req]):
                req.slot, req.n_fed = self.runner.acquire(req.prompt_ids, req.marks)
                # prompt logprobs need the logits of every prompt position: nothing may come from the cache
                if (not req.cache_prompt or req.params.prompt_logprobs is not None) and req.n_fed:
                    self.runner.reset(req.slot)
                    req.n_fed = 0
                req.cached = req.n_fed
                self.running.append(req)
            if req.done is not None:  # the slot could not be set up: it never ran
                self.speculators.pop(req, None)

    def _decode(self) -> None:
        batch = [r for r in self.running if r.pending is not None and not r.cancelled]
        if not batch:
            return
        drafting = [r for r in batch if r in self.speculators]
        if drafting and self.spec_max_batch is not None and len(batch) > self.spec_max_batch:
            drafting = []
            self.plain_steps += 1
        stepped = self._step_in_one_call(drafting)
        drafts = self._draft([r for r in drafting if r not in stepped and r.done is None])
        plain = [r for r in batch if r not in drafts and r not in stepped and r.done is None]  # (failures end requests)
        if plain:
            self._batched(plain, self._decode_plain, self._decode_alone)
        if drafts:
            self._batched(list(drafts), lambda reqs: self._verify({r: drafts[r] for r in reqs}), self._decode_alone)

    def _decode_plain(self, reqs: list[Request]) -> None:
        logits = self.runner.forward([r.slot for r in reqs], [[r.pending] for r in reqs])
        self._take_samples(reqs, logits)

    def _decode_alone(self, req: Request) -> None:
        """After a batched pass over `req` failed: bring its slot back to the tokens it held before the pass
        (the model may have written part of the pass to it, but the history records only completed passes)
        from its newest checkpoint, prefill the rest, and decode its pending token alone, without a draft."""
        tokens = [*self.runner.history[req.slot], req.pending]
        self._reset_slots([req])
        held = self.runner.rebuild(req.slot, tokens)
        for start in range(held, len(tokens), self.prefill_chunk):
            logits = self.runner.forward([req.slot], [tokens[start:start + self.prefill_chunk]])
        self._take_samples([req], logits)

    def _k(self, req: Request) -> int:
        """The most tokens `req` may draft: its speculator's k, within its room and what it may still generate."""
        return min(self.speculators[req].k, self.runner.room(req.slot) - 1,
                   req.params.max_tokens - len(req.output_ids) - 1)

    def _step_in_one_call(self, reqs: list[Request]) -> set[Request]:
        """Greedy unconstrained requests whose drafter drafts, verifies and keeps in one call (MTPDrafter.step on
        a model with the call): their decode step, done here. The others (and these where the call does not
        apply) draft and verify in steps."""
        stepped: set[Request] = set()
        for spec in dict.fromkeys(self.speculators[r] for r in reqs):
            step = getattr(spec.drafter, "step", None)
            if step is None:
                continue
            k_of = {r: k for r in reqs if self.speculators[r] is spec and r.params.greedy and r.params.grammar is None
                    and (k := self._k(r)) > 0}
            if not k_of:
                continue

            def run(batch: list[Request], step=step, k_of=k_of) -> None:
                out = step([r.slot for r in batch], [r.pending for r in batch], [k_of[r] for r in batch])
                if out is None:
                    return
                stepped.update(batch)
                for req, (draft, tokens) in zip(batch, out):
                    with self._serving([req]):
                        self._keep(req, draft, tokens, len(self.runner.history[req.slot]) - len(tokens))

            def alone(req: Request) -> None:
                stepped.add(req)
                self._decode_alone(req)

            self._batched(list(k_of), run, alone)
        return stepped

    def _draft(self, reqs: list[Request]) -> dict[Request, list[int]]:
        """Non-empty drafts of the requests that decode speculatively, each at most as long as its room,
        what it may still generate and its speculator's k allow."""
        drafts: dict[Request, list[int]] = {}
        for spec in dict.fromkeys(self.speculators[r] for r in reqs):
            mine = [r for r in reqs if self.speculators[r] is spec]
            k_of = {r: k for r in mine if (k := self._k(r)) > 0}
            if k_of:
                self._batched(list(k_of), lambda batch, spec=spec: self._propose(spec, batch, k_of, drafts),
                              lambda req, spec=spec: self._propose(spec, [req], k_of, drafts, reset=True))
        return drafts

    @staticmethod
    def _propose(spec: Speculator, reqs: list[Request], k_of: dict[Request, int], drafts: dict[Request, list[int]],
                 reset: bool = False) -> None:
        """Drafts for `reqs` into `drafts`. reset: after a failed batch, which may have written part of
        the drafter's state for them."""
        if reset:
            spec.drafter.reset([r.slot for r in reqs])
        proposed = spec.drafter.propose([r.slot for r in reqs], [r.prompt_ids + r.output_ids for r in reqs],
                                        [k_of[r] for r in reqs])
        drafts.update((r, d) for r, d in zip(reqs, proposed) if d)

    def _verify(self, drafts: dict[Request, list[int]]) -> None:
        reqs = list(drafts)
        T = 1 + max(len(d) for d in drafts.values())
        rows = [[r.pending, *d] + [d[-1]] * (T - 1 - len(d)) for r, d in drafts.items()]
        logits = self.runner.verify([r.slot for r in reqs], rows)  # [N, T, V]
        for req, row_logits in zip(reqs, logits):
            with self._serving([req]):
                self._accept(req, drafts[req], row_logits, T)

    def _accept(self, req: Request, draft: list[int], logits: torch.Tensor, T: int) -> None:
        tokens = accept(logits, self.constraints.allowed_draft(req, draft, logits), req.params, req.generator)
        start = len(self.runner.history[req.slot]) - T  # the slot's length before the pass
        self.runner.rollback(req.slot, start + len(tokens))  # keeps [pending, accepted drafts]
        self._keep(req, draft, tokens, start)

    def _keep(self, req: Request, draft: list[int], tokens: list[int], start: int) -> None:
        """Count a speculative step of `req` and take the tokens it produced (the accepted drafts, then the
        model's own); start: the slot's length before the step."""
        spec = self.speculators[req]
        spec.proposed += len(draft)
        spec.accepted += len(tokens) - 1
        spec.first_accepted += len(tokens) > 1
        spec.steps += 1
        for i, token in enumerate(tokens):  # room as plain decoding would see it after token i
            self._take(req, token, room=self.runner.max_len - (start + 1 + i))
            if req.done is not None:
                break

    def _prefill(self) -> None:
        budget = self.prefill_chunk
        for req in [r for r in self.running if r.prefilling and not r.cancelled]:
            if budget <= 0:
                break
            top = req.params.prompt_logprobs
            chunk = req.prompt_ids[req.n_fed:req.n_fed + (budget if top is None else min(budget, LOGPROB_CHUNK))]
            budget -= len(chunk)
            with self._serving([req]):
                if top is None:
                    logits = self.runner.forward([req.slot], [chunk])
                else:
                    every = self.runner.forward([req.slot], [chunk], logits="all")[0]  # [T, V]
                    start = req.n_fed
                    ahead = req.prompt_ids[start + 1:start + 1 + len(chunk)]  # the token each position predicts
                    req.prompt_logprobs += prompt_logprobs(every[:len(ahead)], ahead, top)
                    logits = every[-1:]
                req.n_fed += len(chunk)
                if not req.prefilling:
                    self._prefilled(req, logits)

    def _prefilled(self, req: Request, logits: torch.Tensor) -> None:
        """The prompt is in: the request samples its first token from `logits` [1, V], and each follower
        (n > 1) takes a copy of its state and samples its own; followers with no free slot queue first and
        prefill by themselves."""
        followers, req.followers = req.followers, []
        group = [req]
        for i, other in enumerate(followers):
            if not self.runner.free_slots():
                self.waiting.extendleft(reversed(followers[i:]))
                break
            other.slot, other.n_fed, other.cached = self.runner.fork(req.slot), len(req.prompt_ids), req.cached
            other.prompt_logprobs = list(req.prompt_logprobs)
            if other in self.speculators:
                self.speculators[other].drafter.reset([other.slot])
            self.running.append(other)
            group.append(other)
        for member in group:
            if member.params.max_tokens == 0:
                member.finish("length")
            else:
                self._take_samples([member], logits)

    def _take_samples(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Sample and take a token for each request on its own: one that fails there fails alone, and the
        others' generators advance exactly as they would have without it."""
        with self._serving([r for r in reqs if r.params.grammar is not None]):
            self.constraints.mask(reqs, logits)
        for i, req in enumerate(reqs):
            if req.done is None:  # (a failed mask ended it)
                with self._serving([req]):
                    p = req.params
                    row = process_logits(logits[i], p, req.prompt_ids, req.output_ids, req.end_ids)
                    token = sample(row[None], [p], [req.generator])[0]
                    logprob = token_logprob(logits[i], token, p.logprobs) if p.logprobs is not None else None
                    self._take(req, token, room=self.runner.room(req.slot), logprob=logprob)

    def _take(self, req: Request, token: int, room: int, logprob=None) -> None:
        complete = self.constraints.take(req, token)
        req.add_token(token, room, logprob=logprob)
        if complete:  # the grammar allows nothing more: no step is spent on the end-of-sequence token
            req.finish("stop")

    # ------------------------------------------------------------------ errors
    def _batched(self, reqs: list[Request], run: Callable[[list[Request]], None],
                 alone: Callable[[Request], None]) -> None:
        """run(reqs), a pass over several requests. If it raises, no request has taken a token from it (what
        follows the batched part is per request): each request runs `alone`, so one whose values or state
        break the pass fails by itself."""
        if len(reqs) == 1:
            with self._serving(reqs):
                run(reqs)
            return
        try:
            run(reqs)
            return
        except Exception:
            log.exception("a batched pass over requests %s failed; running each alone", [r.id for r in reqs])
        except BaseException:
            self._reset_slots(reqs)
            raise
        for req in reqs:
            if req.done is None:
                with self._serving([req]):
                    alone(req)

    @contextmanager
    def _serving(self, reqs: list[Request]) -> Iterator[None]:
        """Run a pass for `reqs`. If it raises, they end with the error and their slots are reset, since the
        pass may have written part of their state; the step goes on with the other requests. An interrupt
        (KeyboardInterrupt) still propagates, after the reset."""
        try:
            yield
        except Exception as e:
            log.exception("a pass over request(s) %s failed; they end with the error", [r.id for r in reqs])
            self.fail(reqs, f"engine error: {type(e).__name__}: {e}")
        except BaseException:
            self._reset_slots(reqs)
            raise

    def fail(self, reqs: list[Request], message: str) -> None:
        """End `reqs` with finish reason "error" and reset their slots; they leave the queues at the next
        step (or `abort`)."""
        self._reset_slots(reqs)
        for req in reqs:
            try:
                req.finish("error", message)
            except Exception:  # its event handler failed; the request is done all the same
                log.exception("could not deliver the error of request %d", req.id)

    def abort(self, message: str) -> None:
        """After a step that raised outside any one pass: end the running requests and free their slots.
        The waiting ones were not touched and stay."""
        running, self.running = self.running, []
        self.fail(running, message)
        for req in running:
            self.runner.release(req.slot)
            self.speculators.pop(req, None)

    def _reset_slots(self, reqs: list[Request]) -> None:
        for req in reqs:
            if req.slot is None:
                continue
            self.runner.reset(req.slot)
            if req in self.speculators:
                self.speculators[req].drafter.reset([req.slot])

    def _drop_finished(self) -> None:
        for req in [*self.waiting, *self.running]:
            if (req.cancelled or req.done is not None) and req.followers:  # it never forked: they run alone
                self.waiting.extend(req.followers)
                req.followers = []
        for req in [r for r in self.waiting if r.cancelled or r.done is not None]:
            self.waiting.remove(req)
            req.finish("cancelled")
            self.speculators.pop(req, None)
        keep = []
        for req in self.running:
            if req.cancelled:
                req.finish("cancelled")
            if req.done is None:
                keep.append(req)
            else:  # a finished answer's end is where its conversation comes back: checkpoint it
                self.runner.release(req.slot, checkpoint=req.done.reason in ("stop", "length"))
                self.speculators.pop(req, None)
        self.running = keep

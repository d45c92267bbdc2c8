"""Engine: the scheduler running in a background thread, fed from any thread (the server's event loop)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from deltaserve.models.layers import GEMV_ROWS

from .constrain import grammar_tokenizer_ready, prepare_in_background
from .request import Event, Request
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import Scheduler
from .speculative import make_speculator

log = logging.getLogger("deltaserve.engine")


@dataclass
class Metrics:
    requests_total: int = 0
    requests_finished: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    cached_tokens_total: int = 0  # prompt tokens of finished requests served from the cache


class Engine:
    def __init__(self, model, tokenizer, *, n_slots: int = 8, max_len: int = 4096, prefill_chunk: int = 512,
                 model_name: str = "deltaserve", checkpoint_interval: int = 512, cache_budget_mb: float = 1024.0,
                 speculative: str | None = None, spec_tokens: int = 4, spec_max_batch: int | None = None):
        """speculative: "ngram", "mtp" or a draft model's path, used by every request; spec_max_batch: steps
        decoding more sequences than this draft nothing (Scheduler); by default as many as one verify pass keeps
        within the GEMV's rows (GEMV_ROWS // (spec_tokens + 1)): past them the pass's projections run as GEMMs,
        whose rows no longer have a decode step's bits, and the one-call MTP step does not apply. See LLM for
        the other options."""
        if n_slots < 1 or max_len < 2:  # a request needs a slot, and room for a prompt token and a new one
            raise ValueError(f"n_slots must be >= 1 and max_len >= 2, got {n_slots} and {max_len}")
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.runner = ModelRunner(model, n_slots=n_slots, max_len=max_len, checkpoint_interval=checkpoint_interval,
                                  cache_budget_mb=cache_budget_mb, mtp=speculative == "mtp")
        self.speculator = make_speculator(speculative, self.runner, spec_tokens) if speculative else None
        if speculative and spec_max_batch is None:
            spec_max_batch = max(1, GEMV_ROWS // (spec_tokens + 1))
        self.scheduler = _TimedScheduler(self.runner, prefill_chunk, spec_max_batch)
        self.metrics = self.scheduler.metrics
        self._inbox: list[Request] = []
        self._calls: list[tuple[Callable, Future]] = []  # to run on the engine thread between two steps
        self._wake = threading.Condition()
        self._stopped = self._cancel_all = False
        self._thread = threading.Thread(target=self._loop, name="deltaserve-engine", daemon=True)
        self._thread.start()
        # llguidance's tables for the vocabulary (most of a second for 248k tokens) are built now, beside the
        # engine, rather than by the first request with response_format or a forced tool call
        self._grammar_build = prepare_in_background(tokenizer, self.vocab_size)

    def grammar_ready(self, timeout: float | None = 0) -> bool:
        """Whether constrained decoding's view of the vocabulary is built (waiting up to `timeout` seconds)."""
        self._grammar_build.join(timeout)
        return grammar_tokenizer_ready(self.tokenizer, self.vocab_size)

    @property
    def max_len(self) -> int:
        return self.runner.max_len

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding: prompt token ids must be below it, whatever the tokenizer holds."""
        return self.runner.model.config.vocab_size

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event: Callable[[Event], None],
               marks: tuple[int, ...] = (), cache_prompt: bool = True) -> Request:
        """Queue a request; on_event is called from the engine thread with each Delta and the final Done.
        marks: prompt positions to checkpoint; cache_prompt=False: prefill the whole prompt anew."""
        req = Request(prompt_ids, params, self.tokenizer, on_event=on_event, marks=marks, cache_prompt=cache_prompt)
        with self._wake:
            self._inbox.append(req)
            self.metrics.requests_total += 1
            self._wake.notify()
        return req

    def submit_choices(self, prompt_ids: list[int], params: list[SamplingParams],
                       on_events: list[Callable[[Event], None]], marks: tuple[int, ...] = (),
                       cache_prompt: bool = True) -> list[Request]:
        """n requests for one prompt (n choices): the prompt is prefilled once and its state copied to the
        others' slots (as far as slots are free; the rest prefill it again when a slot frees up)."""
        reqs = [Request(prompt_ids, p, self.tokenizer, on_event=f, marks=marks, cache_prompt=cache_prompt)
                for p, f in zip(params, on_events)]
        reqs[0].followers = reqs[1:]
        with self._wake:
            self._inbox.append(reqs[0])
            self.metrics.requests_total += len(reqs)
            self._wake.notify()
        return reqs

    def cancel(self, req: Request) -> None:
        """Stop a request (a client went away); its slot is freed at the next step."""
        with self._wake:
            req.cancelled = True
            self._wake.notify()

    def cancel_all(self) -> None:
        """Stop every request, queued or running (the server is shutting down); each ends with "cancelled"
        at the next step."""
        with self._wake:
            for req in _with_followers(self._inbox):
                req.cancelled = True
            self._cancel_all = True  # the queues are the engine thread's: it cancels what they hold
            self._wake.notify()

    def between_steps(self, fn: Callable[[], object]) -> Future:
        """Run fn() on the engine thread between two steps (where no forward pass touches the cache: slot
        save / restore); its result or exception arrives in the future."""
        done: Future = Future()
        with self._wake:
            if self._stopped:
                raise RuntimeError("the engine is stopped")
            self._calls.append((fn, done))
            self._wake.notify()
        return done

    def queue_depth(self) -> int:
        return len(self._inbox) + len(self.scheduler.waiting)

    def waiting_for_slot(self) -> int:
        """Queued requests that a free slot will not take at the next step (the others are as good as
        running: a burst of requests passes through the queue on its way to idle slots)."""
        return max(self.queue_depth() - self.runner.free_slots(), 0)

    def running(self) -> int:
        return len(self.scheduler.running)

    def close(self, timeout: float = 10) -> bool:
        """Stop the engine thread, waiting at most `timeout` seconds for the step it is in; whether it stopped."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stopped or self._inbox or self._calls or self.scheduler.has_work):
                    self._wake.wait()
                if self._stopped:
                    break
                inbox, self._inbox = self._inbox, []
                calls, self._calls = self._calls, []
                cancel_all, self._cancel_all = self._cancel_all, False
            for fn, done in calls:
                try:
                    done.set_result(fn())
                except Exception as e:  # the caller's to report
                    done.set_exception(e)
            for req in _with_followers([*self.scheduler.waiting, *self.scheduler.running]) if cancel_all else []:
                req.cancelled = True
            for req in inbox:
                self.scheduler.add(req, self.speculator)
            try:  # a failed pass ends only its own requests, inside step; this is for errors outside any pass
                self.scheduler.step()
            except Exception as e:  # a bug must not hang every client: end the running requests, serve the rest
                log.exception("an engine step failed; the running requests end with the error")
                self.scheduler.abort(f"engine error: {type(e).__name__}: {e}")
        for req in _with_followers(self.scheduler.running + list(self.scheduler.waiting) + self._inbox):
            req.finish("cancelled")
        for _, done in self._calls:
            done.set_exception(RuntimeError("the engine stopped"))


def _with_followers(reqs: list[Request]) -> list[Request]:
    return [r for req in reqs for r in (req, *req.followers)]


class _TimedScheduler(Scheduler):
    """The scheduler, counting tokens and seconds per phase for /metrics."""

    def __init__(self, runner, prefill_chunk, spec_max_batch=None):
        super().__init__(runner, prefill_chunk, spec_max_batch)
        self.metrics = Metrics()

    def _decode(self):
        before = sum(len(r.output_ids) for r in self.running)  # speculative steps may add several per request
        t = time.perf_counter()
        super()._decode()
        self.metrics.decode_seconds += time.perf_counter() - t
        self.metrics.decode_tokens += sum(len(r.output_ids) for r in self.running) - before

    def _prefill(self):
        reqs = list(self.running)  # n > 1: the copies of a prefilled prompt that join here were not prefilled
        before = sum(r.n_fed for r in reqs)
        t = time.perf_counter()
        super()._prefill()
        self.metrics.prefill_seconds += time.perf_counter() - t
        self.metrics.prefill_tokens += sum(r.n_fed for r in reqs) - before

    def _drop_finished(self):
        for req in self.running:
            if req.done is not None or req.cancelled:
                self.metrics.requests_finished += 1
                self.metrics.prompt_tokens_total += len(req.prompt_ids)
                self.metrics.generated_tokens_total += len(req.output_ids)
                self.metrics.cached_tokens_total += req.cached
        super()._drop_finished()

"""Helpers of the engine's recovery and isolation tests: injected faults, and requests submitted to an
Engine over the embedded model whose tokens are compared with a fault-free LLM's."""

from __future__ import annotations

import functools
import threading
import time

from deltaserve.engine.engine import Engine
from deltaserve.engine.request import Done
from deltaserve.engine.sampling import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)
N = 10  # tokens per request
CHUNK = 16  # prefill chunk, also the checkpoint interval: prompts cross several
VERSE = "KING HENRY:\nOnce more unto the breach, dear friends, once more;\nOr close the wall up with our English dead."
PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo! wherefore art thou", VERSE, VERSE + "\nIn peace there's nothing"]
# prompt lookup finds a draft in the first tokens after this one (few prompts give drafts that early)
REPEAT = "KING HENRY:\nOnce more unto the breach, dear friends, once more;\n" * 2 + "Once more unto"
WAIT = 60  # seconds; a request that takes longer has hung


class Fault:
    """Stands in for `real`: the `nth` call for which `when(*args)` holds raises RuntimeError (after running
    the real call, with after=True); every other call is the real one. every=True: every call from the
    nth on for which `when` holds raises (a request that breaks each pass it is in)."""

    def __init__(self, real, nth: int = 1, when=lambda *args, **kwargs: True, after: bool = False,
                 every: bool = False):
        functools.update_wrapper(self, real)  # keeps the signature: the runner inspects model.forward's
        self.real, self.nth, self.when, self.after, self.every = real, nth, when, after, every
        self.seen = 0

    @property
    def fired(self) -> bool:
        return self.seen >= self.nth

    def __call__(self, *args, **kwargs):
        if (self.fired and not self.every) or not self.when(*args, **kwargs):
            return self.real(*args, **kwargs)
        self.seen += 1
        if self.seen < self.nth:
            return self.real(*args, **kwargs)
        if self.after:
            self.real(*args, **kwargs)
        raise RuntimeError("injected fault")


def decoding(tokens, *args, **kwargs) -> bool:
    """A model call that feeds one token per row: a decode step."""
    return tokens.shape[1] == 1


def prefilling(tokens, *args, **kwargs) -> bool:
    return tokens.shape[1] > 1


class Pending:
    """A submitted request and its events."""

    def __init__(self, engine: Engine, prompt: str | tuple[int, ...], params: SamplingParams | None = None):
        ids = list(prompt) if isinstance(prompt, tuple) else engine.tokenizer.encode(prompt)
        self.events, self.finished = [], threading.Event()
        self.req = engine.submit(ids, params or SamplingParams(max_tokens=N, **GREEDY), self.on)

    def on(self, event):
        self.events.append(event)
        if isinstance(event, Done):
            self.finished.set()

    def done(self) -> Done:
        assert self.finished.wait(WAIT), "the request hung"
        return self.events[-1]


def together(engine: Engine, *prompts: str | tuple[int, ...]) -> list[Pending]:
    """Requests submitted while the engine's loop cannot take its queue (it takes it under this lock, which
    submit takes again: re-entrant), so that its next step sees them all: two submitted one after the other
    were first stepped apart in 1 of 3 runs here."""
    with engine._wake:
        return [Pending(engine, prompt) for prompt in prompts]


def serve(engine: Engine, prompt: str | tuple[int, ...]) -> Done:
    return Pending(engine, prompt).done()


def settles(engine: Engine) -> bool:
    """Whether the engine ends its step and holds no request (a Done goes out before the step ends)."""
    deadline = time.monotonic() + WAIT
    while engine.queue_depth() or engine.running():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True

"""The engine survives its errors. A fault injected once into the real model, sampler, drafter or a prefill
chunk ends the requests it hit with a clear error; the requests after it get exactly the greedy tokens a
fault-free LLM gives (the reference), so no slot keeps a half-written state.

Model faults fire after the real pass has run: the slot's state then holds a token its history does not.
A slot reused without a reset shows it when a later prompt extends what the failed request had fed, so
the requests after a fault include one that continues the failed prompt with its own greedy tokens.
"""

from __future__ import annotations

import functools
import logging
import threading
import time

import pytest

import deltaserve.engine.scheduler
from deltaserve.engine.engine import Engine
from deltaserve.engine.llm import DEFAULT_MODEL, LLM, load
from deltaserve.engine.request import Delta, Done
from deltaserve.engine.sampling import SamplingParams
from deltaserve.errors import DeltaserveError

pytestmark = pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason="the embedded model is not built in this checkout")

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
    the real call, with after=True); every other call is the real one."""

    def __init__(self, real, nth: int = 1, when=lambda *args, **kwargs: True, after: bool = False):
        functools.update_wrapper(self, real)  # keeps the signature: the runner inspects model.forward's
        self.real, self.nth, self.when, self.after = real, nth, when, after
        self.seen = 0

    @property
    def fired(self) -> bool:
        return self.seen >= self.nth

    def __call__(self, *args, **kwargs):
        if self.fired or not self.when(*args, **kwargs):
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


@pytest.fixture(scope="module")
def reference():
    """prompt (text or a tuple of ids) -> the greedy tokens of a fault-free LLM, whose model is its own."""
    llm = LLM(None, max_len=256, prefill_chunk=CHUNK, checkpoint_interval=CHUNK)
    return functools.cache(lambda prompt: llm.generate(list(prompt) if isinstance(prompt, tuple) else prompt,
                                                       max_tokens=N, **GREEDY).token_ids)


@pytest.fixture(scope="module")
def loaded():
    return load(None)


@pytest.fixture
def engine(loaded):
    """A fresh engine over the embedded model, per test (faults go on its model or its parts)."""
    made = []

    def make(**kwargs) -> Engine:
        model, tokenizer = loaded
        made.append(Engine(model, tokenizer, max_len=256, prefill_chunk=CHUNK, checkpoint_interval=CHUNK,
                           **{"n_slots": 2, **kwargs}))
        return made[-1]

    yield make
    for e in made:
        e.close()


class Pending:
    """A submitted request and its events."""

    def __init__(self, engine: Engine, prompt: str | tuple[int, ...]):
        ids = list(prompt) if isinstance(prompt, tuple) else engine.tokenizer.encode(prompt)
        self.events, self.finished = [], threading.Event()
        self.req = engine.submit(ids, SamplingParams(max_tokens=N, **GREEDY), self.on)

    def on(self, event):
        self.events.append(event)
        if isinstance(event, Done):
            self.finished.set()

    def done(self) -> Done:
        assert self.finished.wait(WAIT), "the request hung"
        return self.events[-1]


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


def continued(tokenizer, reference, prompt: str) -> tuple[int, ...]:
    """`prompt` and the first greedy tokens after it, as token ids: it extends what a request for `prompt`
    had fed when it failed."""
    return (*tokenizer.encode(prompt), *reference(prompt)[:6])


def assert_failed_clearly(done: Done):
    assert done.reason == "error" and "RuntimeError" in done.error and "injected fault" in done.error


def assert_serves_correctly(engine: Engine, reference, failed: str, prompts=PROMPTS):
    """The prompts, one after another, and one continuing the `failed` prompt get the fault-free tokens."""
    for prompt in [continued(engine.tokenizer, reference, failed), *prompts]:
        done = serve(engine, prompt)
        assert (done.reason, done.token_ids) == ("length", reference(prompt)), prompt


def failures(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "deltaserve.engine" and r.exc_info]


@pytest.mark.parametrize("call", ["prefill", "decode"])
def test_one_slot_two_requests_a_forward_error(call, engine, loaded, reference, monkeypatch, caplog):
    """The issue's case: the first request fails, the second (which waited for the slot, untouched)
    succeeds, and so does a third."""
    eng = engine(n_slots=1)
    model = loaded[0]
    fault = Fault(model.forward, when=decoding if call == "decode" else prefilling, after=True)
    monkeypatch.setattr(model, "forward", fault)
    first, second = Pending(eng, VERSE), Pending(eng, PROMPTS[1])
    assert_failed_clearly(first.done())
    assert second.done().token_ids == reference(PROMPTS[1])
    assert fault.fired and len(failures(caplog)) == 1
    third = continued(eng.tokenizer, reference, VERSE)
    assert serve(eng, third).token_ids == reference(third)
    assert settles(eng) and eng.runner.free_slots() == 1


def test_forward_error_in_a_decode_step(engine, loaded, reference, monkeypatch, caplog):
    """Two requests decode side by side; the third decode pass fails. Whichever it served end with the
    error, keeping the tokens they had made."""
    eng = engine(n_slots=2)
    model = loaded[0]
    monkeypatch.setattr(model, "forward", Fault(model.forward, nth=3, when=decoding, after=True))
    a, b = Pending(eng, VERSE), Pending(eng, PROMPTS[0])
    results = [a.done(), b.done()]
    failed = [d for d in results if d.reason == "error"]
    assert failed, "the fault hit no request"
    for done in failed:
        assert_failed_clearly(done)
        assert len(done.token_ids) >= 1  # it had been decoding: what it made is kept in the final event
    for done, prompt in zip(results, [VERSE, PROMPTS[0]]):
        assert done in failed or done.token_ids == reference(prompt)
    assert len(failures(caplog)) == 1
    assert_serves_correctly(eng, reference, VERSE)
    assert settles(eng) and eng.metrics.requests_finished == 3 + len(PROMPTS)  # counted after their Done


def test_sampling_error(engine, reference, monkeypatch):
    """The sampler, as the scheduler calls it, fails once: at the end of the first prompt's prefill."""
    eng = engine()
    fault = Fault(deltaserve.engine.scheduler.sample)
    monkeypatch.setattr(deltaserve.engine.scheduler, "sample", fault)
    assert_failed_clearly(serve(eng, VERSE))
    assert fault.fired
    assert_serves_correctly(eng, reference, VERSE)


def test_error_in_a_prefill_chunk(engine, loaded, reference, monkeypatch):
    """The second chunk of a long prompt fails after writing the state; the first chunk's checkpoint stays
    valid, and the same prompt restores from it and gives the fault-free tokens."""
    eng = engine()
    model = loaded[0]
    ids = eng.tokenizer.encode(VERSE)
    assert len(ids) > CHUNK + 1
    monkeypatch.setattr(model, "forward", Fault(model.forward, nth=2, after=True))
    assert_failed_clearly(serve(eng, VERSE))
    restored = eng.runner.cache.restored_tokens
    assert serve(eng, VERSE).token_ids == reference(VERSE)
    assert eng.runner.cache.restored_tokens == restored + CHUNK
    assert_serves_correctly(eng, reference, VERSE)


def test_drafter_error(engine, reference, monkeypatch):
    """Prompt lookup fails at the first decode step; the speculative requests after it get the plain
    greedy tokens."""
    eng = engine(speculative="ngram")
    drafter = eng.speculator.drafter
    fault = Fault(drafter.propose)
    monkeypatch.setattr(drafter, "propose", fault)
    assert_failed_clearly(serve(eng, REPEAT))
    assert fault.fired
    assert_serves_correctly(eng, reference, REPEAT, [REPEAT, *PROMPTS])
    assert eng.speculator.steps > 0  # the requests after it decoded speculatively


def test_draft_model_error_mid_draft(engine, reference, monkeypatch):
    """The draft model fails in its second call, which drafts: its own slot is left ahead of its history."""
    eng = engine(n_slots=1, speculative=str(DEFAULT_MODEL), spec_tokens=3)  # the failed slot drafts again
    draft = eng.speculator.drafter.model
    monkeypatch.setattr(draft, "forward", Fault(draft.forward, nth=2, after=True))
    assert_failed_clearly(serve(eng, VERSE))
    assert_serves_correctly(eng, reference, VERSE, [VERSE])
    assert eng.speculator.accepted == eng.speculator.proposed > 0  # the same weights: every draft kept


def test_verify_error_fails_the_speculative_batch(engine, loaded, reference, monkeypatch):
    """The pass that checks drafts (it keeps per-token snapshots) fails after writing the state."""
    eng = engine(speculative="ngram")
    model = loaded[0]
    fault = Fault(model.forward, when=lambda *a, snapshots=None, **k: snapshots is not None, after=True)
    monkeypatch.setattr(model, "forward", fault)
    done = serve(eng, REPEAT)
    assert fault.fired
    assert_failed_clearly(done)
    assert_serves_correctly(eng, reference, REPEAT)


# ---------------------------------------------------------------------------- the synchronous API
@pytest.fixture
def llm():
    return LLM(None, max_len=256, prefill_chunk=CHUNK, checkpoint_interval=CHUNK)


def test_llm_forward_error_then_clean(llm, reference, monkeypatch):
    monkeypatch.setattr(llm.model, "forward", Fault(llm.model.forward, when=decoding, nth=2, after=True))
    with pytest.raises(DeltaserveError, match="RuntimeError: injected fault"):
        llm.generate(VERSE, max_tokens=N, **GREEDY)
    assert llm.runner.free_slots() == 1 and not llm.scheduler.has_work
    for prompt in [continued(llm.tokenizer, reference, VERSE), VERSE]:
        assert llm.generate(list(prompt) if isinstance(prompt, tuple) else prompt, max_tokens=N,
                            **GREEDY).token_ids == reference(prompt)


def test_llm_stream_raises_the_error(llm, reference, monkeypatch):
    monkeypatch.setattr(llm.model, "forward", Fault(llm.model.forward, when=decoding, nth=3, after=True))
    pieces = []
    with pytest.raises(DeltaserveError, match="RuntimeError"):
        for piece in llm.generate(VERSE, max_tokens=N, stream=True, **GREEDY):
            pieces.append(piece)
    assert pieces and "".join(pieces) == llm.tokenizer.decode(reference(VERSE))[:len("".join(pieces))]
    more = continued(llm.tokenizer, reference, VERSE)
    assert llm.generate(list(more), max_tokens=N, **GREEDY).token_ids == reference(more)


def test_llm_score_error_then_clean(llm, reference, monkeypatch):
    ids = llm.tokenizer.encode(VERSE)
    full = llm.score(ids)
    monkeypatch.setattr(llm.model, "forward", Fault(llm.model.forward, nth=2, after=True))
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.score(ids)
    monkeypatch.undo()  # the slot holds the first chunk's tokens, which VERSE extends
    assert llm.generate(VERSE, max_tokens=N, **GREEDY).token_ids == reference(VERSE)
    assert llm.score(ids).equal(full)


def test_events_of_a_failed_request_end_with_one_done(engine, loaded, monkeypatch):
    eng = engine()
    model = loaded[0]
    monkeypatch.setattr(model, "forward", Fault(model.forward, when=decoding, nth=4))
    pending = Pending(eng, VERSE)
    done = pending.done()
    assert_failed_clearly(done)
    assert [type(e) for e in pending.events].count(Done) == 1 and all(isinstance(e, Delta) for e in pending.events[:-1])
    assert "".join(e.text for e in pending.events[:-1]) == done.text

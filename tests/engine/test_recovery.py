"""The engine survives its errors. A fault injected once into the real model, sampler, drafter or a prefill
chunk ends the request it hit with a clear error (a batched pass is run again for each of its requests
alone, so a fault there harms none of them); the requests after it get exactly the greedy tokens a
fault-free LLM gives (the reference), so no slot keeps a half-written state.

Model faults fire after the real pass has run: the slot's state then holds a token its history does not.
A slot reused without a reset shows it when a later prompt extends what the failed request had fed, so
the requests after a fault include one that continues the failed prompt with its own greedy tokens.
"""

from __future__ import annotations

import logging

import pytest

import deltaserve.engine.scheduler
from deltaserve.engine.engine import Engine
from deltaserve.engine.llm import DEFAULT_MODEL, LLM
from deltaserve.engine.request import Delta, Done
from deltaserve.errors import DeltaserveError

from .faults import CHUNK, GREEDY, N, PROMPTS, REPEAT, VERSE, Fault, Pending, decoding, prefilling, serve, settles, together

pytestmark = pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason="the embedded model is not built in this checkout")


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
def test_one_slot_two_requests_a_forward_error(call, engine, embedded, reference, monkeypatch, caplog):
    """The issue's case: the first request fails, the second (which waited for the slot, untouched)
    succeeds, and so does a third."""
    eng = engine(n_slots=1)
    model = embedded[0]
    fault = Fault(model.forward, when=decoding if call == "decode" else prefilling, after=True)
    monkeypatch.setattr(model, "forward", fault)
    first, second = Pending(eng, VERSE), Pending(eng, PROMPTS[1])
    assert_failed_clearly(first.done())
    assert second.done().token_ids == reference(PROMPTS[1])
    assert fault.fired and len(failures(caplog)) == 1
    third = continued(eng.tokenizer, reference, VERSE)
    assert serve(eng, third).token_ids == reference(third)
    assert settles(eng) and eng.runner.free_slots() == 1


def test_forward_error_in_a_decode_step(engine, embedded, reference, monkeypatch, caplog):
    """Two requests decode side by side; a decode pass over both fails once, after writing both slots. Each
    is brought back to its tokens before the pass and decoded alone: neither is harmed."""
    eng = engine(n_slots=2)
    model = embedded[0]
    fault = Fault(model.forward, when=lambda tokens, *a, **k: tuple(tokens.shape) == (2, 1), after=True)
    monkeypatch.setattr(model, "forward", fault)
    a, b = together(eng, VERSE, PROMPTS[0])
    assert [a.done().token_ids, b.done().token_ids] == [reference(VERSE), reference(PROMPTS[0])]
    assert fault.fired and len(failures(caplog)) == 1
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


def test_error_in_a_prefill_chunk(engine, embedded, reference, monkeypatch):
    """The second chunk of a long prompt fails after writing the state; the first chunk's checkpoint stays
    valid, and the same prompt restores from it and gives the fault-free tokens."""
    eng = engine()
    model = embedded[0]
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


def test_verify_error_fails_the_speculative_batch(engine, embedded, reference, monkeypatch):
    """The pass that checks drafts (it keeps per-token snapshots) fails after writing the state."""
    eng = engine(speculative="ngram")
    model = embedded[0]
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


def test_events_of_a_failed_request_end_with_one_done(engine, embedded, monkeypatch):
    eng = engine()
    model = embedded[0]
    monkeypatch.setattr(model, "forward", Fault(model.forward, when=decoding, nth=4))
    pending = Pending(eng, VERSE)
    done = pending.done()
    assert_failed_clearly(done)
    assert [type(e) for e in pending.events].count(Done) == 1 and all(isinstance(e, Delta) for e in pending.events[:-1])
    assert "".join(e.text for e in pending.events[:-1]) == done.text

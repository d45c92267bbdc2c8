"""One request never harms another in the engine: whatever its sampling values or prompt ids, and whatever
breaks in a batched pass it shares, the other requests get exactly the greedy tokens a fault-free LLM
gives them alone (the reference)."""

from __future__ import annotations

import pytest

from deltaserve.engine.llm import DEFAULT_MODEL
from deltaserve.engine.sampling import SamplingParams

from .faults import GREEDY, N, PROMPTS, REPEAT, VERSE, Fault, Pending, serve, settles, together

pytestmark = pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason="the embedded model is not built in this checkout")

RETRIED = "running each alone"  # what the scheduler logs when a batched pass failed


def retried(caplog) -> int:
    return sum(RETRIED in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("values", [
    dict(temperature=1e-40), dict(temperature=5e-324), dict(temperature=1.0, top_p=5e-324),
    dict(temperature=2.0, min_p=5e-324, top_k=10**30), dict(temperature=1e-300, top_p=1e-40, min_p=1.0),
    dict(temperature=2.0, seed=2**64 - 1), dict(temperature=0.5, seed=-2**63),
], ids=["temp_1e-40", "temp_denormal", "top_p_denormal", "min_p_denormal", "all_tiny", "seed_max", "seed_min"])
def test_extreme_sampling_values_beside_a_greedy_request(values, engine, reference):
    """Values at the edges of what SamplingParams accepts generate normally, in the same batch as a greedy
    request; a temperature too small to divide by is greedy."""
    eng = engine(n_slots=2)
    normal = Pending(eng, VERSE)
    extreme = Pending(eng, PROMPTS[1], SamplingParams(max_tokens=N, ignore_eos=True, **values))
    assert (normal.done().reason, normal.done().token_ids) == ("length", reference(VERSE))
    done = extreme.done()
    assert done.reason == "length" and len(done.token_ids) == N, done.error
    if values["temperature"] < 1e-5 or values.get("top_p", 1) < 1e-30:
        assert done.token_ids == reference(PROMPTS[1])
    assert settles(eng) and eng.runner.free_slots() == 2


def test_prompt_ids_past_the_embedding_fail_alone(engine, reference):
    """Ids a tokenizer may hold but the model's embedding does not: that request ends with a clear error
    before it reaches a batch; the one beside it is served."""
    eng = engine()
    bad = Pending(eng, (5, eng.vocab_size + 3))
    normal = Pending(eng, VERSE)
    done = bad.done()
    assert done.reason == "error" and "outside the vocabulary" in done.error and str(eng.vocab_size) in done.error
    assert normal.done().token_ids == reference(VERSE)
    assert settles(eng)


def test_a_request_that_breaks_every_pass_fails_alone(engine, embedded, reference, monkeypatch, caplog):
    """A request whose every pass fails once it decodes (its state, say), batched with a healthy one:
    the batched pass fails, both run alone, only the breaking one ends with the error."""
    eng = engine(n_slots=2)
    model = embedded[0]
    broken = []

    def breaks(tokens, state, slots, **kwargs) -> bool:
        req = broken[0].req if broken else None
        return req is not None and req.done is None and not req.prefilling and req.slot in slots.tolist()

    monkeypatch.setattr(model, "forward", Fault(model.forward, when=breaks, after=True, every=True))
    normal = Pending(eng, VERSE)
    broken.append(Pending(eng, PROMPTS[1]))
    done = broken[0].done()
    assert done.reason == "error" and "injected fault" in done.error
    assert normal.done().token_ids == reference(VERSE)
    assert retried(caplog) >= 1
    for prompt in PROMPTS:  # the slot it held serves again
        assert serve(eng, prompt).token_ids == reference(prompt)
    assert settles(eng) and eng.runner.free_slots() == 2


def test_a_failed_batched_draft_harms_no_request(engine, reference, monkeypatch, caplog):
    """Prompt lookup fails once over two speculative requests: each drafts again alone and decodes on."""
    eng = engine(speculative="ngram")
    drafter = eng.speculator.drafter
    fault = Fault(drafter.propose, when=lambda slots, *a, **k: len(slots) == 2)
    monkeypatch.setattr(drafter, "propose", fault)
    a, b = together(eng, REPEAT, REPEAT)
    assert [a.done().token_ids, b.done().token_ids] == [reference(REPEAT)] * 2
    assert fault.fired and retried(caplog) == 1


def test_a_failed_batched_verify_harms_no_request(engine, embedded, reference, monkeypatch, caplog):
    """The pass that checks two requests' drafts fails once after writing both slots (with their
    snapshots): each is rebuilt from its checkpoint and decoded alone. (A prefill budget for both prompts
    in one step makes them draft, at their first decode step, together; checkpoints still cut the passes
    where the reference's do.)"""
    eng = engine(speculative="ngram", prefill_chunk=128)
    model = embedded[0]
    fault = Fault(model.forward, after=True,
                  when=lambda tokens, *a, snapshots=None, **k: snapshots is not None and tokens.shape[0] == 2)
    monkeypatch.setattr(model, "forward", fault)
    a, b = together(eng, REPEAT, REPEAT)
    assert [a.done().token_ids, b.done().token_ids] == [reference(REPEAT)] * 2
    assert fault.fired and retried(caplog) == 1
    assert serve(eng, VERSE).token_ids == reference(VERSE)
    assert settles(eng)


def test_a_failed_one_call_mtp_step_harms_no_request(engine, embedded, reference, monkeypatch, caplog):
    """The one-call greedy MTP step (drafts, verify, rollback: models/qwen/plan.py) over two requests fails once
    after writing both slots and their MTP caches: each is rebuilt from its checkpoint and decoded alone; both
    then go on drafting, and every output is the reference's."""
    eng = engine(speculative="mtp", prefill_chunk=128)
    model = embedded[0]
    fault = Fault(model.mtp_greedy_step, after=True, when=lambda state, slots, *a: len(slots) == 2)
    monkeypatch.setattr(model, "mtp_greedy_step", fault)
    a, b = together(eng, REPEAT, REPEAT)
    assert [a.done().token_ids, b.done().token_ids] == [reference(REPEAT)] * 2
    assert fault.fired and retried(caplog) == 1 and eng.speculator.steps > 0
    assert serve(eng, VERSE).token_ids == reference(VERSE)
    assert settles(eng)


def test_greedy_params_are_the_reference_under_any_seed(engine, reference):
    """Greedy ignores the seed and the filters: a request with every extreme filter value stays greedy."""
    eng = engine()
    done = Pending(eng, VERSE, SamplingParams(max_tokens=N, seed=2**64 - 1, top_p=5e-324, min_p=1.0, top_k=10**9,
                                              **GREEDY)).done()
    assert done.token_ids == reference(VERSE)

"""Speculative decoding: drafters, the acceptance rule, and greedy output identical to plain decoding."""


import pytest
import torch

from deltaserve.engine.speculative import NgramDrafter, accept
from deltaserve.engine.engine import Engine
from deltaserve.engine.llm import DEFAULT_MODEL, LLM
from deltaserve.engine.sampling import SamplingParams
from deltaserve.errors import DeltaserveError

from tests.conftest import ARCHES
from tests.engine.runs import run_to_end

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.mark.parametrize("context, k, want", [
    ([1, 2, 3, 4, 9, 9, 1, 2, 3], 3, [4, 9, 9]),  # the last 3 tokens seen before: what followed them
    ([5, 2, 3, 6, 8, 1, 2, 3], 2, [6, 8]),  # no earlier [1, 2, 3]: the 2-gram [2, 3] is found
    ([3, 1, 3, 2, 3], 1, [2]),  # the latest earlier occurrence wins
    ([7, 8, 7], 4, [8, 7]),  # a continuation runs up to the end of the context
    ([1, 2, 3], 3, []),  # nothing repeats
], ids=["3-gram", "2-gram", "latest", "short", "none"])
def test_ngram_lookup(context, k, want):
    assert NgramDrafter(max_n=3, min_n=1).lookup(context, k) == want


def test_greedy_acceptance_keeps_the_matching_prefix_and_adds_the_models_token():
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([2, 5, 0, 3]):  # the target's argmax after [last, d1, d2, d3]
        logits[row, best] = 1.0
    params, gen = SamplingParams(temperature=0), torch.Generator()
    assert accept(logits, [2, 5, 1], params, gen) == [2, 5, 0]  # d3 = 1 rejected: the target says 0
    assert accept(logits, [2, 5, 0], params, gen) == [2, 5, 0, 3]  # all accepted, plus a bonus token
    assert accept(logits, [4, 5, 0], params, gen) == [2]
    assert accept(logits, [], params, gen) == [2]


def test_sampled_acceptance_draws_from_the_target_distribution():
    logits = torch.tensor([[0.3, 1.2, -0.5, 0.9, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.7)
    p = torch.softmax(logits[0].double() / 0.7, -1)  # what plain sampling draws the first token from
    gen = torch.Generator().manual_seed(0)
    n = 6000
    counts = torch.zeros(5, dtype=torch.float64)
    for _ in range(n):
        counts[accept(logits, [1], params, gen)[0]] += 1  # draft 1 is proposed every time
    sigma = (p * (1 - p) / n).sqrt()
    assert ((counts / n - p).abs() < 4.5 * sigma).all(), (counts / n, p)


@pytest.fixture(scope="module")
def llms(model_path):
    """arch -> an LLM with checkpoints every 16 tokens, so speculative passes cross several."""
    return {arch: LLM(model_path(arch), max_len=160, prefill_chunk=24, checkpoint_interval=16) for arch in ARCHES}


@pytest.mark.parametrize("arch", ARCHES)
def test_speculative_greedy_output_equals_plain_greedy(arch, llms, model_path):
    llm = llms[arch]
    itself, rounded = str(model_path(arch)), str(model_path(arch, dtype="q8_0"))  # the same weights, rounded
    cases = [("ngram", 3), ("ngram", 5), (itself, 4), (rounded, 1), (rounded, 3)]
    prompt = "the cat sat on the mat and the dog sat on the log; the cat sat"
    plain = llm.generate(prompt, max_tokens=45, speculative=False, **GREEDY)
    for spec, k in cases:
        llm.spec_tokens = k
        llm.speculators.clear()
        out = llm.generate(prompt, max_tokens=45, speculative=spec, **GREEDY)
        assert (out.token_ids, out.finish_reason) == (plain.token_ids, plain.finish_reason), (spec, k)
        s = llm.speculators[spec]
        assert s.accepted <= s.proposed
        if spec == itself:
            assert s.accepted == s.proposed  # every draft accepted
        if spec == rounded:
            assert 0 < s.accepted  # accepted until the rounding tips a choice


@pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason="the embedded model is not built in this checkout")
def test_prompt_lookup_on_a_trained_model_that_repeats_itself():
    llm = LLM(None, max_len=512, checkpoint_interval=64)
    prompt = "KING HENRY:\nOnce more unto the breach, dear friends, once more;\n"
    plain = llm.generate(prompt, max_tokens=150, speculative=False, **GREEDY)
    out = llm.generate(prompt, max_tokens=150, speculative="ngram", **GREEDY)
    assert out.token_ids == plain.token_ids
    s = llm.speculators["ngram"]
    assert 0 < s.accepted < s.proposed  # drafts both taken and refused


def test_speculative_stops_where_plain_decoding_stops(llms, model_path):
    llm = llms["qwen35"]
    prompt = "Round and round"
    plain = llm.generate(prompt, max_tokens=40, speculative=False, **GREEDY)
    stop = plain.text[10:13]
    for spec in ("ngram", str(model_path("qwen35"))):
        out = llm.generate(prompt, max_tokens=40, speculative=spec, stop=stop, **GREEDY)
        assert out.finish_reason == "stop" and out.text == plain.text[:plain.text.find(stop)]
    small = LLM(model_path("qwen35"), max_len=30, checkpoint_interval=16)  # the context fills up mid-draft
    ids = small.tokenizer.encode(prompt)
    want = small.generate(ids, max_tokens=100, speculative=False, **GREEDY)
    got = small.generate(ids, max_tokens=100, speculative=str(model_path("qwen35")), **GREEDY)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "length"


def test_sampled_speculative_decoding_is_reproducible(llms, model_path):
    llm = llms["qwen3next"]
    kw = dict(max_tokens=30, temperature=0.9, top_k=40, seed=11, ignore_eos=True, speculative=str(model_path("qwen3next")))
    a = llm.generate("Once", **kw)
    assert a.token_ids == llm.generate("Once", **kw).token_ids and len(a.token_ids) == 30


def test_batched_speculative_requests_each_get_their_plain_output(loaded, model_path):
    model, tokenizer = loaded("qwen35moe")
    prompts = ["a b a b a b a b", "one two three one two three one", "Quietly"]
    solo = LLM(model_path("qwen35moe"), max_len=128)
    want = [solo.generate(p, max_tokens=25, **GREEDY).token_ids for p in prompts]
    engine = Engine(model, tokenizer, n_slots=3, max_len=128, prefill_chunk=8, checkpoint_interval=16,
                    speculative=str(model_path("qwen35moe", dtype="q8_0")), spec_tokens=3)
    done = run_to_end(engine, [tokenizer.encode(p) for p in prompts], SamplingParams(max_tokens=25, **GREEDY), 60)
    assert [d.token_ids for d in done] == want
    assert engine.speculator.steps > 0 and engine.metrics.decode_tokens == sum(len(w) for w in want) - len(want)


def test_speculator_arguments_are_checked(llms):
    with pytest.raises(DeltaserveError, match="neither 'ngram' nor an existing draft model"):
        llms["qwen35"].generate("hi", max_tokens=2, speculative="no/such/model.gguf")

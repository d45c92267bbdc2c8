"""LLM.generate / score on a tiny random model: incremental decode against teacher-forced scoring."""

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.engine.runner import ModelRunner
from deltaserve.errors import DeltaserveError

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    return LLM(tiny_gguf, max_len=256, prefill_chunk=5)


def test_greedy_tokens_are_the_argmax_of_full_sequence_logits(llm):
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate(ids, max_tokens=24, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 24 and out.finish_reason == "length"
    logits = llm.score(ids + out.token_ids)  # one fresh pass over everything, prefilled in chunks of 5
    assert logits.shape == (len(ids) + 24, llm.model.config.vocab_size) and logits.dtype == torch.float32
    assert logits[len(ids) - 1:-1].argmax(-1).tolist() == out.token_ids
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_stream_pieces_join_to_the_text(llm):
    full = llm.generate(PROMPT, max_tokens=20, temperature=0, ignore_eos=True)
    pieces = list(llm.generate(PROMPT, max_tokens=20, temperature=0, ignore_eos=True, stream=True))
    assert "".join(pieces) == full.text and len(pieces) > 1


def test_stop_string_cuts_the_text(llm):
    full = llm.generate(PROMPT, max_tokens=30, temperature=0, ignore_eos=True).text
    stop = full[6:9]
    cut = llm.generate(PROMPT, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == full[:full.find(stop)]
    streamed = "".join(llm.generate(PROMPT, max_tokens=30, temperature=0, ignore_eos=True, stop=stop, stream=True))
    assert streamed == cut.text


def test_seed_makes_sampling_reproducible(llm):
    kw = dict(max_tokens=16, temperature=1.0, top_k=50, top_p=0.95, min_p=0.01, ignore_eos=True)
    a = llm.generate(PROMPT, seed=1, **kw).token_ids
    assert a == llm.generate(PROMPT, seed=1, **kw).token_ids
    assert a != llm.generate(PROMPT, seed=2, **kw).token_ids


def test_a_prompt_extending_the_last_one_reuses_the_live_state(llm, monkeypatch):
    first = llm.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    ids = llm.tokenizer.encode(PROMPT) + first.token_ids[:-1]  # what the slot now holds
    more = ids + llm.tokenizer.encode(" And then")
    fed = []
    real = llm.runner.forward
    monkeypatch.setattr(llm.runner, "forward", lambda slots, toks, **kw: fed.append(len(toks[0])) or real(slots, toks, **kw))
    reused = llm.generate(more, max_tokens=6, temperature=0, ignore_eos=True)
    assert fed[0] == len(more) - len(ids)  # only the new tokens were prefilled
    monkeypatch.undo()
    llm.runner.reset(0)  # the same prompt from a fresh state gives the same tokens
    assert llm.generate(more, max_tokens=6, temperature=0, ignore_eos=True).token_ids == reused.token_ids


def test_abandoned_stream_frees_the_slot(llm):
    stream = llm.generate(PROMPT, max_tokens=50, temperature=0, ignore_eos=True, stream=True)
    next(stream)
    stream.close()
    assert llm.generate(PROMPT, max_tokens=3, temperature=0, ignore_eos=True).finish_reason == "length"


def test_zero_max_tokens(llm):
    out = llm.generate(PROMPT, max_tokens=0)
    assert out.text == "" and out.token_ids == [] and out.finish_reason == "length"


def test_context_limit_ends_generation_with_length(tiny_gguf):
    small = LLM(tiny_gguf, max_len=20)
    ids = small.tokenizer.encode(PROMPT)[:10]
    out = small.generate(ids, max_tokens=100, temperature=0, ignore_eos=True)
    assert out.finish_reason == "length" and len(ids) + len(out.token_ids) == 21  # the last token is never fed


@pytest.mark.parametrize("prompt, match", [("", "empty"), ([10 ** 7], "outside the vocabulary"),
                                           ([1] * 300, "context holds 256")], ids=["empty", "oov", "too_long"])
def test_bad_prompts_raise_one_clear_error(llm, prompt, match):
    with pytest.raises(DeltaserveError, match=match):
        llm.generate(prompt)


def test_n_choices_come_from_one_prefill_each_with_its_own_seed(tiny_gguf, monkeypatch):
    """Choice i of n is what generating alone with seed + i gives (the server's `n` seeds its choices so too),
    and the prompt is prefilled once: the other choices copy its state."""
    alone = LLM(tiny_gguf, max_len=128)
    prompt = alone.tokenizer.encode("ROMEO: what light")
    solo = [alone.generate(prompt, max_tokens=10, temperature=1.0, seed=7 + i, ignore_eos=True) for i in range(3)]
    llm = LLM(tiny_gguf, max_len=128)
    fed = []  # the rows of every forward pass
    real = ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward", lambda self, slots, toks, **kw:
                        fed.append([len(t) for t in toks]) or real(self, slots, toks, **kw))
    choices = llm.generate(prompt, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True, n=3)
    monkeypatch.undo()
    assert [c.token_ids for c in choices] == [s.token_ids for s in solo]
    assert len({tuple(c.token_ids) for c in choices}) > 1  # the seeds differ, and so do the choices
    assert fed[0] == [len(prompt)] and all(rows == [1, 1, 1] for rows in fed[1:])  # one prefill, then decodes
    greedy = llm.generate(prompt, max_tokens=10, temperature=0, n=4)
    assert len(greedy) == 4 and all(c.token_ids == greedy[0].token_ids for c in greedy)
    assert greedy[0].token_ids == alone.generate(prompt, max_tokens=10, temperature=0).token_ids
    with pytest.raises(DeltaserveError, match="n must be"):
        llm.generate(prompt, n=0)
    with pytest.raises(DeltaserveError, match="stream"):
        llm.generate(prompt, n=2, stream=True)

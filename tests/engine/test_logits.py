"""Penalties, logit_bias, min_tokens, stop_token_ids, logprobs and n > 1 choices: the logit adjustments
against hand-computed values, the engine's behaviour against a separate scoring pass (LLM.score) and
against requests run alone."""

import json
import math
import threading

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.engine.logits import process_logits
from deltaserve.engine.request import Done
from deltaserve.engine.sampling import SamplingParams

from .faults import REPEAT

PROMPT = "The quick brown fox jumps over the lazy dog."
# logits of a 5-token vocabulary, with positive and negative values, each a float64 literal
RAW = [2.0, -1.0, 0.5, -3.0, 1.5]


def adjusted(prompt=(), output=(), end=(), **params):
    return process_logits(torch.tensor(RAW, dtype=torch.float64), SamplingParams(**params), list(prompt),
                          list(output), set(end)).tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # tokens 0 (positive) and 1 (negative) in the prompt, 3 (negative) in the output; 2 and 4 unseen
    assert adjusted(prompt=[0, 1], output=[3], repetition_penalty=2.0) == [1.0, -2.0, 0.5, -6.0, 1.5]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    # output: token 4 three times, token 2 once; token 0 only in the prompt is not penalised
    got = adjusted(prompt=[0], output=[4, 2, 4, 4], frequency_penalty=0.5, presence_penalty=0.25)
    assert got == [2.0, -1.0, 0.5 - 0.5 - 0.25, -3.0, 1.5 - 1.5 - 0.25]


def test_negative_penalties_reward_repeats():
    assert adjusted(output=[1, 1], frequency_penalty=-1.0, presence_penalty=-2.0)[1] == -1.0 + 2.0 + 2.0


def test_logit_bias_adds_and_minus_100_bans():
    got = adjusted(logit_bias={1: 3.5, 2: -100, 4: -0.5})
    assert got == [2.0, 2.5, -math.inf, -3.0, 1.0]


def test_min_tokens_bans_end_tokens_until_reached():
    assert adjusted(output=[3], end=[0, 4], min_tokens=2) == [-math.inf, -1.0, 0.5, -3.0, -math.inf]
    assert adjusted(output=[3, 3], end=[0, 4], min_tokens=2) == RAW


def test_first_tokens_hold_the_first_generated_token_only():
    assert adjusted(first_tokens=(1, 4)) == [-math.inf, -1.0, -math.inf, -math.inf, 1.5]
    assert adjusted(output=[2], first_tokens=(1, 4)) == RAW


def test_token_healing_backs_off_the_last_token_and_picks_the_best_that_extends_it():
    """"ROMEO." ends with "." where the plays have ".\n": healed greedy decoding drops the "." and takes the
    likeliest token (by a separate scoring pass) whose text starts with "."; the text continues the prompt."""
    llm = LLM(None, max_len=128)  # the embedded model: its vocabulary has ".\n"
    tok = llm.tokenizer
    ids = tok.encode("ROMEO.")
    assert tok.decode(ids[-1:]) == "."
    out = llm.generate("ROMEO.", max_tokens=6, temperature=0, token_healing=True)
    scores = llm.score(ids[:-1])[-1]
    extending = [i for i in range(tok.vocab_size) if tok.decode([i]).startswith(".")]
    assert tok.encode(".\n")[0] in extending
    best = max(extending, key=lambda i: float(scores[i]))
    assert out.token_ids[0] == best
    assert "." + out.text == tok.decode(out.token_ids)
    plain = llm.generate("ROMEO.", max_tokens=6, temperature=0)  # off by default: the model's own first token,
    first = int(llm.score(ids)[-1].argmax())  # which here ends the text at once
    assert plain.token_ids[:1] == [first] or (plain.token_ids == [] and tok.decode([first]) in ("<|im_end|>", "<|endoftext|>"))


def test_banning_every_token_is_an_error_not_a_nan_naming_what_banned_them():
    with pytest.raises(ValueError, match="^logit_bias leaves no token of the vocabulary to sample$"):
        adjusted(logit_bias={i: -100 for i in range(5)})
    with pytest.raises(ValueError, match="^logit_bias and token healing's first token leave no token"):
        adjusted(logit_bias={1: -100, 4: -100}, first_tokens=(1, 4))


def test_a_grammar_turns_token_healing_off(tiny_gguf):
    """Healing "Answer: " would make the first token start with " ", which JSON on one line never does: the
    grammar decides the first characters (this ended in an error that blamed logit_bias)."""
    from deltaserve.engine.grammar import json_grammar

    llm = LLM(tiny_gguf, max_len=128)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    ids = llm.tokenizer.encode("Answer: ")
    assert llm.tokenizer.healing(ids) is not None  # the prompt would be healed without the grammar
    out = llm.generate("Answer: ", max_tokens=40, temperature=0, grammar=json_grammar(schema), token_healing=True)
    assert out.finish_reason == "stop" and list(json.loads(out.text)) == ["ok"]


@pytest.mark.parametrize("kwargs", [dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                                    dict(repetition_penalty=0), dict(logit_bias={1: 101}), dict(logit_bias={-1: 0}),
                                    dict(min_tokens=-1), dict(stop_token_ids=[-2]), dict(logprobs=21),
                                    dict(prompt_logprobs=-1)])
def test_out_of_range_settings_raise_naming_them(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    return LLM(tiny_gguf, max_len=256, prefill_chunk=7)


def test_logprobs_are_the_log_softmax_of_a_separate_scoring_pass(llm):
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate(ids, max_tokens=12, temperature=0.9, seed=3, ignore_eos=True, logprobs=4,
                       presence_penalty=1.0)
    reference = llm.score(ids + out.token_ids)[len(ids) - 1:-1].double().log_softmax(-1)  # [12, V]
    assert [e.token for e in out.logprobs] == out.token_ids
    for e, row in zip(out.logprobs, reference):
        assert abs(e.logprob - float(row[e.token])) < 1e-4
        best = row.topk(4)
        assert [i for i, _ in e.top] == best.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in e.top], dtype=torch.float64), best.values,
                                   atol=1e-4, rtol=0)


def test_prompt_logprobs_score_every_prompt_token_after_the_first(llm):
    ids = llm.tokenizer.encode(PROMPT * 4)  # several prefill chunks of 7
    llm.generate(ids[:20], max_tokens=2, temperature=0)  # a cached prefix must not hide positions
    out = llm.generate(ids, max_tokens=0, prompt_logprobs=2)
    reference = llm.score(ids).double().log_softmax(-1)
    assert [e.token for e in out.prompt_logprobs] == ids[1:]
    torch.testing.assert_close([e.logprob for e in out.prompt_logprobs],
                               [float(reference[i, t]) for i, t in enumerate(ids[1:])], atol=1e-4, rtol=0)
    assert [[t for t, _ in e.top] for e in out.prompt_logprobs] == reference[:-1].topk(2).indices.tolist()


def test_logit_bias_ban_removes_the_greedy_token(llm):
    ids = llm.tokenizer.encode(PROMPT)
    first = llm.generate(ids, max_tokens=1, temperature=0, ignore_eos=True).token_ids[0]
    banned = llm.generate(ids, max_tokens=8, temperature=0, ignore_eos=True, logit_bias={first: -100})
    assert first not in banned.token_ids
    forced = llm.generate(ids, max_tokens=3, temperature=0, ignore_eos=True, logit_bias={5: 100})
    assert forced.token_ids == [5, 5, 5]


def test_stop_token_ids_end_the_request_and_min_tokens_hold_them_off(llm):
    ids = llm.tokenizer.encode(PROMPT)
    free = llm.generate(ids, max_tokens=6, temperature=0, ignore_eos=True).token_ids
    stopped = llm.generate(ids, max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[free[2]])
    assert stopped.finish_reason == "stop" and stopped.token_ids == free[:free.index(free[2])]
    held = llm.generate(ids, max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[free[0]], min_tokens=3)
    assert free[0] not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_repetition_penalty_changes_the_greedy_choice_as_the_hand_rule_says(llm):
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate(ids, max_tokens=6, temperature=0, ignore_eos=True, repetition_penalty=1.8)
    context = list(ids)
    for token in out.token_ids:  # each token is the argmax of the penalised logits of a fresh scoring pass
        row = llm.score(context)[-1].double()
        seen = torch.tensor(sorted(set(context)))
        row[seen] = torch.where(row[seen] > 0, row[seen] / 1.8, row[seen] * 1.8)
        assert token == int(row.argmax())
        context.append(token)


def test_requests_with_penalties_or_logprobs_decode_without_speculation():
    llm = LLM(None, max_len=256)  # the embedded model: REPEAT gets drafts from prompt lookup
    ids = llm.tokenizer.encode(REPEAT)
    kwargs = dict(max_tokens=10, temperature=0, ignore_eos=True, frequency_penalty=1.2, logprobs=1)
    llm.generate(ids, speculative="ngram", max_tokens=10, temperature=0, ignore_eos=True)
    proposed = llm.speculators["ngram"].proposed
    assert proposed > 0  # this prompt gets drafts...
    plain = llm.generate(ids, **kwargs)
    drafted = llm.generate(ids, speculative="ngram", **kwargs)
    assert drafted.token_ids == plain.token_ids and len(drafted.logprobs) == 10
    assert llm.speculators["ngram"].proposed == proposed  # ...but not with a penalty, which verification skips


def run_choices(engine, ids, params):
    done = [threading.Event() for _ in params]
    results = [None] * len(params)

    def handler(i):
        def on_event(event):
            if isinstance(event, Done):
                results[i] = event
                done[i].set()
        return on_event

    engine.submit_choices(ids, params, [handler(i) for i in range(len(params))])
    for d in done:
        assert d.wait(60)
    return results


@pytest.mark.parametrize("slots", [4, 2], ids=["all-fork", "some-queue"])
def test_n_choices_prefill_once_and_equal_requests_run_alone(engine, slots):
    eng = engine(n_slots=slots)
    tok = eng.tokenizer
    ids = tok.encode(PROMPT * 3)
    params = SamplingParams(max_tokens=9, temperature=1.0, seed=11, ignore_eos=True, logprobs=2).choices(4)
    assert [p.seed for p in params] == [11, 12, 13, 14]
    results = run_choices(eng, ids, params)
    prefilled = eng.metrics.prefill_tokens
    alone = [run_choices(eng, ids, [p])[0] for p in params]
    assert [r.token_ids for r in results] == [a.token_ids for a in alone]
    assert len({tuple(r.token_ids) for r in results}) > 1  # the seeds differ
    for r, a in zip(results, alone):
        torch.testing.assert_close([e.logprob for e in r.logprobs], [e.logprob for e in a.logprobs], atol=1e-4,
                                   rtol=0)
    if slots == 4:  # one prefill: the prompt went through the model once for all four choices
        assert prefilled == len(ids)

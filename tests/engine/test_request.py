"""A request's stop strings and held-back text, against a brute-force reading of the same output."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.engine.request import Delta, Done, Request
from deltaserve.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(embedded):
    return embedded[1]


def held(text: str, stops: list[str]) -> int:
    """Brute force: the longest end of `text` that is a proper prefix of a stop string."""
    return max((n for s in stops for n in range(len(s) - 1, 0, -1) if text.endswith(s[:n])), default=0)


def feed(tokenizer, ids: list[int], stops: list[str]) -> tuple[list[Delta], Done | None, list[str]]:
    """Feed `ids` to a request; its Deltas, its Done, and after each token the text it had produced."""
    events: list = []
    req = Request([1], SamplingParams(max_tokens=10**6, stop=stops, ignore_eos=True), tokenizer,
                  on_event=events.append)
    texts = []
    for token in ids:
        req.add_token(token, room=10**6)
        texts.append(req.text)
        if req.done is not None:
            break
    return [e for e in events if isinstance(e, Delta)], req.done, texts


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet="ab c\n", min_size=1, max_size=60),
       stops=st.lists(st.text(alphabet="ab c\n", min_size=1, max_size=5), min_size=1, max_size=4))
def test_stops_and_held_text_match_brute_force(tokenizer, text, stops):
    ids = tokenizer.encode(text)
    deltas, done, texts = feed(tokenizer, ids, stops)
    sent = "".join(d.text for d in deltas)
    # the request stops at the first token after which its text holds a stop string, cut where one begins
    prefixes = [tokenizer.decode(ids[:n]) for n in range(1, len(ids) + 1)]
    first = next(((p, hits) for p in prefixes if (hits := [i for i in (p.find(s) for s in stops) if i >= 0])), None)
    if done is None:  # no stop yet: everything but what may still become a stop string went out
        assert first is None
        assert sent == texts[-1][:len(texts[-1]) - held(texts[-1], stops)]
    else:
        assert done.reason == "stop" and done.text == first[0][:min(first[1])]
        assert sent == done.text
        assert [t for d in deltas for t in d.token_ids] == done.token_ids[:sum(len(d.token_ids) for d in deltas)]


def test_token_ids_of_the_deltas_join_to_the_output(tokenizer):
    ids = tokenizer.encode("ROMEO:\nBut soft, what light through yonder window breaks?")
    events: list = []
    req = Request([1], SamplingParams(max_tokens=len(ids), ignore_eos=True), tokenizer, on_event=events.append)
    for token in ids:
        req.add_token(token, room=100)
    assert [t for e in events if isinstance(e, Delta) for t in e.token_ids] == ids == events[-1].token_ids


def test_long_stop_strings_cost_little_per_token(tokenizer):
    """16 stop strings of 1,000 characters over 2,000 tokens: the search looks at the new text only, and
    the held-back text is found without trying every prefix of every stop string."""
    ids = tokenizer.encode("once more unto the breach " * 400)[:2000]
    stops = [("once more unto the breach " * 40)[:999] + chr(0x4e00 + i) for i in range(16)]
    start = time.perf_counter()
    deltas, done, _ = feed(tokenizer, ids, stops)
    assert done is None and len(deltas) > 100
    assert time.perf_counter() - start < 3  # the brute-force reading takes minutes

"""The C++ BPE tables (deltaserve.bpe.Vocabulary) against the `tokenizers` library's BPE model built from the same
tokens and merges (RustVocabulary: an independent implementation), and against hand-computed merges."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve import bpe
from deltaserve.ops import fused
from deltaserve.tokenizer import bytes_to_unicode, train_bpe
from tests.test_tokenizer import CORPUS, TEXTS

pytestmark = pytest.mark.skipif(not fused.available(), reason="the C++ kernels cannot be built here")

ADDED = ["<think>", "</think>", "<|im_start|>", "<|im_end|>", "<|im_"]  # "<|im_": a prefix of two others


@pytest.fixture(scope="module")
def trained():
    """(tokens, merges) of a small vocabulary learnt from the test corpus, with special and added tokens."""
    tok = train_bpe(CORPUS, vocab_size=701, special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                    added_tokens=("<think>", "</think>", "<|im_"))
    return tok.tokens, tok._vocab.merges()


@pytest.fixture(scope="module", params=["qwen2", "qwen35", "default"])
def pair(request, trained):
    tokens, merges = trained
    special, added = ADDED[2:4], [ADDED[0], ADDED[1], ADDED[4]]
    ours = bpe.Vocabulary(tokens, merges, [*special, *added], request.param)
    reference = bpe.RustVocabulary.build(tokens, merges, special, added, request.param)
    return ours, reference


def test_fixed_texts_match_tokenizers(pair):
    ours, reference = pair
    for text in [*TEXTS, "<think>a</think><|im_start|><|im_x <|im_end|>"]:
        assert ours.encode(text) == reference.encode(text), text


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(list("ab aab\n\t.,'s0123é😀中") + ADDED), max_size=40).map("".join)
       | st.text(max_size=60))
def test_any_text_matches_tokenizers(pair, text):
    ours, reference = pair
    assert ours.encode(text) == reference.encode(text)


def test_long_words_match_tokenizers(pair):
    """Words of 100k characters (each merge queues its neighbours: not quadratic in the word's length)."""
    ours, reference = pair
    for text in ["a" * 100_000, " " * 100_000 + "x", "ab" * 50_000, "中" * 30_000]:
        assert ours.encode(text) == reference.encode(text)


def test_lookups_and_merges_written_back(trained):
    tokens, merges = trained
    ours = bpe.Vocabulary(tokens, merges, ADDED, "qwen2")
    assert len(ours) == len(tokens) and [ours.token(i) for i in range(len(tokens))] == tokens
    assert all(ours.find(t) == i for i, t in enumerate(tokens))
    assert ours.find("not a token") is None
    assert ours.merges() == merges
    assert ours.duplicate is None and ours.bad_merge is None


def test_hand_computed_merges():
    """Lowest rank first, leftmost among equals; characters outside the vocabulary are dropped (no unknown token);
    qwen35 takes a word that is a token whole before any merge."""
    tokens = ["a", "b", "c", "aa", "ab", "aab", "Ġ", "Ġa"]
    merges = ["a b", "a a", "Ġ a", "a ab"]
    qwen2 = bpe.Vocabulary(tokens, merges, [], "qwen2")
    assert qwen2.encode("aaa") == [3, 0]  # "aa" "a": the leftmost pair of rank 1 first
    assert qwen2.encode("aab") == [5]  # "a b" (rank 0) before "a a", then "a ab"
    assert qwen2.encode("aaab") == [3, 4]  # "a b", then "a a" (rank 1) before "a ab" (3)
    assert qwen2.encode("axb") == [4]  # x has no token: dropped, and its neighbours merge
    assert qwen2.encode(" a") == [7]
    assert bpe.Vocabulary(tokens, ["a b"], [], "qwen2").encode("aab") == [0, 4]
    assert bpe.Vocabulary(tokens, ["a b"], [], "qwen35").encode("aab") == [5]


@pytest.mark.parametrize("form", ["ours", "tokenizers"])
def test_bad_vocabularies_name_the_entry(form):
    build = (lambda t, m: bpe.Vocabulary(t, m, [], "qwen2")) if form == "ours" else (
        lambda t, m: bpe.RustVocabulary.build(t, m, [], [], "qwen2"))
    twice = build(["a", "b", "a", "b"], [])
    assert twice.duplicate == 2
    for merges, bad in ((["a b", "a c"], 1), (["a b", "ab"], 1), (["b a"], 0), (["a b", " a"], 1)):
        assert build(["a", "b", "ab"], merges).bad_merge == bad, merges


def test_byte_alphabet_tokens_of_every_length():
    """Multi-byte characters of the alphabet (U+0100 ..) and 4-byte UTF-8 pre-token characters."""
    alphabet = list(bytes_to_unicode().values())
    tokens = alphabet + ["ĠĠ", "ðŁ", "ðŁĺ"]
    merges = ["Ġ Ġ", "ð Ł", "ðŁ ĺ"]
    ours, reference = bpe.Vocabulary(tokens, merges, [], "qwen2"), bpe.RustVocabulary.build(tokens, merges, [], [], "qwen2")
    for text in ["  x", "😀😀 😀", "\x00\x01 \xff", "中文"]:
        assert ours.encode(text) == reference.encode(text)


def test_many_added_tokens_take_tokenizers_automaton():
    """A vocabulary whose every token is an added one (a hostile file) encodes in one pass, through tokenizers."""
    tokens = [chr(0x4E00 + i) for i in range(bpe.MANY_ADDED + 1)]
    many = bpe.vocabulary(tokens, [], [], tokens, "qwen2")
    assert isinstance(many, bpe.RustVocabulary)
    assert many.encode(tokens[5] + tokens[7] * 3) == [5, 7, 7, 7]
    assert isinstance(bpe.vocabulary(tokens, [], [], tokens[:3], "qwen2"), bpe.Vocabulary)

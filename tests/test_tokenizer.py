"""Tokenizer checks against independent references: Hugging Face's tokenizer loaded from the same
tokenizer.json, llama.cpp's own tokenizer on a GGUF we write, transformers' chat-template renderer,
and hand-computed splits and renderings."""

import json

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode as hf_bytes_to_unicode

from deltaserve.errors import DeltaserveError, ModelLoadError
from deltaserve.bpe import PRE_TOKENIZER_REGEX, pre_tokenizer
from deltaserve.tokenizer import CHATML_TEMPLATE, Tokenizer, bytes_to_unicode, train_bpe

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's not what we'd expect; they're sure I'll go.",
    "def main(argv):\n    for i in range(10):\n        print(f'{i:03d}', argv[i])\n    return 0\n",
    "Prices rose 12.5% in 2024, from $1,299.99 to $1,462.38 (see table 3).",
    "今天天气很好，我们去公园散步吧。東京は晴れです。서울은 맑습니다.",
    "Emoji time 😀😀 🎉🎉 👍🏽 ❤️ and more 😀 🎉.",
    "naïve café résumé — Ünïcödé façade; São Paulo; Zürich.",
    "नमस्ते दुनिया, यह एक परीक्षण है। สวัสดีครับ ภาษาไทย مرحبا بالعالم",
    "Tabs\tand   runs   of    spaces\n\n\nand\r\nwindows newlines  \n",
] * 6

TRICKY = {
    "ascii": "Hello, world! How are you?",
    "contractions": "I'M sure it's fine, they'RE here, we'll see, you'VE done, he'd go, don't",
    "digits": "1234567890 3.14159 -42 1e10 ١٢٣ ½",
    "whitespace-runs": "a  b   c    d\t\te \u00a0f\u3000g",
    "newlines": "line1\nline2\n\n\nline3\r\n\r\nend\n  \n",
    "trailing-spaces": "   leading and trailing   ",
    "emoji": "😀 👍🏽 👨‍👩‍👧 🇫🇷 ❤️",
    "cjk": "今天天气很好，東京は晴れ。한국어",
    "combining-marks": "cafe\u0301 नमस्ते ภาษาไทย n\u0303o",
    "accents-nfc": "naïve café résumé Ünïcödé",
    "rtl": "مرحبا بالعالم שלום",
    "code": "if (x != 0) { return a->b[i] << 2; } // done",
    "special-tokens": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "special-adjacent": "x<|endoftext|>y<|im_end|><|im_start|>",
    "special-lookalike": "<|im_start <|im_end| |im_end|> <|imend|>",
    "empty": "",
    "control-chars": "a\x00b\x07c\x1bd",
}
TEXTS = list(TRICKY.values())
IDS = list(TRICKY)


@pytest.fixture(scope="module")
def tok():
    return train_bpe(CORPUS, vocab_size=701)


@pytest.fixture(scope="module")
def hf_dir(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    tok.save_hf_dir(path)
    return path


def write_gguf(tok, path, pad_to=None, pre=None, arch="qwen35"):
    writer = gguf.GGUFWriter(str(path), arch)
    tok.write_gguf(writer, pad_to=pad_to, pre=pre)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_gguf_metadata(path):
    reader = gguf.GGUFReader(str(path))
    return {field.name: field.contents() for field in reader.fields.values()}


@pytest.fixture(scope="module")
def gguf_path(tok, tmp_path_factory):
    return write_gguf(tok, tmp_path_factory.mktemp("gguf") / "tok.gguf", pad_to=1013)


# -- byte-level alphabet and word splits --------------------------------------------------------

def test_byte_alphabet_is_gpt2s():
    assert bytes_to_unicode() == hf_bytes_to_unicode()


def split(pre, text, regex=None):
    pattern = Regex(regex or PRE_TOKENIZER_REGEX[pre])
    return [w for w, _ in pre_tokenizers.Split(pattern, behavior="isolated").pre_tokenize_str(text)]


@pytest.mark.parametrize("text, qwen2, qwen35", [
    ("It's 2024!\n\n  x", ["It", "'s", " ", "2", "0", "2", "4", "!\n\n", " ", " x"], None),
    ("cafe\u0301 ok", ["cafe", "\u0301", " ok"], ["cafe\u0301", " ok"]),
    ("नमस्ते", ["नमस", "्त", "े"], ["नमस्ते"]),
    ("a \u0301b", ["a", " \u0301", "b"], ["a", " \u0301b"]),
], ids=["digits-newlines", "combining-acute", "devanagari", "mark-after-space"])
def test_splits_match_hand_computed(text, qwen2, qwen35):
    assert split("qwen2", text) == qwen2
    assert split("qwen35", text) == (qwen35 or qwen2)


# The forms in Qwen's tokenizer.json (quoted in llama.cpp's llama-vocab.cpp): (?i:...) contractions.
HF_QWEN_REGEX = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
              r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


@pytest.mark.parametrize("pre", ["qwen2", "qwen35"])
@pytest.mark.parametrize("text", TEXTS, ids=IDS)
def test_splits_match_qwen_tokenizer_json(pre, text):
    assert split(pre, text) == split(pre, text, HF_QWEN_REGEX[pre])


# -- Hugging Face reference ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf(hf_dir, tmp_path_factory):
    """HF's tokenizer on our vocabulary, splitting words with the regex as Qwen's tokenizer.json
    writes it rather than with ours (Qwen's file also has an NFC normalizer, which llama.cpp lacks)."""
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    split_step = spec["pre_tokenizer"]["pretokenizers"][0]
    assert split_step["type"] == "Split"
    split_step["pattern"] = {"Regex": HF_QWEN_REGEX["qwen2"]}
    path = tmp_path_factory.mktemp("hf-qwen") / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_file=str(path))


@pytest.mark.parametrize("route", ["hf-dir", "gguf"])
@pytest.mark.parametrize("text", TEXTS, ids=IDS)
def test_encode_decode_match_hf(route, text, hf, hf_dir, gguf_path):
    if route == "hf-dir":
        ours = Tokenizer.from_hf_dir(hf_dir)
    else:
        ours = Tokenizer.from_gguf_metadata(read_gguf_metadata(gguf_path))
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert ours.decode(ids) == text


def test_special_tokens_are_single_ids(tok):
    start, end = (tok.tokens.index(t) for t in ("<|im_start|>", "<|im_end|>"))
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == start and ids[-1] == end and ids.count(start) == 1
    assert start not in tok.encode("<|im_start")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


# -- GGUF route ---------------------------------------------------------------------------------

def test_gguf_route_equals_tokenizer_json_route(tok, hf_dir, gguf_path):
    from_json, from_gguf = Tokenizer.from_hf_dir(hf_dir), Tokenizer.from_gguf_metadata(read_gguf_metadata(gguf_path))
    for text in TEXTS:
        assert from_gguf.encode(text) == from_json.encode(text) == tok.encode(text)
    assert from_gguf.vocab_size == 1013 and from_json.vocab_size == tok.vocab_size < 1013
    assert from_gguf.tokens[: tok.vocab_size] == from_json.tokens
    ends = {tok.tokens.index("<|im_end|>"), tok.tokens.index("<|endoftext|>")}
    assert from_gguf.eos_token_ids == from_json.eos_token_ids == ends
    assert from_gguf.eos_token_id == from_json.eos_token_id == tok.tokens.index("<|im_end|>")
    assert from_gguf.chat_template == from_json.chat_template == CHATML_TEMPLATE
    padding = range(tok.vocab_size, 1013)
    assert from_gguf.decode(padding) == "" and from_gguf.tokens[-1] == "[PAD1012]"
    assert from_gguf.token_types[-1] == gguf.TokenType.UNUSED


def test_gguf_fields_roundtrip_without_file(tok):
    again = Tokenizer.from_gguf_metadata(tok.gguf_fields(pre="qwen35"))
    assert again.pre == "qwen35" and again.tokens == tok.tokens
    assert again.encode("plain ascii words") == tok.encode("plain ascii words")


# -- llama.cpp reference ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama_cpp (llama-cpp-python) is not installed")


@pytest.mark.parametrize("pre", ["qwen2", "qwen35"])
def test_llama_cpp_tokenizes_the_same(pre, tok, tmp_path, llama_cpp):
    path = write_gguf(tok, tmp_path / f"{pre}.gguf", pad_to=1013, pre=pre)
    ours = Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
    llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    assert llama.n_vocab() == 1013
    for text in TEXTS:
        ids = ours.encode(text)
        assert llama.tokenize(text.encode(), add_bos=False, special=True) == ids, text
        assert llama.detokenize(ids, special=True) == ours.decode(ids).encode()
        assert llama.detokenize(ids, special=False) == ours.decode(ids, skip_special_tokens=True).encode()
    vocab = llama_cpp.llama_model_get_vocab(llama._model.model)
    assert {i for i in range(1013) if llama_cpp.llama_vocab_is_eog(vocab, i)} == ours.eos_token_ids
    assert llama.detokenize(list(range(tok.vocab_size, 1013)), special=True) == b""


# -- streaming ----------------------------------------------------------------------------------

def stream_pieces(tok, ids, skip=False):
    stream = tok.stream(skip_special_tokens=skip)
    return [stream.feed(i) for i in ids] + [stream.flush()]


@pytest.mark.parametrize("text", ["😀 👍🏽 🇫🇷", "東京は晴れ", "ꙮ𝔘𝔫𝔦 龘", "a🦀b"],
                         ids=["emoji", "cjk", "rare", "ascii-around"])
def test_stream_never_splits_characters(tok, text):
    ids = tok.encode(text)
    partial = [i for i in ids if _not_utf8(tok.token_bytes(i))]
    assert partial, "the test needs tokens that hold part of a character"
    pieces = stream_pieces(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    # after each token, the text so far is every byte seen except an unfinished character's
    running, seen = "", b""
    for i, piece in zip(ids, pieces):
        seen += tok.token_bytes(i)
        running += piece
        assert running.encode() == seen[: len(seen) - _incomplete_tail(seen)]


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode()
        return False
    except UnicodeDecodeError:
        return True


def _incomplete_tail(data: bytes) -> int:
    """How many trailing bytes start a UTF-8 character that is not finished yet (hand-rolled)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII)
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return back if need > back else 0
    return 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 700), max_size=40), st.booleans())
def test_stream_joins_to_decode_for_any_ids(tok, ids, skip):
    ids = [i % tok.vocab_size for i in ids]
    assert "".join(stream_pieces(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


# -- chat templates -----------------------------------------------------------------------------

def test_chatml_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages) == expected
    without_prompt = expected.removesuffix("<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == without_prompt


# Exercises what Qwen's templates use: namespace, loop controls, tojson, raise_exception, strftime_now.
QWEN_STYLE = """{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- if tools %}<|im_start|>system
Tools: {{ tools | tojson }}
Date: {{ strftime_now('%Y') | length }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and not loop.first %}{{ raise_exception('system message must come first') }}{% endif %}
{%- if m.role == 'tool' %}{% continue %}{% endif %}
<|im_start|>{{ m.role }}
{{ m.content }}{% if loop.index0 == ns.last_user %} (last){% endif %}<|im_end|>
{% if loop.index0 > 2 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

MESSAGES = [{"role": "user", "content": "Q1"}, {"role": "tool", "content": "ignored"},
            {"role": "assistant", "content": "A1 <ok> & \"quoted\""}, {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "never shown"}]
TOOLS = [{"name": "search", "description": "find <things> & 'stuff'", "parameters": {"q": "字符串"}}]


def test_chat_prompt_uses_the_template_else_chatml_else_a_play_script(tok):
    """Without a template: ChatML where the vocabulary has its tokens (hand-written), else a play script."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.chat_prompt(messages) == tok.apply_chat_template(messages, add_generation_prompt=True)
    tok.chat_template = None
    try:
        chatml = tok.chat_prompt(messages)
    finally:
        tok.chat_template = CHATML_TEMPLATE
    assert chatml == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    plain = train_bpe(CORPUS, vocab_size=400, special_tokens=("<|endoftext|>",))
    assert plain.chat_template is None and plain.template is None
    assert plain.chat_prompt(messages) == "SYSTEM:\nBe brief.\n\nUSER:\nHi\n\nASSISTANT:\n"


# Qwen3.5's habit in small: the generation prompt opens a thinking block, earlier answers are rendered
# without theirs.
THINKING = """{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1].lstrip() }}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""


def test_reply_start_is_where_the_next_turn_leaves_the_prompt(tok):
    messages = [{"role": "user", "content": "What is the river like?"}]
    tok.chat_template = THINKING
    try:
        prompt = tok.encode(tok.chat_prompt(messages))
        start = tok.reply_start(messages, prompt)
        answer = {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nSlow and warm."}
        later = tok.encode(tok.chat_prompt([*messages, answer, {"role": "user", "content": "And in spring?"}]))
    finally:
        tok.chat_template = CHATML_TEMPLATE
    shared = next(i for i, (a, b) in enumerate(zip(prompt, later)) if a != b)
    assert start == shared < len(prompt)  # the later prompt leaves this one where the assistant's turn starts
    assert tok.decode(prompt[:start]).endswith("<|im_start|>assistant\n")
    chatml = tok.encode(tok.chat_prompt(messages))  # a template that keeps history as it was: no divergence
    assert tok.reply_start(messages, chatml) == len(chatml)


def test_qwen_style_template_matches_hand_written_and_transformers(tok, hf):
    tok.chat_template = QWEN_STYLE
    try:
        rendered = tok.apply_chat_template(MESSAGES, tools=TOOLS, enable_thinking=False)
    finally:
        tok.chat_template = CHATML_TEMPLATE
    expected = (
        '<|im_start|>system\nTools: [{"name": "search", "description": "find <things> & \'stuff\'", '
        '"parameters": {"q": "字符串"}}]\nDate: 4<|im_end|>\n'
        "<|im_start|>user\nQ1<|im_end|>\n"
        '<|im_start|>assistant\nA1 <ok> & "quoted"<|im_end|>\n'
        "<|im_start|>user\nQ2 (last)<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert rendered == expected
    reference = hf.apply_chat_template(MESSAGES, tools=TOOLS, chat_template=QWEN_STYLE, tokenize=False,
                                       add_generation_prompt=True, enable_thinking=False)
    assert rendered == reference


def test_template_errors_are_clear(tok):
    bad = [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]
    tok.chat_template = QWEN_STYLE
    try:
        with pytest.raises(DeltaserveError, match="system message must come first"):
            tok.apply_chat_template(bad)
        tok.chat_template = "{{ messages.__class__.__mro__ }}"
        with pytest.raises(DeltaserveError, match="chat template"):
            tok.apply_chat_template(bad)
        tok.chat_template = "{% for m in messages %}"
        with pytest.raises(DeltaserveError, match="does not parse"):
            tok.apply_chat_template(bad)
    finally:
        tok.chat_template = CHATML_TEMPLATE
    with pytest.raises(DeltaserveError, match="no chat template"):
        train_bpe(CORPUS, vocab_size=400, special_tokens=("<|endoftext|>",)).apply_chat_template(bad)


# -- Hugging Face directory details -------------------------------------------------------------

def test_hf_dir_reads_generation_config_and_template_variants(tok, tmp_path):
    tok.save_hf_dir(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    config["eos_token"] = {"content": "<|endoftext|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.chat_template == "D"
    assert loaded.eos_token_id == tok.tokens.index("<|endoftext|>")
    assert {5, 7, tok.tokens.index("<|im_end|>")} <= loaded.eos_token_ids

    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == "J"


# -- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model 'llama'"),
    ({"tokenizer.ggml.pre": "gpt-4o"}, "tokenizer.ggml.pre 'gpt-4o'"),
    ({"tokenizer.ggml.merges": []}, "merges"),
    ({"tokenizer.ggml.token_type": [1, 1, 1]}, "token_type has 3 entries"),
], ids=["model", "pre", "no-merges", "types-length"])
def test_bad_gguf_metadata(tok, change, message):
    with pytest.raises(DeltaserveError, match=message):
        Tokenizer.from_gguf_metadata(tok.gguf_fields() | change)


def test_duplicate_token_is_named(tok):
    fields = tok.gguf_fields()
    fields["tokenizer.ggml.tokens"] = fields["tokenizer.ggml.tokens"][:-1] + ["<|im_end|>"]
    with pytest.raises(DeltaserveError, match=r"'<\|im_end\|>' twice"):
        Tokenizer.from_gguf_metadata(fields)


def test_other_errors(tok, tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(DeltaserveError, match="pad_to=100 is smaller"):
        tok.gguf_fields(pad_to=100)
    with pytest.raises(DeltaserveError, match=f"token id {tok.vocab_size} is outside"):
        tok.decode([1, tok.vocab_size])
    with pytest.raises(DeltaserveError, match="vocab_size=200"):
        train_bpe(["x"], 200)


# -- untrusted vocabularies ---------------------------------------------------------------------

def with_entry(fields, key, index, value):
    items = list(fields[key])
    items[index] = value
    return {**fields, key: items}


@pytest.mark.parametrize("change, message", [
    (("tokenizer.ggml.token_type", 5, 300), r"tokenizer\.ggml\.token_type\[5\] is 300, not a token type \(0\.\.6\)"),
    (("tokenizer.ggml.token_type", 5, -1), r"tokenizer\.ggml\.token_type\[5\] is -1, not a token type"),
    (("tokenizer.ggml.token_type", 2, "3"), r"tokenizer\.ggml\.token_type\[2\] is '3' \(str\), not int"),
    (("tokenizer.ggml.token_type", 2, True), r"tokenizer\.ggml\.token_type\[2\] is True \(bool\), not int"),
    (("tokenizer.ggml.tokens", 3, 7), r"tokenizer\.ggml\.tokens\[3\] is 7 \(int\), not str"),
    (("tokenizer.ggml.merges", 0, "zz qq"), r"tokenizer\.ggml\.merges\[0\] 'zz qq' is not two tokens of the vocabulary"),
    (("tokenizer.ggml.merges", 4, "nospace"), r"tokenizer\.ggml\.merges\[4\] 'nospace' is not two tokens"),
    (("tokenizer.ggml.merges", 1, ["h", "e"]), r"tokenizer\.ggml\.merges\[1\] is \['h', 'e'\] \(list\), not str"),
], ids=["type-300", "type-negative", "type-str", "type-bool", "token-int", "merge-unknown", "merge-no-space",
        "merge-list"])
def test_malformed_vocabulary_entries_are_named(tok, change, message):
    with pytest.raises(ModelLoadError, match="^m.gguf: " + message):
        Tokenizer.from_gguf_metadata(with_entry(tok.gguf_fields(), *change), source="m.gguf")


def test_merges_that_join_into_no_token_are_refused(tok):
    fields = tok.gguf_fields()
    first = fields["tokenizer.ggml.merges"][0]  # "a b" whose join "ab" is a token: drop the join
    joined = first.replace(" ", "")
    tokens = ["[gone]" if t == joined else t for t in fields["tokenizer.ggml.tokens"]]
    with pytest.raises(ModelLoadError, match=r"merges\[0\] .* not two tokens of the vocabulary that join into a third"):
        Tokenizer.from_gguf_metadata({**fields, "tokenizer.ggml.tokens": tokens})


@pytest.mark.parametrize("key, value, message", [
    ("tokenizer.ggml.tokens", "abc", "tokenizer.ggml.tokens must be a list, got str"),
    ("tokenizer.ggml.token_type", 1, "tokenizer.ggml.token_type must be a list, got int"),
    ("tokenizer.ggml.pre", ["qwen2"], r"tokenizer.ggml.pre \['qwen2'\] is not supported"),
    ("tokenizer.chat_template", 42, "tokenizer.chat_template must be a string, got int"),
])
def test_values_of_the_wrong_type(tok, key, value, message):
    with pytest.raises(ModelLoadError, match=message):
        Tokenizer.from_gguf_metadata({**tok.gguf_fields(), key: value})


def test_missing_pre_is_llama_cpps_default_with_a_warning(tok):
    """llama.cpp reads a GGUF without tokenizer.ggml.pre with its DEFAULT splits, warning: so do we."""
    fields = tok.gguf_fields()
    del fields["tokenizer.ggml.pre"]
    with pytest.warns(UserWarning, match="m.gguf: tokenizer.ggml.pre is missing; .* 'default'"):
        ours = Tokenizer.from_gguf_metadata(fields, source="m.gguf")
    assert ours.pre == "default"
    # hand-computed: punctuation runs, GPT-2 words, digit runs, then digits in threes
    pieces = [p for p, _ in pre_tokenizer(ours.pre).pre_tokenize_str("a!!b 1234567 it's")]
    assert pieces == ["a", "!!", "b", "Ġ", "123", "456", "7", "Ġit", "'", "s"]
    explicit = Tokenizer.from_gguf_metadata(tok.gguf_fields(pre="default"))
    assert all(ours.encode(text) == explicit.encode(text) for text in TEXTS)


def test_llama_cpp_tokenizes_a_file_without_pre_the_same(tok, tmp_path, llama_cpp):
    path = tmp_path / "nopre.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35")
    fields = tok.gguf_fields(pad_to=1013)
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.warns(UserWarning, match="tokenizer.ggml.pre is missing"):
        ours = Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
    llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in TEXTS + ["x+=1 <=> y^z~|w $5.00", "1234567 12 123 ٣٤٥٦", "don't 'quote' it's"]:
        assert llama.tokenize(text.encode(), add_bos=False, special=True) == ours.encode(text), text


@pytest.mark.parametrize("file, content, message", [
    ("tokenizer_config.json", "[1, 2]", r"tokenizer_config\.json: must hold a JSON object, got list"),
    ("tokenizer_config.json", '{"chat_template": 42}', r"tokenizer_config\.json: chat_template must be a string, got int"),
    ("tokenizer_config.json", '{"chat_template": ["x"]}', "chat_template must list objects with a name"),
    ("generation_config.json", '{"eos_token_id": "2"}', "eos_token_id must be a token id or a list of them, got '2'"),
    ("generation_config.json", '{"eos_token_id": [2, 1.5]}', r"eos_token_id must be .* got \[2, 1.5\]"),
    ("tokenizer.json", '{"model": [], "decoder": 1}', "model 'None' with decoder 'None' is not byte-level BPE"),
])
def test_malformed_hf_tokenizer_files_are_named(tok, tmp_path, file, content, message):
    tok.save_hf_dir(tmp_path)
    (tmp_path / file).write_text(content)
    with pytest.raises(ModelLoadError, match=message):
        Tokenizer.from_hf_dir(tmp_path)

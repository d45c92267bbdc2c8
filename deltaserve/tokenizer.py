"""Byte-level BPE tokenizer of the Qwen family: encoding, decoding, streaming and chat templates.

Two sources give the same tokenizer: GGUF metadata (`tokenizer.ggml.*`, split the way llama.cpp
splits it) and a Hugging Face directory (`tokenizer.json`). `train_bpe` makes small ones for
random-weight test models and `Tokenizer.write_gguf` stores them so that llama.cpp loads them.
Encoding runs in deltaserve.bpe (a GGUF's or a trained vocabulary in C++ tables, a tokenizer.json in the
`tokenizers` library); decoding maps each token to its bytes the way llama.cpp does (normal tokens through
GPT-2's byte alphabet, added tokens as written, padding to nothing).
"""

from __future__ import annotations

import codecs
import functools
import json
import warnings
from array import array
from pathlib import Path
from typing import Iterable, Sequence

import jinja2
from gguf import GGUFWriter, TokenType
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer

from deltaserve import bpe
from deltaserve.errors import ChatTemplateError, DeltaserveError, ModelLoadError
from deltaserve.strings import StringArray
from deltaserve.chat_template import compile_chat_template

_TOKEN_TYPES = range(0, max(TokenType) + 1)  # llama.cpp's LLAMA_TOKEN_TYPE_UNDEFINED (0) .. BYTE (6)

# Tokens that end generation when the vocabulary has them, as llama.cpp decides (its EOG set).
END_OF_GENERATION = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>",
                     "<|end_of_text|>", "<|eom_id|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")

# Qwen's chat format, for test models: <|im_start|>role\ncontent<|im_end|>\n per message.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters (BPE works on these)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


# str.translate table from alphabet characters back to bytes; a character below 256 that is not in
# the alphabet maps past latin-1 so that the token falls back to its UTF-8 text, as HF does.
_TO_BYTE = {ord(c): b for b, c in bytes_to_unicode().items()}
_TO_BYTE.update({c: 0x100 for c in range(256) if c not in _TO_BYTE})
_SPECIAL = (TokenType.CONTROL, TokenType.UNKNOWN)  # added tokens that skip_special_tokens drops
_AS_TEXT = (*_SPECIAL, TokenType.USER_DEFINED)
_TEMPLATE_FAILURES = (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError,
                      RecursionError)


def _token_bytes(text: str, kind: int) -> bytes:
    if kind == TokenType.UNUSED:
        return b""  # llama.cpp prints nothing for padding tokens
    if kind in _AS_TEXT:
        return text.encode()
    try:
        return text.translate(_TO_BYTE).encode("latin-1")
    except UnicodeEncodeError:
        return text.encode()


class Tokenizer:
    """Byte-level BPE tokenizer. Build it with `from_gguf_metadata`, `from_hf_dir` or `train_bpe`.

    `tokens[i]` / `token_types[i]` describe id i (gguf.TokenType); CONTROL and UNKNOWN tokens are the
    special ones that `skip_special_tokens` drops, UNUSED ones are padding rows that decode to "".
    """

    def __init__(self, vocab: bpe.Vocabulary | bpe.RustVocabulary, tokens: Sequence[str], token_types: list[int], *,
                 eos_token_id: int | None, bos_token_id: int | None = None,
                 pad_token_id: int | None = None, add_bos: bool = False,
                 chat_template: str | None = None, extra_eos_ids: Iterable[int] = (),
                 pre: str | None = None):
        # the token texts stay in the vocabulary's tables until `tokens` is read (248k of them as str are 16 MB)
        self._vocab, self.token_types = vocab, array("B", token_types)
        self.eos_token_id, self.bos_token_id, self.pad_token_id = eos_token_id, bos_token_id, pad_token_id
        self.add_bos, self.chat_template, self.pre = add_bos, chat_template, pre
        self._pieces = _Pieces(_token_bytes(t, k) for t, k in zip(tokens, token_types))
        self._special = {i for i, k in enumerate(token_types) if k in _SPECIAL}
        named = (vocab.find(name) for name in END_OF_GENERATION)
        self.eos_token_ids = {i for i in (eos_token_id, *extra_eos_ids, *named) if i is not None}
        self._template: tuple[str, jinja2.Template] | None = None  # (source, compiled)

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    @functools.cached_property
    def tokens(self) -> list[str]:
        """The text of every id ("" where the vocabulary has a hole); built on first use (0.2 s for 248k)."""
        return [self._vocab.token(i) for i in range(self.vocab_size)]

    @property
    def special_token_texts(self) -> dict[str, str | None]:
        """bos/eos/pad as text, the names chat templates and tokenizer_config.json use."""
        ids = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id, "pad_token": self.pad_token_id}
        return {name: None if i is None else self._vocab.token(i) for name, i in ids.items()}

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: dict, source: str = "GGUF metadata") -> Tokenizer:
        """From GGUF key/values as Python values (`tokenizer.ggml.tokens` a list of str, ...). Every array is
        checked (types, lengths, merges of known tokens) and a bad one is a ModelLoadError naming `source`
        (the file), the key and the entry."""
        def get(key, default=None):
            return metadata.get("tokenizer.ggml." + key, default)

        model = get("model")
        if model != "gpt2":
            raise ModelLoadError(source, f"tokenizer.ggml.model {model!r} is not supported (only 'gpt2', byte-level BPE)")
        pre = get("pre")
        if pre is None:  # as llama.cpp does, with its warning
            warnings.warn(f"{source}: tokenizer.ggml.pre is missing; splitting words with llama.cpp's 'default' "
                          "pre-tokenizer (generation quality may suffer: reconvert the model)", stacklevel=2)
            pre = "default"
        if not isinstance(pre, str) or (pre != "default" and pre not in bpe.PRE_TOKENIZER_REGEX):
            known = ", ".join([*bpe.PRE_TOKENIZER_REGEX, "default"])
            raise ModelLoadError(source, f"tokenizer.ggml.pre {pre!r} is not supported (known: {known})")
        tokens, types, merges = _gguf_vocabulary(metadata, source)
        try:
            vocab = bpe.vocabulary(tokens, merges, *_added_tokens(tokens, types), pre)
        except Exception as error:  # the Rust side raises plain Exception
            raise ModelLoadError(source, f"cannot build the vocabulary: {error}") from None
        if vocab.duplicate is not None:
            raise ModelLoadError(source, f"tokenizer.ggml.tokens has '{tokens[vocab.duplicate]}' twice")
        if vocab.bad_merge is not None:
            raise ModelLoadError(source, f"tokenizer.ggml.merges[{vocab.bad_merge}] {merges[vocab.bad_merge]!r:.60} "
                                         "is not two tokens of the vocabulary that join into a third")

        def token_id(key):
            value = get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(tokens) else None

        return cls(vocab, tokens, types, eos_token_id=token_id("eos_token_id"),
                   bos_token_id=token_id("bos_token_id"), pad_token_id=token_id("padding_token_id"),
                   add_bos=get("add_bos_token") is True, chat_template=_template_text(metadata, source),
                   extra_eos_ids=[i for i in [token_id("eot_token_id")] if i is not None], pre=pre)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face checkpoint folder: tokenizer.json, tokenizer_config.json (chat
        template, eos/bos/pad), chat_template.jinja and generation_config.json (eos ids) if present."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(path, "no tokenizer.json")
        spec = _read_json(file)
        model, decoder = (part.get("type") if isinstance(part := spec.get(key), dict) else None
                          for key in ("model", "decoder"))
        if model != "BPE" or decoder != "ByteLevel":
            raise ModelLoadError(file, f"model '{model}' with decoder '{decoder}' is not byte-level BPE")
        try:
            backend = RustTokenizer.from_file(str(file))
        except Exception as error:  # the Rust side raises plain Exception
            raise ModelLoadError(file, f"tokenizers cannot load it: {error}") from error
        backend.no_padding()
        backend.no_truncation()
        config, generation = _read_json(path / "tokenizer_config.json"), _read_json(path / "generation_config.json")

        tokens = [""] * backend.get_vocab_size(with_added_tokens=True)
        types = [int(TokenType.UNUSED)] * len(tokens)
        for text, i in backend.get_vocab(with_added_tokens=True).items():
            tokens[i], types[i] = text, TokenType.NORMAL
        for i, added in backend.get_added_tokens_decoder().items():
            types[i] = TokenType.CONTROL if added.special else TokenType.USER_DEFINED

        def token_id(value):  # tokenizer_config writes a token as "text" or {"content": "text", ...}
            text = value.get("content") if isinstance(value, dict) else value
            return backend.token_to_id(text) if isinstance(text, str) else None

        return cls(bpe.RustVocabulary(backend), tokens, types, eos_token_id=token_id(config.get("eos_token")),
                   bos_token_id=token_id(config.get("bos_token")), pad_token_id=token_id(config.get("pad_token")),
                   add_bos=config.get("add_bos_token") is True, chat_template=_hf_chat_template(path, config),
                   extra_eos_ids=_hf_eos_ids(path, generation, len(tokens)))

    # -- text <-> ids --------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text ("<|im_start|>") become single
        ids, as llama.cpp does with parse_special=True; add_special_tokens prepends BOS if the
        tokenizer asks for it (Qwen does not)."""
        ids = self._vocab.encode(text)
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        """The bytes token `token_id` stands for (possibly part of a UTF-8 character)."""
        token_id = int(token_id)
        if not 0 <= token_id < len(self._pieces):
            raise DeltaserveError(f"token id {token_id} is outside the vocabulary (size {len(self._pieces)})")
        return b"" if skip_special_tokens and token_id in self._special else self._pieces[token_id]

    def healing(self, ids: list[int]) -> tuple[int, tuple[int, ...]] | None:
        """Token healing of a prompt that ends inside what the vocabulary would write as one token ("ROMEO."
        ends with "." where the text it was learnt from has ".\n"): (the last token, every token whose bytes
        start with its bytes), to back the prompt off by that token and let the first generated token be one
        of those; None when no longer token starts with it (or it is special)."""
        if not ids or ids[-1] in self._special:
            return None
        last = self.token_bytes(ids[-1])
        extending = tuple(i for i, piece in enumerate(self._pieces)
                          if piece.startswith(last) and i not in self._special)
        return (ids[-1], extending) if len(extending) > 1 else None

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; bytes that do not form valid UTF-8 become U+FFFD."""
        data = b"".join(self.token_bytes(i, skip_special_tokens) for i in ids)
        return data.decode("utf-8", errors="replace")

    def stream(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)

    # -- chat ----------------------------------------------------------------------------------

    @property
    def template(self) -> str | None:
        """The chat template prompts are rendered with: the checkpoint's, else ChatML when the vocabulary has
        its <|im_start|> and <|im_end|> (a Qwen vocabulary without a template), else None."""
        if self.chat_template is None and all(self._vocab.find(t) is not None
                                              for t in ("<|im_start|>", "<|im_end|>")):
            return CHATML_TEMPLATE
        return self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` with the chat template (`template`), as transformers does
        (sandboxed; raise_exception, tojson, loop controls, namespace, strftime_now). `kwargs`
        become template variables (tools=..., enable_thinking=...)."""
        source = self.template
        if source is None:
            raise DeltaserveError("this tokenizer has no chat template (no tokenizer.chat_template in the "
                                  "GGUF, no chat_template in tokenizer_config.json); set .chat_template")
        if self._template is None or self._template[0] != source:
            self._template = (source, _compile_template(source))
        context = {name: text for name, text in self.special_token_texts.items() if text is not None}
        try:
            return self._template[1].render({**context, **kwargs, "messages": messages,
                                             "add_generation_prompt": add_generation_prompt})
        except ChatTemplateError:
            raise
        except _TEMPLATE_FAILURES as error:  # the template is code from the checkpoint: any failure is its own
            raise ChatTemplateError(f"chat template failed: {type(error).__name__}: {error}") from error

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, continue_final: bool = False,
                    tools: list[dict] | None = None, **kwargs) -> str:
        """The prompt that asks for the next assistant turn (or, continue_final, for more of the final
        assistant message): the chat template's, with `tools` and the template variables `kwargs`
        (enable_thinking=...); for a plain-completion model (no template) the conversation as a play
        script (`plain_chat`)."""
        if self.template is None:
            return plain_chat(messages)
        if tools:
            kwargs["tools"] = tools
        if not continue_final:
            return self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        text = self.apply_chat_template(messages, add_generation_prompt=False, **kwargs)
        final = str(messages[-1].get("content") or "").strip()
        end = text.rfind(final) if final else -1
        if end < 0:  # as transformers: the template must write the message's text to continue it
            raise ChatTemplateError("continue_final_message: the chat template does not write the final "
                                    "message's content")
        return text[:end + len(final)]

    def reply_start(self, messages: list[dict], prompt_ids: list[int], **options) -> int:
        """How many tokens of `prompt_ids` (the chat prompt of `messages`, rendered with chat_prompt's
        `options`) a later turn's prompt shares: the template renders an earlier answer without the
        thinking block the generation prompt opens (Qwen3.5 drops it), so the next prompt leaves this one
        where the assistant's turn starts. Found by rendering the next turn (a reply, then a user message);
        a checkpoint there makes the next turn cost its new tokens. A template that will not render that
        gives no such point (len(prompt_ids))."""
        if self.template is None:
            return len(prompt_ids)
        options = {**options, "add_generation_prompt": False, "continue_final": False}
        later = [*messages, {"role": "assistant", "content": "."}, {"role": "user", "content": "."}]
        try:
            next_turn = self.encode(self.chat_prompt(later, **options))
        except DeltaserveError:
            return len(prompt_ids)
        n = 0
        for a, b in zip(prompt_ids, next_turn):
            if a != b:
                break
            n += 1
        return n

    # -- writing -------------------------------------------------------------------------------

    def save_hf_dir(self, path: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json into `path` (made if missing)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "tokenizer.json").write_text(self._rust().to_str(), encoding="utf-8")
        config = self.special_token_texts | {"add_bos_token": self.add_bos, "chat_template": self.chat_template,
                   "tokenizer_class": "PreTrainedTokenizerFast"}
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")

    def _rust(self) -> RustTokenizer:
        """The `tokenizers` form of this vocabulary (which writes tokenizer.json)."""
        if isinstance(self._vocab, bpe.RustVocabulary):
            return self._vocab.backend
        tokens = self.tokens
        return bpe.RustVocabulary.build(tokens, self._vocab.merges(), *_added_tokens(tokens, self.token_types),
                                        self.pre).backend

    def gguf_fields(self, pad_to: int | None = None, pre: str | None = None) -> dict:
        """The tokenizer.* GGUF key/values. `pad_to` pads the token list with UNUSED "[PAD<id>]"
        tokens (as convert_hf_to_gguf.py does) so that llama.cpp's n_vocab equals the embedding rows."""
        pre = pre or self.pre or "qwen2"
        bpe.pre_tokenizer(pre)  # names an unknown pre-tokenizer
        tokens, types = list(self.tokens), [int(k) for k in self.token_types]
        if pad_to is not None:
            if pad_to < len(tokens):
                raise DeltaserveError(f"pad_to={pad_to} is smaller than the vocabulary ({len(tokens)} tokens)")
            padding = [f"[PAD{i}]" for i in range(len(tokens), pad_to)]
            if clash := set(padding) & set(tokens):
                raise DeltaserveError(f"padding token {sorted(clash)[0]} is already in the vocabulary")
            tokens += padding
            types += [int(TokenType.UNUSED)] * len(padding)
        merges = self._vocab.merges()
        fields = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.add_bos_token": self.add_bos,
        }
        ids = {"eos_token_id": self.eos_token_id, "bos_token_id": self.bos_token_id,
               "padding_token_id": self.pad_token_id}
        fields |= {f"tokenizer.ggml.{k}": i for k, i in ids.items() if i is not None}
        if self.chat_template is not None:
            fields["tokenizer.chat_template"] = self.chat_template
        return fields

    def write_gguf(self, writer: GGUFWriter, pad_to: int | None = None, pre: str | None = None) -> None:
        """Add the tokenizer keys to `writer` with the value types llama.cpp reads."""
        fields = {k.removeprefix("tokenizer.ggml."): v for k, v in self.gguf_fields(pad_to, pre).items()}
        writer.add_tokenizer_model(fields["model"])
        writer.add_tokenizer_pre(fields["pre"])
        writer.add_token_list(fields["tokens"])
        writer.add_token_types(fields["token_type"])  # int32, as llama.cpp requires
        writer.add_token_merges(fields["merges"])
        writer.add_add_bos_token(fields["add_bos_token"])
        for key, add in (("eos_token_id", writer.add_eos_token_id), ("bos_token_id", writer.add_bos_token_id),
                         ("padding_token_id", writer.add_pad_token_id)):
            if key in fields:
                add(fields[key])
        if "tokenizer.chat_template" in fields:
            writer.add_chat_template(fields["tokenizer.chat_template"])


def plain_chat(messages: list[dict]) -> str:
    """For a plain-completion model (no chat template): the conversation as a play, speaker names first."""
    return "".join(f"{m['role'].upper()}:\n{m['content']}\n\n" for m in messages) + "ASSISTANT:\n"


class _Pieces:
    """Every token's bytes in one bytes object, and where each token ends: Qwen3.5's 248k tokens as a list of
    bytes objects held 12 MB for the tokenizer's life, this 3."""

    __slots__ = ("_data", "_ends")

    def __init__(self, pieces: Iterable[bytes]):
        data, self._ends = bytearray(), array("I")
        for piece in pieces:
            data += piece
            self._ends.append(len(data))
        self._data = bytes(data)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: int) -> bytes:  # 0 <= i < len: token_bytes checks
        return self._data[self._ends[i - 1] if i else 0:self._ends[i]]

    def __iter__(self) -> Iterable[bytes]:
        data, start = self._data, 0
        for end in self._ends:
            yield data[start:end]
            start = end


class StreamDecoder:
    """Turns token ids, fed one at a time, into text pieces that never split a UTF-8 character:
    bytes of an unfinished character wait for the tokens that complete it. The pieces followed by
    `flush()` join to exactly `tokenizer.decode(ids)`."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer, self._skip = tokenizer, skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id, self._skip))

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def train_bpe(texts: Iterable[str], vocab_size: int,
              special_tokens: Iterable[str] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
              added_tokens: Iterable[str] = ()) -> Tokenizer:
    """A small byte-level BPE tokenizer learnt from `texts` (qwen2 split, full byte alphabet, so
    any text encodes), for random-weight test models. Special tokens take the first ids, then the added
    ones (whole tokens kept in decoded text, like Qwen's <think>); eos is <|im_end|> (else <|endoftext|>),
    bos and pad <|endoftext|> (never added, as in Qwen's GGUFs), and the chat template ChatML when those
    tokens are given."""
    special_tokens, added_tokens = list(special_tokens), list(added_tokens)
    if vocab_size < len(special_tokens) + 256:
        raise DeltaserveError(f"vocab_size={vocab_size} cannot hold the 256 bytes and "
                              f"{len(special_tokens)} special tokens")
    backend = RustTokenizer(models.BPE())
    backend.pre_tokenizer, backend.decoder = bpe.pre_tokenizer("qwen2"), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in special_tokens]
        + [AddedToken(t, special=False, normalized=False) for t in added_tokens])
    backend.train_from_iterator(texts, trainer)

    tokens = [""] * backend.get_vocab_size(with_added_tokens=True)
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        tokens[i] = text
    types = [TokenType.CONTROL if t in special_tokens else TokenType.USER_DEFINED if t in added_tokens
             else TokenType.NORMAL for t in tokens]
    ids = {t: i for i, t in enumerate(tokens) if t in special_tokens}
    eos = ids.get("<|im_end|>", ids.get("<|endoftext|>"))
    chatml = "<|im_start|>" in ids and "<|im_end|>" in ids
    merges = bpe.RustVocabulary(backend).merges()
    vocab = bpe.vocabulary(tokens, merges, special_tokens, added_tokens, "qwen2")
    return Tokenizer(vocab, tokens, types, eos_token_id=eos, bos_token_id=ids.get("<|endoftext|>"),
                     pad_token_id=ids.get("<|endoftext|>"),
                     chat_template=CHATML_TEMPLATE if chatml else None, pre="qwen2")


def _added_tokens(tokens: Sequence[str], types: Sequence[int]) -> tuple[list[str], list[str]]:
    """The special tokens and the other added (user-defined) ones: text holding them encodes each to its id."""
    return ([tokens[i] for i, k in enumerate(types) if k in _SPECIAL],
            [tokens[i] for i, k in enumerate(types) if k == TokenType.USER_DEFINED])


def _gguf_vocabulary(metadata: dict, source: str) -> tuple[Sequence[str], list[int], Sequence[str]]:
    """tokenizer.ggml.tokens, .token_type and .merges, checked: lists of the right item type and length, token
    types that exist. Any other value is a ModelLoadError naming the key and the first bad entry."""
    def array(key: str, kind: type, default=None) -> Sequence:
        value = metadata.get(key, default)
        if isinstance(value, StringArray) and kind is str:
            return value  # its items are str, checked as the file was read
        if not isinstance(value, list):
            raise ModelLoadError(source, f"{key} must be a list, got {type(value).__name__}")
        bad = next((i for i, item in enumerate(value) if type(item) is not kind), None)
        if bad is not None:
            raise ModelLoadError(source, f"{key}[{bad}] is {value[bad]!r:.60} ({type(value[bad]).__name__}), "
                                         f"not {kind.__name__}")
        return value

    tokens, merges = array("tokenizer.ggml.tokens", str, []), array("tokenizer.ggml.merges", str, [])
    if not tokens or not merges:
        raise ModelLoadError(source, "GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    types = array("tokenizer.ggml.token_type", int, [int(TokenType.NORMAL)] * len(tokens))
    if len(types) != len(tokens):
        raise ModelLoadError(source, f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    bad = next((i for i, kind in enumerate(types) if kind not in _TOKEN_TYPES), None)
    if bad is not None:
        raise ModelLoadError(source, f"tokenizer.ggml.token_type[{bad}] is {types[bad]}, not a token type "
                                     f"({_TOKEN_TYPES.start}..{_TOKEN_TYPES.stop - 1})")
    return tokens, types, merges


def _template_text(metadata: dict, source: str) -> str | None:
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(source, f"tokenizer.chat_template must be a string, got {type(template).__name__}")
    return template


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(path, f"not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ModelLoadError(path, f"must hold a JSON object, got {type(value).__name__}")
    return value


def _hf_chat_template(path: Path, config: dict) -> str | None:
    """tokenizer_config.json's chat_template (a string, or named templates of which "default" is taken), else
    chat_template.jinja's text."""
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in template):
            raise ModelLoadError(path / "tokenizer_config.json", "chat_template must list objects with a name")
        template = {t["name"]: t.get("template") for t in template}.get("default")
    if template is None and (path / "chat_template.jinja").is_file():
        try:
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ModelLoadError(path / "chat_template.jinja", f"is not UTF-8 text: {error}") from None
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(path / "tokenizer_config.json", f"chat_template must be a string, got "
                                                             f"{type(template).__name__}")
    return template


def _hf_eos_ids(path: Path, generation: dict, vocab_size: int) -> list[int]:
    """generation_config.json's eos_token_id: an id, a list of ids, or absent. Ids past the vocabulary are left
    out, as from_gguf_metadata leaves them out."""
    eos = generation.get("eos_token_id")
    ids = [] if eos is None else [eos] if not isinstance(eos, list) else eos
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelLoadError(path / "generation_config.json", f"eos_token_id must be a token id or a list of "
                                                              f"them, got {eos!r:.60}")
    return [i for i in ids if 0 <= i < vocab_size]


def _compile_template(source: str) -> jinja2.Template:
    """The environment transformers renders chat templates in (sandboxed, trim_blocks, lstrip_blocks), with
    each render bounded in time, loop iterations and text (see deltaserve.chat_template)."""
    return compile_chat_template(source)

"""Byte-level BPE: a vocabulary's token strings and merges, and the way from text to ids: added tokens split out
whole, the pre-tokenizer's word splits (into GPT-2's byte alphabet), then each word's merges by rank.

Two forms give the same ids. `Vocabulary` holds the tables in C++ (ops/csrc/bpe.h: Qwen3.5's 248k tokens and 500k
merges in 22 MB, built straight from the GGUF's bytes); `RustVocabulary` wraps the `tokenizers` library's BPE
model (72 MB for the same), which reads Hugging Face's tokenizer.json, writes it back, and encodes where the C++
kernels cannot be compiled. Both split words with `tokenizers`' pre-tokenizers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from deltaserve.errors import DeltaserveError
from deltaserve.ops import fused
from deltaserve.strings import StringArray

# llama.cpp's word splits (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_QWEN2 and _QWEN35). They spell
# the contractions out where Qwen's tokenizer.json has (?i:'s|'t|...). qwen35 keeps combining marks
# (\p{M}) with the letters they modify instead of splitting them off as punctuation.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
PRE_TOKENIZER_REGEX = {
    "qwen2": _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}

# pre-tokenizers whose vocabulary maps a pre-token it holds whole to that token, before any merge
IGNORE_MERGES = {"qwen35"}

# llama.cpp's splits for a GGUF that names no pre-tokenizer (LLAMA_VOCAB_PRE_TYPE_DEFAULT): four expressions,
# each splitting the pieces the one before it left.
DEFAULT_PRE_TOKENIZER = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


def pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The word splits of pre-tokenizer `pre`, each word then written in the byte alphabet."""
    if pre != "default" and pre not in PRE_TOKENIZER_REGEX:
        known = ", ".join([*PRE_TOKENIZER_REGEX, "default"])
        raise DeltaserveError(f"tokenizer.ggml.pre '{pre}' is not supported (known: {known})")
    regexes = DEFAULT_PRE_TOKENIZER if pre == "default" else [PRE_TOKENIZER_REGEX[pre]]
    return pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


# Above this many added tokens the `tokenizers` form encodes (its automaton finds them in one pass over a text, where
# an alternation tries each at every character: 3,000 of them took 0.1 s over 45 KB of text, Qwen3.5 has 33).
MANY_ADDED = 256


def vocabulary(tokens: Sequence[str], merges: Sequence[str], special: Sequence[str], added: Sequence[str],
               pre: str) -> Vocabulary | RustVocabulary:
    """The encoder of a byte-level BPE vocabulary: `tokens` by id and `merges` ("left right") by rank, as a GGUF
    holds them; `special` and `added` tokens are taken whole from text (special ones are those decoding may skip).
    The C++ tables where the kernels are built and added tokens are few (MANY_ADDED), else the `tokenizers` model.
    Check `duplicate` and `bad_merge`."""
    if fused.available() and len(special) + len(added) <= MANY_ADDED:
        return Vocabulary(tokens, merges, [*special, *added], pre)
    return RustVocabulary.build(tokens, merges, special, added, pre)


class Vocabulary:
    """The C++ tables (ops/csrc/bpe.h) and the splits before them. `duplicate`: the first token id whose string an
    earlier token has, `bad_merge`: the first merge that is not two tokens joining into a third; None where none
    (either makes the vocabulary unusable; the caller names the entry)."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], added: Sequence[str], pre: str):
        self._pre = pre_tokenizer(pre)
        self._table = fused.extension().BpeVocabulary(*_spans(tokens), *_spans(merges), pre in IGNORE_MERGES)
        self.duplicate = _found(self._table.duplicate())
        self.bad_merge = _found(self._table.bad_merge())
        # leftmost, then longest, as `tokenizers` finds added tokens (an alternation tries them longest first)
        added = sorted({t for t in added if t}, key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, added))) if added else None

    def __len__(self) -> int:
        return len(self._table)

    def token(self, i: int) -> str:
        return self._table.token(i).decode()

    def find(self, text: str) -> int | None:
        return _found(self._table.find(text))

    def merges(self) -> list[str]:
        return [f"{self.token(a)} {self.token(b)}" for a, b in self._table.merge_pairs().tolist()]

    def encode(self, text: str) -> list[int]:
        ids, start = [], 0
        for match in self._added.finditer(text) if self._added else ():
            ids += self._words(text[start:match.start()])
            ids.append(self._table.find(match.group()))
            start = match.end()
        return ids + self._words(text[start:])

    def _words(self, text: str) -> list[int]:
        return self._table.encode([word for word, _ in self._pre.pre_tokenize_str(text)]) if text else []


class RustVocabulary:
    """The same interface over a `tokenizers` Tokenizer (a Hugging Face tokenizer.json, or one built from a GGUF's
    vocabulary where the C++ tables are not built)."""

    duplicate = bad_merge = None  # build() checks

    def __init__(self, backend: RustTokenizer | None):
        self.backend = backend  # None: duplicate or bad_merge says why

    @classmethod
    def build(cls, tokens: Sequence[str], merges: Sequence[str], special: Sequence[str], added: Sequence[str],
              pre: str) -> RustVocabulary:
        vocab, unusable = {}, cls(None)
        for i, t in enumerate(tokens):
            if vocab.setdefault(t, i) != i:
                unusable.duplicate = i
                return unusable
        pairs = []
        for i, merge in enumerate(merges):
            cut = merge.find(" ", 1)  # as llama.cpp splits "a b": at the first space after the first character
            pair = (merge[:cut], merge[cut + 1:])
            if cut < 0 or pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
                unusable.bad_merge = i
                return unusable
            pairs.append(pair)
        # qwen35's ranks do not always rise with a token's length, so BPE from the merges can split a whole-word
        # token ("俱乐部" into 3); the ids the model was trained on map a pre-token that is in the vocabulary to that
        # token (tiktoken, and HF's tokenizer.json with ignore_merges), and GGUF has no flag for it: it follows
        # from the pre-tokenizer
        backend = RustTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in IGNORE_MERGES))
        backend.pre_tokenizer, backend.decoder = pre_tokenizer(pre), decoders.ByteLevel()
        # Every id keeps its position: the added tokens already sit in the BPE vocabulary.
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
        return cls(backend)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token(self, i: int) -> str:
        return self.backend.id_to_token(i) or ""

    def find(self, text: str) -> int | None:
        return self.backend.token_to_id(text)

    def merges(self) -> list[str]:
        merges = json.loads(self.backend.to_str())["model"]["merges"]
        return [m if isinstance(m, str) else " ".join(m) for m in merges]

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids


def _found(i: int) -> int | None:
    return None if i < 0 else i


def _spans(strings: Sequence[str]) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    """UTF-8 bytes holding every string, and where each starts and ends in them."""
    if isinstance(strings, StringArray):
        data, starts, ends = strings.spans()
    else:
        encoded = [s.encode() for s in strings]
        ends = np.cumsum([len(e) for e in encoded], dtype=np.int64)
        data, starts = b"".join(encoded), ends - np.array([len(e) for e in encoded], dtype=np.int64)
    return data, torch.from_numpy(np.ascontiguousarray(starts, dtype=np.int64)), torch.from_numpy(
        np.ascontiguousarray(ends, dtype=np.int64))

"""Constrained decoding: each request with a grammar (SamplingParams.grammar, an llguidance grammar; see
engine.grammar) has its own llguidance matcher, and the logits of its rows are masked to the tokens the
grammar allows before sampling. A separate step from the sampler's: the mask goes on the logits, then
sampling runs as for any request, and the sampled token advances the matcher.

- Batches: the masks of every constrained request of a step are computed together (llguidance's executor,
  in its own threads, outside the GIL); unconstrained rows are never touched.
- Speculative decoding: the masks of a draft's rows follow the matcher through the drafted tokens; a
  drafted token the grammar rejects ends the draft there, and the matcher returns to where it was before
  the kept tokens advance it (`allowed_draft`).
- The grammar's end: when the matcher can take nothing more (the JSON value is closed, the call written)
  the request stops there, without spending a step on the end-of-sequence token (`take` says so).

The vocabulary reaches llguidance as each token's bytes, the way our decoder writes them: control tokens
(<|im_end|>, ...) are marked special (a 0xff byte first, as llguidance's llama.cpp adapter does) so that no
text matches them, and they end the output only as end-of-sequence tokens. A grammar's literal that is a
control token's whole text ("<tool_call>" where a converter typed it so) still takes that one token:
llguidance matches such literals to the special token.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import TokenType

from deltaserve.errors import DeltaserveError
from deltaserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance

_SPECIAL = (TokenType.CONTROL, TokenType.UNKNOWN)
_BITS = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool()  # byte -> its 8 bits, low first
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> {n_vocab: LLTokenizer}
_executor: llguidance.LLExecutor | None = None
COMPILED_KEPT = 64  # grammars whose compiled matcher is kept, to copy for the next request with the same one
_compiled: OrderedDict = OrderedDict()  # (LLTokenizer, grammar) -> LLMatcher, least recently used first
_lock = threading.Lock()
_build_lock = threading.Lock()  # one grammar tokenizer built at a time: a second caller waits for it


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads from a tokenizer: token bytes, eos/bos, special ids, encode."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int):
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        special = [i for i in range(tokenizer.vocab_size) if tokenizer.token_types[i] in _SPECIAL]
        for i in special:
            self.tokens[i] = b"\xff" + self.tokens[i]
        self.tokens += [b""] * (n_vocab - len(self.tokens))  # embedding rows past the tokenizer: never allowed
        self.special_token_ids = special
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


def grammar_tokenizer(tokenizer: Tokenizer, n_vocab: int) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` over a model with `n_vocab` logits, made once per tokenizer (0.7-0.9 s
    for Qwen3.5's 248k vocabulary on a busy 2-core machine: 0.2 s for the token bytes, the rest llguidance's
    own tables; the engine starts it in the background when it loads, see `prepare_in_background`). A call
    while another builds it waits for that build."""
    with _build_lock:
        made = _tokenizers.setdefault(tokenizer, {})
        if n_vocab not in made:
            if n_vocab < tokenizer.vocab_size:
                raise DeltaserveError(f"the model has {n_vocab} logits for a tokenizer of {tokenizer.vocab_size} "
                                      f"tokens")
            eos = sorted(tokenizer.eos_token_ids)
            if not eos:
                raise DeltaserveError("constrained decoding needs an end-of-sequence token; this tokenizer has none")
            llg = _llguidance()
            made[n_vocab] = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer, n_vocab)),
                                                   eos_token=eos)
        return made[n_vocab]


def grammar_tokenizer_ready(tokenizer: Tokenizer, n_vocab: int) -> bool:
    """Whether `grammar_tokenizer` has been built for this tokenizer and vocabulary (and so costs nothing)."""
    return n_vocab in _tokenizers.get(tokenizer, {})


def prepare_in_background(tokenizer: Tokenizer, n_vocab: int) -> threading.Thread:
    """Build `grammar_tokenizer` in a daemon thread, so that the first constrained request does not wait for
    all of it. A tokenizer that cannot be used is left for that request to report."""
    def build() -> None:
        try:
            grammar_tokenizer(tokenizer, n_vocab)
        except DeltaserveError:
            pass
    thread = threading.Thread(target=build, name="deltaserve-grammar-tokenizer", daemon=True)
    thread.start()
    return thread


def compiled(grammar: str, tokenizer: Tokenizer, n_vocab: int) -> llguidance.LLMatcher:
    """A fresh matcher of `grammar`, copied from one compiled before when there is one: compiling a JSON
    schema for a 248k vocabulary takes tens of ms, which the engine thread would spend on every request
    (the server compiles each request's grammar in a worker thread first, to check it)."""
    key = (grammar_tokenizer(tokenizer, n_vocab), grammar)
    with _lock:
        prototype = _compiled.get(key)
        if prototype is not None:
            _compiled.move_to_end(key)
    if prototype is None:
        prototype = _llguidance().LLMatcher(key[0], grammar, log_level=0)
        if prototype.is_error():
            raise DeltaserveError(f"the grammar does not compile: {prototype.get_error()}")
        with _lock:
            _compiled[key] = prototype
            while len(_compiled) > COMPILED_KEPT:
                _compiled.popitem(last=False)
    return prototype.deep_copy()


def grammar_error(grammar: str, tokenizer: Tokenizer, n_vocab: int) -> str | None:
    """Why `grammar` cannot constrain this model's output (None: it can)."""
    try:
        compiled(grammar, tokenizer, n_vocab)
    except (DeltaserveError, ValueError) as e:  # ValueError: not a grammar llguidance can read at all
        return str(e)
    return None


class Constraint:
    """One request's matcher."""

    def __init__(self, grammar: str, tokenizer: Tokenizer, n_vocab: int):
        self.n_vocab = n_vocab
        self.matcher = compiled(grammar, tokenizer, n_vocab)

    def take(self, token: int) -> bool:
        """Advance past the sampled `token`; whether the grammar is complete (nothing but the end may follow)."""
        if not self.matcher.consume_token(token):
            raise DeltaserveError(f"the grammar rejected token {token}: {self.matcher.get_error()}")
        return self.matcher.is_stopped()

    def allowed_draft(self, draft: list[int], logits: torch.Tensor) -> list[int]:
        """Mask logits [>= len(draft) + 1, V] row by row as the matcher follows `draft`; the drafted tokens the
        grammar allows (a prefix of `draft`). The matcher ends where it began."""
        words = torch.empty(len(draft) + 1, _words(self.n_vocab), dtype=torch.int32)
        fill_mask(self.matcher, words, 0)
        n = 0
        for d in draft:
            if not (int(words[n, d // 32]) >> (d % 32)) & 1 or not self.matcher.consume_token(d):
                break
            n += 1
            fill_mask(self.matcher, words, n)
        self.matcher.rollback(n)
        with torch.inference_mode():  # the model's logits are inference tensors
            apply_masks(logits[:n + 1], words[:n + 1])
        return draft[:n]


def fill_mask(matcher: llguidance.LLMatcher, words: torch.Tensor, row: int) -> None:
    """words[row] (int32 [.., ceil(V / 32)], contiguous) = the bitmask of the tokens `matcher` allows next, written
    by llguidance in place. (llguidance.torch's wrappers do the same, but importing that module compiles a
    torch.compile kernel's machinery: ~120 MB of every process and a second at start.)"""
    if words.dtype != torch.int32 or not words.is_contiguous() or not 0 <= row < words.shape[0]:
        raise ValueError("token masks are contiguous int32 rows")
    matcher.unsafe_compute_mask_ptr(words[row].data_ptr(), words.shape[1] * 4)


def fill_masks(matchers: list[tuple[llguidance.LLMatcher, int]], words: torch.Tensor) -> None:
    """fill_mask for several (matcher, row) at once, on llguidance's thread pool."""
    if words.dtype != torch.int32 or not words.is_contiguous() or any(not 0 <= r < words.shape[0] for _, r in matchers):
        raise ValueError("token masks are contiguous int32 rows")
    _pool().unsafe_compute_mask_ptr(matchers, words.data_ptr(), words.shape[1] * 4, words.shape[0])


class Constraints:
    """The matchers of a scheduler's requests, made when a request with a grammar first samples (or is
    added) and dropped with the request."""

    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab
        self.of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> Constraint

    def get(self, req) -> Constraint | None:
        if req.params.grammar is None:
            return None
        if req not in self.of:
            self.of[req] = Constraint(req.params.grammar, req.tokenizer, self.n_vocab)
        return self.of[req]

    def mask(self, reqs: list, logits: torch.Tensor) -> None:
        """Mask the rows of logits [N, V] (row i: reqs[i]) that belong to constrained requests, in place."""
        rows = [(i, c) for i, c in enumerate(map(self.get, reqs)) if c is not None]
        if not rows:
            return
        words = torch.empty(len(rows), _words(self.n_vocab), dtype=torch.int32)
        if len(rows) == 1:
            fill_mask(rows[0][1].matcher, words, 0)
        else:
            fill_masks([(c.matcher, k) for k, (_, c) in enumerate(rows)], words)
        with torch.inference_mode():  # the model's logits are inference tensors
            for k, (i, _) in enumerate(rows):
                apply_masks(logits[i:i + 1], words[k:k + 1])

    def take(self, req, token: int) -> bool:
        """Advance the request's matcher past `token` (before the request takes it); whether its grammar is
        now complete, so that the request ends once the token is in."""
        c = self.get(req)
        return c is not None and c.take(token)

    def allowed_draft(self, req, draft: list[int], logits: torch.Tensor) -> list[int]:
        c = self.get(req)
        return draft if c is None else c.allowed_draft(draft, logits)


def apply_masks(logits: torch.Tensor, words: torch.Tensor) -> None:
    """logits [N, V] (float) and bitmasks [N, ceil(V / 32)] int32 (bit t of word t // 32 set: token t
    allowed): the disallowed logits become -inf, in place."""
    V = logits.shape[-1]
    if logits.device.type == "cpu" and logits.is_contiguous() and logits.dtype in (torch.float32, torch.float64):
        # numpy, on one thread: torch's two-thread ops over 248k entries took 70-300 ms instead of 1 ms on a
        # machine with more runnable threads than cores
        allowed = np.unpackbits(words.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :V]
        np.putmask(logits.numpy(), allowed == 0, -np.inf)
        return
    allowed = _BITS[words.to(logits.device).view(torch.uint8).long()].view(words.shape[0], -1)[:, :V]
    logits.masked_fill_(~allowed, float("-inf"))


def _llguidance():
    """llguidance, imported by the first grammar: a process that constrains nothing (`deltaserve run`, the
    benchmark) does without its 2.4 MB of RSS."""
    import llguidance
    return llguidance


def _words(n_vocab: int) -> int:
    return (n_vocab + 31) // 32


def _pool() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        _executor = _llguidance().LLExecutor()
    return _executor

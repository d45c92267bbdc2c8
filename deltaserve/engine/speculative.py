"""Speculative decoding: cheap drafts of the next tokens, checked by the model in one pass.

A drafter proposes up to k tokens after a sequence's context: `NgramDrafter` copies what followed the
latest earlier occurrence of the context's last few tokens (prompt lookup), `ModelDrafter` runs a
smaller model with the same vocabulary greedily, `MTPDrafter` (mtp_draft.py) the model's own MTP layer. The target model then reads [last token, drafts] in
one pass that keeps its recurrent state after every token (ModelRunner.verify); `accept` keeps the
longest prefix of the drafts the target agrees with plus one token of its own, and the slot is rolled
back to just after the kept tokens, no recompute. For greedy unconstrained requests the MTP drafter does all of
that in one call where the model has one (MTPDrafter.step: on a small model the Python between the steps cost
more than the kernels).

Greedy requests give exactly the tokens of plain decoding. Sampled ones follow speculative sampling
with a deterministic draft: draft d is kept with probability p(d), else the token is drawn from p with
d removed, which draws every token from p exactly (the random stream differs from plain decoding's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from deltaserve.cache.manager import CacheManager
from deltaserve.errors import DeltaserveError

from .sampling import SamplingParams, filter_logits


class Drafter(Protocol):
    def propose(self, slots: list[int], contexts: list[list[int]], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] draft tokens to follow contexts[i], the sequence in the target's slot slots[i]."""

    def reset(self, slots: list[int]) -> None:
        """Forget what the drafter keeps for these slots (a failed step may have left it half-written)."""


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n from max_n down
    to min_n) and propose the tokens that followed it."""

    def __init__(self, max_n: int = 3, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise DeltaserveError(f"ngram drafter needs 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, slots: list[int], contexts: list[list[int]], ks: list[int]) -> list[list[int]]:
        return [self.lookup(ctx, k) for ctx, k in zip(contexts, ks)]

    def reset(self, slots: list[int]) -> None:
        pass  # it keeps nothing between calls

    def lookup(self, context: list[int], k: int) -> list[int]:
        ids = np.asarray(context)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every earlier n-gram
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start:start + k].tolist()
        return []


class ModelDrafter:
    """Greedy drafts from a smaller model with the target's vocabulary. Its slot s drafts for the target's
    slot s: it catches up with the context (continuing its live state when it can), drafts k tokens one at
    a time, then returns to the context so that the next round only feeds what was accepted."""

    def __init__(self, model, n_slots: int, max_len: int):
        self.model = model
        self.cache = CacheManager(model, n_slots, max_len, checkpoint_interval=0)

    def propose(self, slots: list[int], contexts: list[list[int]], ks: list[int]) -> list[list[int]]:
        drafts = []
        for s, ctx in zip(slots, contexts):
            _, held = self.cache.acquire(ctx, slot=s)
            drafts.append([int(self._forward([s], [ctx[held:]])[0].argmax())])
        saved = [self.cache.save(s) for s in slots]
        for step in range(1, max(ks)):
            rows = [i for i, k in enumerate(ks) if k > step]  # sequences that want more drafts
            logits = self._forward([slots[i] for i in rows], [[drafts[i][-1]] for i in rows])
            for i, token in zip(rows, logits.argmax(-1).tolist()):
                drafts[i].append(token)
        for s, copy in zip(slots, saved):
            self.cache.restore(s, copy)
        return [d[:k] for d, k in zip(drafts, ks)]

    def reset(self, slots: list[int]) -> None:
        for s in slots:
            self.cache.reset(s)

    def _forward(self, slots: list[int], tokens: list[list[int]]) -> torch.Tensor:
        out = self.model(torch.tensor(tokens, dtype=torch.long), self.cache.state, torch.tensor(slots, dtype=torch.long))
        self.cache.advance(slots, tokens)
        return out


@dataclass(eq=False)
class Speculator:
    """A drafter, the most tokens it drafts per step, and counts of what verification made of them."""

    drafter: Drafter
    k: int = 4
    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    first_accepted: int = 0  # steps whose first draft token was kept
    name: str = ""

    def __post_init__(self):
        if self.k < 1:
            raise DeltaserveError(f"spec_tokens must be >= 1, got {self.k}")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def first_acceptance_rate(self) -> float:
        """The share of steps whose first draft token was kept (the drafter's one-token accuracy)."""
        return self.first_accepted / self.steps if self.steps else 0.0


def make_speculator(spec: str, runner, k: int = 4, dtype: torch.dtype | None = None) -> Speculator:
    """"ngram" for prompt lookup, "mtp" for the model's own multi-token-prediction layer (the runner made with
    mtp=True), or the path of a draft model (a GGUF file or a Hugging Face directory) with the same vocabulary
    as the runner's model, loaded on that model's device with activations in `dtype` (default float32)."""
    if not runner.can_rollback:
        raise DeltaserveError(f"speculative decoding needs a model that keeps per-token state snapshots "
                              f"(forward(..., snapshots=K)); {type(runner.model).__name__} does not")
    if spec == "ngram":
        return Speculator(NgramDrafter(), k, name="ngram")
    if spec == "mtp":
        from .mtp_draft import MTPDrafter

        return Speculator(MTPDrafter(runner), k, name="mtp")
    from deltaserve.loader import open_checkpoint
    from deltaserve.models import load_model

    path = Path(spec)
    if not path.exists():
        raise DeltaserveError(f"speculative: '{spec}' is neither 'ngram' nor an existing draft model file")
    draft = load_model(open_checkpoint(path), dtype=dtype, device=runner.model.embed.weight.device)
    vocab, target_vocab = draft.config.vocab_size, runner.model.config.vocab_size
    if vocab != target_vocab:
        raise DeltaserveError(f"draft model {path} has a vocabulary of {vocab} tokens, the model {target_vocab}: "
                              f"they must share a tokenizer")
    return Speculator(ModelDrafter(draft, runner.n_slots, runner.max_len), k, name=path.name)


def accept(logits: torch.Tensor, draft: list[int], params: SamplingParams, generator: torch.Generator) -> list[int]:
    """The tokens verification produces: the accepted prefix of `draft`, then one token of the target's own.
    logits [>= len(draft) + 1, V] float32: row i is the target's prediction after the i-th token of
    [last token, *draft]."""
    if params.greedy:
        best = logits[:len(draft) + 1].argmax(-1).tolist()
        n = next((i for i, (d, b) in enumerate(zip(draft, best)) if d != b), len(draft))
        return draft[:n] + [best[n]]

    logits = logits.cpu()  # the request's generator lives on the CPU

    def target(i: int) -> torch.Tensor:  # the target's sampling distribution at row i
        return filter_logits(logits[i], params.temperature, params.top_k, params.top_p, params.min_p).exp()

    out = []
    for i, d in enumerate(draft):
        p = target(i)
        if float(torch.rand((), generator=generator)) < float(p[d]):
            out.append(d)
            continue
        p[d] = 0  # rejected: draw from the rest of p
        if not p.any():  # p was all on d, and float rounding rejected it: d is the only choice
            return out + [d]
        return out + [int(torch.multinomial(p, 1, generator=generator))]
    return out + [int(torch.multinomial(target(len(draft)), 1, generator=generator))]

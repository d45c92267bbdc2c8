"""Sampling parameters and the sampler: one row of logits per running sequence, each with its own settings.

Every value SamplingParams accepts is safe for the sampler's arithmetic, however extreme: a temperature
too small to divide float32 logits by acts as greedy, a tiny top_p keeps the top token, a tiny min_p
keeps every token. One request's settings therefore cannot make a batched step fail.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

# Temperatures below this are greedy (as in vLLM): logits divided by 1e-40 overflow float32 to inf, and a
# softmax of inf is NaN. At 1e-5 the distribution is already one-hot for any gap between logits above 1e-3.
GREEDY_BELOW = 1e-5
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1  # what torch.Generator.manual_seed takes


@dataclass
class SamplingParams:
    """What a request asks of the sampler. temperature 0 (or below GREEDY_BELOW) is greedy; top_k 0, top_p 1
    and min_p 0 are off."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    grammar: str | None = None  # an llguidance grammar the output must follow (engine.grammar builds them)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (_is_int(self.max_tokens) and self.max_tokens >= 0, "max_tokens must be an int >= 0"),
            (_is_number(self.temperature) and 0 <= self.temperature < math.inf,
             "temperature must be a finite number >= 0"),
            (_is_int(self.top_k) and self.top_k >= 0, "top_k must be an int >= 0"),
            (_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
             f"seed must be an int in [{SEED_MIN}, {SEED_MAX}]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (self.grammar is None or isinstance(self.grammar, str), "grammar must be a string"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}, got {self!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generator(self) -> torch.Generator:
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:  # NaN passes this and fails every range check after it
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """logits [V] float32 -> log-probabilities with the excluded tokens at -inf. At least the top token is
    always kept, so the result is a distribution for any settings SamplingParams accepts."""
    logits = logits / max(temperature, GREEDY_BELOW)
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep a token when the mass before it is below top_p; the top token stays even when top_p rounds
        # to 0 in float32 (5e-324)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    logp = logits.log_softmax(-1)
    if min_p > 0:
        logp = logp.masked_fill(logp < logp.max() + math.log(min_p), float("-inf"))
    return logp


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """logits [N, V] -> one token id per row."""
    logits = logits.float()
    greedy = logits.argmax(-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.greedy:
            out.append(greedy[i])
            continue
        probs = filter_logits(logits[i], p.temperature, p.top_k, p.top_p, p.min_p).exp()
        out.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    return out

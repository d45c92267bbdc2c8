"""Sampling parameters and the sampler: one row of logits per running sequence, each with its own settings."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """What a request asks of the sampler. temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 are off."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 0, "max_tokens must be an int >= 0"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an int >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}, got {self!r}")

    def generator(self) -> torch.Generator:
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """logits [V] float32 -> log-probabilities with the excluded tokens at -inf."""
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep a token when the mass before it is below top_p (so the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    logp = logits.log_softmax(-1)
    if min_p > 0:
        logp = logp.masked_fill(logp < logp.max() + torch.log(torch.tensor(min_p)), float("-inf"))
    return logp


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """logits [N, V] -> one token id per row."""
    logits = logits.float()
    greedy = logits.argmax(-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.temperature == 0:
            out.append(greedy[i])
            continue
        probs = filter_logits(logits[i], p.temperature, p.top_k, p.top_p, p.min_p).exp()
        out.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    return out

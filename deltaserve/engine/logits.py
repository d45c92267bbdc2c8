"""What a request's settings do to the model's logits before the sampler's filters, and the log-probabilities
it reports. Both are plain functions of (logits, params, token history), so any caller that samples (the
scheduler, a speculative verifier, a grammar mask) can apply them.

Conventions, as vLLM's (v1) sampler has them:
- logit_bias is added to the logit of each listed token; a bias of -100 bans the token outright (-inf), as
  OpenAI documents it ("-100 should result in a ban").
- min_tokens: until that many tokens were generated, the end-of-sequence tokens and stop_token_ids are banned.
- repetition_penalty p (1 = off) applies to every token seen in the prompt or the output: a positive logit
  is divided by p, a negative one multiplied by it (CTRL's rule, as vLLM and transformers apply it;
  llama.cpp applies it to the last `repeat_last_n` tokens only).
- frequency_penalty f and presence_penalty r apply to the output tokens only (OpenAI's definition):
  logit -= f * count + r * (count > 0).
- first_tokens (token healing, not an OpenAI parameter): the first generated token is one of these.
- Reported logprobs are log_softmax of the RAW logits (the model's distribution), before bias, penalties,
  temperature or any filter: vLLM's default ("raw_logprobs"). They therefore do not change with the
  sampling settings, and equal what LLM.score gives.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from .sampling import SamplingParams

BAN = -100.0


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                   output_ids: Sequence[int], end_ids: Collection[int]) -> torch.Tensor:
    """logits [V] float32 -> logits [V] with the request's bias, min_tokens ban and penalties applied (the
    input is not modified). end_ids: the tokens that end the request (eos and stop_token_ids)."""
    if not params.adjusts_logits:
        return logits
    logits = logits.clone()
    V = logits.numel()
    banned = params.min_tokens > len(output_ids) or any(b <= BAN for b in params.logit_bias.values())
    if params.logit_bias:
        ids = torch.tensor([i for i in params.logit_bias if i < V], dtype=torch.long)
        bias = torch.tensor([params.logit_bias[i] for i in ids.tolist()], dtype=logits.dtype)
        logits[ids] += bias
        logits[ids[bias <= BAN]] = float("-inf")
    if params.first_tokens is not None and not output_ids:
        banned = True
        allowed = torch.tensor([i for i in params.first_tokens if i < V], dtype=torch.long)
        kept = logits[allowed]
        logits.fill_(float("-inf"))
        logits[allowed] = kept
    if len(output_ids) < params.min_tokens and end_ids:
        logits[torch.tensor([i for i in end_ids if i < V], dtype=torch.long)] = float("-inf")
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted({*prompt_ids, *output_ids}), dtype=torch.long)
        seen = seen[seen < V]
        x = logits[seen]
        logits[seen] = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        # only the tokens generated so far change: no pass over the whole vocabulary
        ids, counts = torch.unique(torch.tensor(output_ids, dtype=torch.long), return_counts=True)
        keep = ids < V
        logits[ids[keep]] -= params.frequency_penalty * counts[keep].to(logits.dtype) + params.presence_penalty
    if banned and not torch.isfinite(logits.max()):
        causes = [name for name, applies in (
            ("logit_bias", any(b <= BAN for b in params.logit_bias.values())),
            ("min_tokens", params.min_tokens > len(output_ids)),
            ("token healing's first token", params.first_tokens is not None and not output_ids),
            ("the grammar", params.grammar is not None)) if applies]
        raise ValueError(f"{' and '.join(causes)} {'leave' if len(causes) > 1 else 'leaves'} no token of the "
                         "vocabulary to sample")
    return logits


@dataclass
class TokenLogprob:
    """The log-probability of a chosen token and the `top` most likely tokens at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """logits [V] (raw) -> the logprob of `token` there and the `top` most likely (id, logprob), best first."""
    logp = logits.float().log_softmax(-1)
    best = torch.topk(logp, min(top, logp.numel())) if top > 0 else None
    pairs = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
    return TokenLogprob(token, float(logp[token]), pairs)


def prompt_logprobs(logits: torch.Tensor, next_ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits [T, V] (raw) of T prompt positions, next_ids the T tokens that follow them -> one entry each."""
    logp = logits.float().log_softmax(-1)  # [T, V]
    ids = torch.tensor(list(next_ids), dtype=torch.long)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    if top > 0:
        best = torch.topk(logp, min(top, logp.shape[1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())]
    else:
        tops = [[] for _ in chosen]
    return [TokenLogprob(t, c, p) for t, c, p in zip(ids.tolist(), chosen, tops)]

"""LLM: load a checkpoint and generate, stream or score with it.

    llm = LLM("model.gguf")            # a GGUF file or a Hugging Face directory; None = the embedded model
    llm.generate("ROMEO:", max_tokens=40, temperature=0.8, seed=1).text
    for piece in llm.generate("ROMEO:", stream=True): print(piece, end="")
    llm.score(token_ids)               # float32 logits [T, vocab]
    llm.generate(prompt, temperature=0, speculative="ngram")   # "mtp" (the model's MTP layer), or a draft model's path
    llm.generate("ROMEO:", n=4, seed=1)   # 4 choices from one prefill: a list of GenerationResults
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from deltaserve.errors import DeltaserveError
from deltaserve.loader import open_checkpoint
from deltaserve.loader.gguf_file import progress_bar
from deltaserve.models import load_model
from deltaserve.models.mtp import has_mtp
from deltaserve.tokenizer import Tokenizer

from .logits import TokenLogprob
from .request import Delta, Done, Event, Request
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import Scheduler
from .speculative import Speculator, make_speculator

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "data" / "default.gguf"
MAX_CHOICES = 64  # generate(n=...): each choice holds a slot (its state and KV cache) for the call


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # the generated tokens (the prompt excluded)
    finish_reason: str  # "stop" (eos, a stop token or string) or "length"
    prompt_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, with logprobs=N (engine/logits.py)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.., with prompt_logprobs=N


def load(model: str | Path | None = None, *, dtype: torch.dtype = torch.float32, device="cpu",
         weight_dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None):
    """(model, tokenizer) from a GGUF file or a Hugging Face directory; None = the embedded default model."""
    path = Path(model) if model is not None else DEFAULT_MODEL
    ckpt = open_checkpoint(path)
    tokenizer = (Tokenizer.from_gguf_metadata(ckpt.metadata, str(ckpt.path)) if hasattr(ckpt, "metadata")
                 else Tokenizer.from_hf_dir(path))
    return load_model(ckpt, dtype=dtype, device=device, weight_dtype=weight_dtype, kv_dtype=kv_dtype), tokenizer


class LLM:
    """Synchronous generation on one sequence slot (n of them from the first call that asks for n choices);
    the server's Engine runs the same Scheduler in a thread."""

    def __init__(self, model: str | Path | None = None, *, dtype: torch.dtype = torch.float32, device="cpu",
                 weight_dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None, max_len: int = 4096,
                 prefill_chunk: int = 512, checkpoint_interval: int = 512, cache_budget_mb: float = 1024.0,
                 speculative: str | None = None, spec_tokens: int = 4, loaded: tuple | None = None):
        """checkpoint_interval / cache_budget_mb: prefix checkpoints every that many tokens, kept within that
        many MB (0 turns them off); the default interval is the prefill chunk, so checkpoints cut no prefill
        pass in two (at 256, a 512-token prefill ran 13% slower). speculative: "ngram", "mtp" or a draft model's
        path, for every generate call that does not say otherwise; spec_tokens: the most tokens drafted per
        step. loaded: (model, tokenizer) already loaded (a pipeline's, deltaserve.dist) instead of loading
        `model`."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model, self.tokenizer = loaded or load(model, dtype=dtype, device=device, weight_dtype=weight_dtype,
                                                    kv_dtype=kv_dtype)
        self._runner_args = dict(n_slots=1, max_len=max_len, checkpoint_interval=checkpoint_interval,
                                 cache_budget_mb=cache_budget_mb)
        self.runner = ModelRunner(self.model, **self._runner_args, mtp=speculative == "mtp")
        self.scheduler = Scheduler(self.runner, prefill_chunk)
        self.prefill_chunk = prefill_chunk
        self.spec_tokens, self.dtype = spec_tokens, dtype
        self.speculators: dict[str, Speculator] = {}  # by spec string: a draft model loads once
        self.speculative = speculative
        if speculative:
            self._speculator(speculative)

    def generate(self, prompt: str | list[int], *, max_tokens: int = 256, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None, stop: list[str] | str = (),
                 ignore_eos: bool = False, stream: bool = False, speculative: str | Literal[False] | None = None,
                 grammar: str | None = None, n: int = 1, token_healing: bool = False, **sampling):
        """Continue `prompt` (text or token ids). Returns a GenerationResult, or with stream=True an iterator
        of text pieces as they are decided (text that may still turn into a stop string is held back).
        speculative: "ngram", "mtp", a draft model's path, False (off) or None (the LLM's default). Greedy
        output is the same with or without it. grammar: an llguidance grammar the output follows
        (engine.grammar: json_grammar, tool_call_grammar). n > 1: a list of n GenerationResults, the choices
        of one prefill whose state each copies (as the server's `n`); with a seed, choice i samples with
        seed + i, so it equals generating alone with that seed. A failure on the way (the model, the sampler,
        a drafter) raises DeltaserveError naming it, from the stream too; the slots start over, so the next
        call works. **sampling: the other SamplingParams (presence_penalty, frequency_penalty,
        repetition_penalty, logit_bias, min_tokens, stop_token_ids, logprobs, prompt_logprobs), which fill
        GenerationResult's logprobs and prompt_logprobs. token_healing: a prompt that ends inside a longer
        token ("ROMEO." where the model learnt ".\n") is backed off by its last token and the first generated
        token must start with that token's text, which the returned text leaves out (it continues the prompt
        as given; token_ids hold the generated tokens); with a grammar it is off."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise DeltaserveError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
        if n > 1 and stream:
            raise DeltaserveError("stream=True streams one choice; ask for n > 1 choices without it")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                min_p=min_p, seed=seed, stop=[stop] if isinstance(stop, str) else list(stop),
                                ignore_eos=ignore_eos, grammar=grammar, **sampling)
        spec = self.speculative if speculative is None else speculative
        ids = self._encode(prompt)
        # (a grammar fixes the output's first characters itself: healing's first token would fight it)
        healed = self.tokenizer.healing(ids) if token_healing and grammar is None and len(ids) > 1 else None
        if healed is not None:
            ids = ids[:-1]
            params = replace(params, first_tokens=healed[1])
            prefix = self.tokenizer.decode([healed[0]])
        if n > self.runner.n_slots:  # a slot per choice, so that each copies the prefilled state
            self._new_runner(n_slots=n)
        events: list[list[Event]] = [[] for _ in range(n)]
        reqs = [Request(ids, p, self.tokenizer, on_event=events[i].append) for i, p in enumerate(params.choices(n))]
        reqs[0].followers = reqs[1:]
        steps = self._run(reqs, events, self._speculator(spec) if spec else None)
        if stream:
            return self._texts(steps, prefix if healed is not None else "")
        ended = {i: e for i, e in steps if isinstance(e, Done)}
        dones = [ended[i] for i in range(n)]
        for done in dones:
            if done.error:
                raise DeltaserveError(done.error)
        results = [GenerationResult(d.text[len(prefix):] if healed is not None else d.text, d.token_ids, d.reason, d.prompt_tokens, d.logprobs, d.prompt_logprobs)
                   for d in dones]
        return results if n > 1 else results[0]

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [T, vocab] for every position of token_ids, from a fresh state."""
        ids = self._encode(token_ids)
        self.runner.reset(0)
        chunks = [ids[i:i + self.prefill_chunk] for i in range(0, len(ids), self.prefill_chunk)]
        try:
            return torch.cat([self.runner.forward([0], [c], logits="all")[0] for c in chunks])
        except BaseException:
            self.runner.reset(0)  # a pass cut short leaves the slot half-written
            raise

    def _speculator(self, spec: str) -> Speculator:
        if spec == "mtp" and not has_mtp(self.model, self.runner.state):
            # the slots must carry the MTP layer's cache from their first token: they start over with one
            self._new_runner(mtp=True)
        if spec not in self.speculators:
            self.speculators[spec] = make_speculator(spec, self.runner, self.spec_tokens, self.dtype)
        return self.speculators[spec]

    def _new_runner(self, n_slots: int | None = None, mtp: bool | None = None) -> None:
        """Fresh slots (more of them, or with the MTP layer's cache): the live state and checkpoints go."""
        if n_slots is not None:
            self._runner_args["n_slots"] = n_slots
        self.runner = ModelRunner(self.model, **self._runner_args,
                                  mtp=has_mtp(self.model, self.runner.state) if mtp is None else mtp)
        self.scheduler = Scheduler(self.runner, self.prefill_chunk)
        self.speculators.clear()

    @staticmethod
    def _texts(steps, skip: str = ""):
        """The text pieces of a run's events, less the first len(skip) characters (a healed prompt's last
        token); an error ends the stream by raising it."""
        for _, event in steps:
            if isinstance(event, Delta):
                text, cut = event.text[len(skip):], min(len(skip), len(event.text))
                skip = skip[cut:]
                if text:
                    yield text
            elif event.error:
                raise DeltaserveError(event.error)

    def _run(self, reqs: list[Request], events: list[list[Event]], speculator: Speculator | None = None):
        """(choice, event) as the requests' events arrive, until every request is done."""
        self.scheduler.add(reqs[0], speculator)
        # a prompt of several chunks shows a prefill bar (on a terminal)
        first = reqs[0]
        bar = progress_bar(len(first.prompt_ids), "prefill", unit="tok") \
            if len(first.prompt_ids) > 2 * self.prefill_chunk else None
        done = 0
        try:
            while True:
                for i, queue in enumerate(events):
                    while queue:
                        event = queue.pop(0)
                        yield i, event
                        done += isinstance(event, Done)
                if done == len(reqs):
                    return
                self.scheduler.step()
                if bar is not None:
                    bar.update(first.n_fed - bar.n)
                    if not first.prefilling:
                        bar.close()
                        bar = None
        finally:  # a stream abandoned half-way (or a failed one) frees its slots
            if bar is not None:
                bar.close()
            if any(r.done is None for r in reqs):
                for req in reqs:
                    req.cancelled = True
                self.scheduler.step()

    def _encode(self, prompt) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise DeltaserveError("the prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise DeltaserveError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.runner.max_len:
            raise DeltaserveError(f"the prompt has {len(ids)} tokens; the context holds {self.runner.max_len}")
        return ids

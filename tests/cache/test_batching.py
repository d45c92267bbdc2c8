"""No state bleeds between slots: sequences decoded together in one batch give what each gives alone."""

import pytest
import torch

from deltaserve.engine.request import Request
from deltaserve.engine.runner import ModelRunner
from deltaserve.engine.sampling import SamplingParams
from deltaserve.engine.scheduler import Scheduler

from tests.conftest import ARCHES


def rand(model, n, seed):
    return torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def solo(model, prompt, steps):
    """Greedy decode `prompt` alone in a one-slot runner: (tokens, logits [steps, V] of each decode step)."""
    runner = ModelRunner(model, n_slots=1, max_len=96, checkpoint_interval=16)
    slot, _ = runner.acquire(prompt)
    token = int(runner.forward([slot], [prompt]).argmax())
    tokens, logits = [token], []
    for _ in range(steps):
        out = runner.forward([slot], [[token]])[0]
        logits.append(out)
        token = int(out.argmax())
        tokens.append(token)
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("arch", ARCHES)
def test_two_sequences_in_one_batch_decode_as_they_do_alone(arch, loaded):
    model, _ = loaded(arch)
    prompts = [rand(model, 23, seed=1), rand(model, 30, seed=2)]  # different lengths: rows at other positions
    steps = 19  # both cross a checkpoint position (32 and 48) while batched
    runner = ModelRunner(model, n_slots=3, max_len=96, checkpoint_interval=16)
    slots = [runner.acquire(p)[0] for p in prompts]
    tokens = [[int(runner.forward([s], [p]).argmax())] for s, p in zip(slots, prompts)]
    logits = []
    for _ in range(steps):
        out = runner.forward(slots, [[t[-1]] for t in tokens])  # [2, V]
        logits.append(out)
        for row, t in zip(out, tokens):
            t.append(int(row.argmax()))
    for i, p in enumerate(prompts):
        want_tokens, want_logits = solo(model, p, steps)
        assert tokens[i] == want_tokens
        # batched matmuls round differently (~1e-5); a state shared between rows would be off by far more
        torch.testing.assert_close(torch.stack([step[i] for step in logits]), want_logits, atol=5e-5, rtol=1e-4)


def test_the_scheduler_interleaves_prefill_and_decode_without_bleed(loaded):
    model, tokenizer = loaded("qwen3next")
    prompts = [rand(model, 11, seed=3), rand(model, 40, seed=4), rand(model, 26, seed=5)]
    params = SamplingParams(max_tokens=15, temperature=0, ignore_eos=True)

    def run(batch):
        scheduler = Scheduler(ModelRunner(model, n_slots=3, max_len=96, checkpoint_interval=16), prefill_chunk=7)
        reqs = [Request(p, params, tokenizer) for p in batch]
        for r in reqs:
            scheduler.add(r)
        while scheduler.has_work:  # a 7-token prefill budget: later prompts prefill while earlier ones decode
            scheduler.step()
        return [r.output_ids for r in reqs]

    together = run(prompts)
    assert together == [run([p])[0] for p in prompts]

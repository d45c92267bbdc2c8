"""Checkpoints view the KV rows of the slot that took them (a long prompt's checkpoints would otherwise copy
its whole KV cache) and copy them out when the slot writes over them. Every logit is checked against one
fresh pass of the model over the whole prompt."""

import pytest
import torch

from deltaserve.engine.runner import ModelRunner

from tests.cache.test_manager import EVERY, fresh_logits, prefill, rand


def _kv_bytes(store) -> int:
    return sum(t.numel() * t.element_size() for h in [*store.blocks, *store.marks()] for t in h.k + h.v
               if t is not None and t._base is None)


@pytest.mark.parametrize("arch", ["qwen35", "kimi-linear"])
def test_checkpoints_copy_their_rows_only_when_the_slot_moves_on(arch, loaded):
    model, _ = loaded(arch)
    runner = ModelRunner(model, n_slots=1, max_len=128, checkpoint_interval=EVERY, cache_budget_mb=64)
    runner.cache.tail_marks = ()  # the interval's three checkpoints only: their bytes are counted below
    store = runner.cache.store
    first = rand(model, 61, seed=1)
    slot, _, _ = prefill(runner, first)
    recurrent = sum(b.recurrent.nbytes() for b in store.blocks)
    assert store.checkpoints == 3 and store.nbytes == recurrent and _kv_bytes(store) == 0  # views only
    runner.release(slot)

    other = rand(model, 40, seed=2)  # another prompt takes the only slot: the rows are written over
    slot, reused, logits = prefill(runner, other)
    assert reused == 0
    torch.testing.assert_close(logits, fresh_logits(model, other), atol=1e-5, rtol=1e-5)
    per_token = sum(t[0, 0].numel() * t.element_size() for t in runner.state.k + runner.state.v if t is not None)
    assert _kv_bytes(store) == 3 * EVERY * per_token  # the first prompt's 48 rows, now copies
    assert store.nbytes == sum(b.nbytes() for b in store.blocks) + sum(m.nbytes() for m in store.marks())
    runner.release(slot)

    again = first[:50] + rand(model, 9, seed=3)  # back to the first prompt: restored from the copies
    slot, reused, logits = prefill(runner, again)
    assert reused == 48
    torch.testing.assert_close(logits, fresh_logits(model, again)[48:], atol=1e-5, rtol=1e-5)

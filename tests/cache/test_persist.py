"""Prefix checkpoints kept on disk: a new cache manager (a restarted server) restores from them exactly as
the old one did; damaged or foreign files are ignored with a warning and never reach a slot."""

import json
import logging

import pytest
import torch

from deltaserve.engine.llm import load
from deltaserve.engine.runner import ModelRunner

from tests.cache.test_manager import EVERY, fresh_logits, prefill, rand


def conversation(runner, model):
    """A first turn with a mark where the next turn diverges; returns the next turn's prompt."""
    turn = rand(model, 45, seed=7)
    slot, _ = runner.acquire(turn, marks=(41, 45))
    runner.forward([slot], [turn])
    runner.release(slot, checkpoint=True)
    return turn[:41] + rand(model, 9, seed=9)


def fresh_runner(model):
    runner = ModelRunner(model, n_slots=1, max_len=128, checkpoint_interval=EVERY, cache_budget_mb=8)
    runner.cache.tail_marks = ()  # the checkpoints counted below are the interval's and the marked ones
    return runner


def test_a_restarted_manager_restores_from_disk(loaded, tmp_path):
    model, _ = loaded("qwen35")
    before = fresh_runner(model)
    nxt = conversation(before, model)
    before.cache.save_checkpoints(tmp_path, model)
    after = fresh_runner(model)
    assert after.cache.load_checkpoints(tmp_path, model) == before.cache.store.checkpoints == 4
    assert after.cache.store.nbytes == before.cache.store.nbytes
    slot, reused, logits = prefill(after, nxt)
    assert reused == 41
    torch.testing.assert_close(logits, fresh_logits(model, nxt)[41:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("damage", ["flipped-byte", "truncated", "bad-index", "other-model"])
def test_damaged_or_foreign_checkpoints_are_ignored(damage, loaded, model_path, tmp_path, caplog):
    model, _ = loaded("qwen35")
    runner = fresh_runner(model)
    nxt = conversation(runner, model)
    runner.cache.save_checkpoints(tmp_path, model)
    data, index = tmp_path / "checkpoints.safetensors", tmp_path / "checkpoints.json"
    if damage == "flipped-byte":
        raw = bytearray(data.read_bytes())
        raw[-100] ^= 0x40
        data.write_bytes(bytes(raw))
    elif damage == "truncated":
        data.write_bytes(data.read_bytes()[:1000])
    elif damage == "bad-index":
        index.write_text(json.dumps({"format": 1, "blocks": "x"}))
    else:
        model = load(model_path("qwen35", seed=6))[0]  # same shapes, other weights
    fresh = fresh_runner(model)
    with caplog.at_level(logging.WARNING, logger="deltaserve.cache"):
        assert fresh.cache.load_checkpoints(tmp_path, model) == 0
    assert "ignoring the prefix checkpoints" in caplog.text and fresh.cache.store.nbytes == 0
    slot, reused, logits = prefill(fresh, nxt)
    assert reused == 0
    torch.testing.assert_close(logits, fresh_logits(model, nxt), atol=1e-5, rtol=1e-5)

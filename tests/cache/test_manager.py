"""CacheManager through the ModelRunner: live reuse, checkpoint restore, eviction, clean slots. Every
logit is checked against one fresh pass of the model over the whole prompt (no cache manager involved)."""

import pytest
import torch

from deltaserve.engine.runner import ModelRunner

from tests.conftest import ARCHES

EVERY = 16  # checkpoint interval: small, so short prompts cross several


def counted_runner(model, **kw):
    """A runner whose checkpoints are the interval's and the requests' marks only, without those every
    prompt keeps near its end (TAIL_MARKS, tested on their own): these tests count checkpoints."""
    runner = ModelRunner(model, checkpoint_interval=EVERY, **kw)
    runner.cache.tail_marks = ()
    return runner


def rand(model, n, seed):
    return torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fresh_logits(model, tokens):
    """float32 logits [T, V] of one pass over `tokens` from an empty state."""
    return model(torch.tensor([tokens]), model.new_state(1, len(tokens)), [0], logits="all")[0]


def same(ours, fresh):
    """A fresh pass's values (logits, states) up to float32 rounding: passes cut elsewhere (a checkpoint, a last chunk
    of a few tokens, which run one at a time as decode steps) round otherwise, measured up to 1.7e-5 of the logits'
    std on the MoE models; a wrong state moves them by about their std."""
    assert (ours - fresh).abs().max() <= 5e-5 * fresh.std()


def prefill(runner, prompt):
    """Admit `prompt` like the scheduler does; returns (slot, reused, logits [T - reused, V] of the fed tokens)."""
    slot, reused = runner.acquire(prompt)
    return slot, reused, runner.forward([slot], [prompt[reused:]], logits="all")[0]


@pytest.mark.parametrize("into", ["same-slot", "other-slot"])
@pytest.mark.parametrize("arch", ARCHES)
def test_divergent_prompt_restores_the_newest_checkpoint_before_the_divergence(arch, into, loaded):
    model, _ = loaded(arch)
    runner = counted_runner(model, n_slots=2, max_len=128, cache_budget_mb=8)
    first = rand(model, 61, seed=1)
    slot, reused, _ = prefill(runner, first)
    assert reused == 0 and runner.cache.store.checkpoints == 3  # at 16, 32 and 48
    if into == "same-slot":
        runner.release(slot)  # the slot keeps its KV rows: only the recurrent state is copied in
    second = first[:40] + rand(model, 13, seed=2)  # a second user: same first 40 tokens, then its own
    slot2, reused, logits = prefill(runner, second)
    assert (slot2 == slot) == (into == "same-slot")
    assert reused == 32 and runner.cache.restored_tokens == 32
    assert runner.history[slot2] == second
    same(logits, fresh_logits(model, second)[32:])


@pytest.mark.parametrize("arch", ARCHES)
def test_a_prompt_leaving_another_just_before_its_end_prefills_only_a_few_tokens(arch, loaded):
    """Every prompt keeps checkpoints 8, 32 and 128 tokens before its end (TAIL_MARKS): an edited last
    line restores the one 8 tokens back, not the interval checkpoint up to 15 (here) or 511 tokens back."""
    model, _ = loaded(arch)
    runner = ModelRunner(model, n_slots=1, max_len=128, checkpoint_interval=EVERY, cache_budget_mb=8)
    first = rand(model, 75, seed=11)
    prefill(runner, first)
    runner.release(0)
    second = first[:68] + rand(model, 7, seed=12)  # leaves the first prompt 7 tokens before its end
    slot, reused, logits = prefill(runner, second)
    assert reused == 75 - 8 and runner.cache.hits == 1
    same(logits, fresh_logits(model, second)[67:])


def test_a_prompt_extending_the_live_state_continues_it(loaded):
    model, _ = loaded("qwen35")
    runner = ModelRunner(model, n_slots=2, max_len=128, checkpoint_interval=EVERY, cache_budget_mb=8)
    first = rand(model, 37, seed=3)
    slot, _, _ = prefill(runner, first)
    runner.forward([slot], [[5]])  # a decoded token
    runner.release(slot)
    longer = first + [5] + rand(model, 9, seed=4)
    slot2, reused, logits = prefill(runner, longer)
    assert (slot2, reused, runner.cache.restored_tokens) == (slot, 38, 0)  # live state, not the checkpoint at 32
    same(logits, fresh_logits(model, longer)[38:])


def test_eviction_keeps_the_budget(loaded):
    model, _ = loaded("qwen3next")
    probe = counted_runner(model, n_slots=1, max_len=64)
    prefill(probe, rand(model, EVERY + 1, seed=0))
    block = next(iter(probe.cache.store.blocks)).nbytes()  # one checkpoint: KV rows of 16 tokens + states
    budget_mb = 3.5 * block / 2**20
    runner = counted_runner(model, n_slots=1, max_len=64, cache_budget_mb=budget_mb)
    prompts = [rand(model, 2 * EVERY + 3, seed=10 + i) for i in range(4)]  # two checkpoints each
    for p in prompts:
        slot, _, _ = prefill(runner, p)
        runner.release(slot)
        store = runner.cache.store
        assert store.nbytes <= store.budget and store.nbytes == sum(b.nbytes() for b in store.blocks)
        assert runner.cache.nbytes() == runner.state.nbytes() + store.nbytes
    kept = [store.checkpoint_path(p, len(p))[-1].end if store.checkpoint_path(p, len(p)) else 0 for p in prompts]
    assert kept[0] == 0 and kept[-1] == 2 * EVERY  # the oldest prompt lost its checkpoints, the newest has both
    again = prompts[0][:2 * EVERY + 1] + [7]  # its checkpoints are gone: prefilled from scratch, still right
    _, reused, logits = prefill(runner, again)
    assert reused == 0
    same(logits, fresh_logits(model, again))


def test_a_freed_slot_taken_by_another_prompt_starts_clean(loaded):
    model, _ = loaded("qwen35moe")
    runner = ModelRunner(model, n_slots=1, max_len=64, checkpoint_interval=EVERY)
    slot, _, _ = prefill(runner, rand(model, 29, seed=5))
    runner.release(slot)
    other = rand(model, 21, seed=6)
    slot2, reused = runner.acquire(other)
    assert (slot2, reused) == (slot, 0) and runner.history[slot] == []
    assert all(not t[slot].any() for t in runner.state.tensors()) and int(runner.state.lengths[slot]) == 0
    logits = runner.forward([slot], [other], logits="all")[0]
    same(logits, fresh_logits(model, other))


def test_a_restore_cut_short_leaves_the_slot_empty(loaded, monkeypatch):
    """A restore that fails half-way (here: after the recurrent state was copied in) must not leave a slot
    whose history claims tokens its state no longer holds."""
    model, _ = loaded("qwen35")
    runner = ModelRunner(model, n_slots=1, max_len=128, checkpoint_interval=EVERY, cache_budget_mb=8)
    first = rand(model, 61, seed=1)
    slot, _, _ = prefill(runner, first)
    runner.release(slot)
    real = runner.state.load_recurrent

    def fault(*args):
        real(*args)
        raise RuntimeError("injected fault")

    monkeypatch.setattr(runner.state, "load_recurrent", fault)
    with pytest.raises(RuntimeError, match="injected fault"):
        runner.acquire(first[:40] + rand(model, 13, seed=2))  # restores the checkpoint at 32 into the slot
    monkeypatch.undo()
    assert runner.history[slot] == [] and runner.free_slots() == 1
    longer = first + rand(model, 9, seed=4)  # would continue the slot's state if it still claimed `first`
    slot, reused, logits = prefill(runner, longer)
    same(logits, fresh_logits(model, longer)[reused:])


def test_decode_and_rollback_save_the_checkpoints_they_pass(loaded):
    model, _ = loaded("qwen35")
    runner = ModelRunner(model, n_slots=2, max_len=128, checkpoint_interval=EVERY)
    seq = rand(model, 40, seed=7)
    slot, _, _ = prefill(runner, seq[:14])
    for t in seq[14:17]:  # decoding one token at a time reaches 16
        runner.forward([slot], [[t]])
    runner.verify([slot], [seq[17:30]])  # a verify pass from 17 through 29 goes past 32 ...
    runner.rollback(slot, 26)  # ... but only up to 26 is kept: no checkpoint at 32
    runner.verify([slot], [seq[26:38]])
    runner.rollback(slot, 35)  # this time 32 is passed on the way to 35
    assert runner.history[slot] == seq[:35] and int(runner.state.lengths[slot]) == 35
    store = runner.cache.store
    ends = sorted(b.end for b in store.blocks if b.recurrent is not None)
    assert ends == [16, 32]
    for path in (store.checkpoint_path(seq, 16), store.checkpoint_path(seq, 32)):
        end = path[-1].end
        ref = model.new_state(1, 64)
        model(torch.tensor([seq[:end]]), ref, [0])
        for mine, theirs in zip(path[-1].recurrent.conv + path[-1].recurrent.ssm, ref.conv + ref.ssm):
            if mine is not None:
                same(mine, theirs[0])
        keys = torch.cat([b.k[3] for b in path])  # layer 3 is the attention layer of the tiny model
        torch.testing.assert_close(keys, ref.k[3][0, :end], atol=1e-4, rtol=1e-4)  # |k| ~ 1, other chunking
    logits = runner.forward([slot], [seq[35:]], logits="all")[0]
    same(logits, fresh_logits(model, seq)[35:])


@pytest.mark.parametrize("arch", ARCHES)
def test_marked_positions_and_answer_ends_are_restored_exactly(arch, loaded):
    """A conversation diverges where the assistant's turn starts (a history without the thinking goes back
    there) and continues after an answer: both are restored whole, between the interval's checkpoints."""
    model, _ = loaded(arch)
    runner = counted_runner(model, n_slots=1, max_len=128, cache_budget_mb=8)
    turn = rand(model, 45, seed=7)
    slot, reused = runner.acquire(turn, marks=(41, 45))
    runner.forward([slot], [turn])
    answer = rand(model, 6, seed=8)
    runner.forward([slot], [answer[:-1]])  # decoded tokens (the last one sampled, never fed)
    runner.release(slot, checkpoint=True)
    assert runner.cache.store.checkpoints == 3 + 2  # blocks at 16, 32 and 48; marks at 41 and 45

    stripped = turn[:41] + rand(model, 9, seed=9)  # the next prompt leaves the history at 41
    slot, reused = runner.acquire(stripped)
    assert runner.cache.store.checkpoints == 3 + 3  # the answer's end (50) kept before the slot moved on
    logits = runner.forward([slot], [stripped[reused:]], logits="all")[0]
    assert reused == 41 and runner.cache.hits == 1
    same(logits, fresh_logits(model, stripped)[41:])
    runner.release(slot)

    kept = turn + answer[:-1] + rand(model, 5, seed=10)  # ... or keeps the answer: restored from its end
    slot, reused, logits = prefill(runner, kept)
    assert reused == 50 and runner.cache.restored_tokens == 41 + 50
    same(logits, fresh_logits(model, kept)[50:])


def test_a_conversation_back_in_its_live_slot_checkpoints_no_answer_end(loaded):
    """An answer's end is copied only once the slot is about to serve something else (or the checkpoints go to
    disk): the next turn of the same conversation continues the live state and the copy never happens."""
    model, _ = loaded("qwen35")
    runner = counted_runner(model, n_slots=1, max_len=128, cache_budget_mb=8)
    turn = rand(model, 20, seed=13)
    slot, _, _ = prefill(runner, turn)
    answer = rand(model, 4, seed=14)
    runner.forward([slot], [answer])
    runner.release(slot, checkpoint=True)
    held = runner.cache.store.checkpoints  # the block at 16
    nxt = turn + answer + rand(model, 6, seed=15)
    slot, reused, logits = prefill(runner, nxt)
    assert reused == 24 and runner.cache.hits == 0 and runner.cache.store.checkpoints == held
    same(logits, fresh_logits(model, nxt)[24:])


def test_a_long_prompt_keeps_checkpoints_sparser_with_depth_and_dense_at_its_end(loaded):
    model, _ = loaded("qwen35")
    runner = ModelRunner(model, n_slots=1, max_len=700, checkpoint_interval=EVERY, cache_budget_mb=64)
    prompt = rand(model, 40 * EVERY, seed=11)
    slot, _, logits = prefill(runner, prompt)
    kept = sorted(b.end // EVERY for b in runner.cache.store.blocks if b.recurrent is not None)
    # every interval to 4, then 6, 8, 12, 16, 24, 32 (the stride doubles every two); the last 4 intervals all
    assert kept == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 37, 38, 39, 40]
    assert len(runner.cache.store.blocks) == 40  # the KV rows of every block, for restoring any of them
    torch.testing.assert_close(logits, fresh_logits(model, prompt), atol=1e-4, rtol=1e-4)
    runner.release(slot)
    other = prompt[:35 * EVERY + 3] + rand(model, 5, seed=12)  # leaves it in the sparse part: back to 32
    slot, reused, logits = prefill(runner, other)
    assert reused == 32 * EVERY
    torch.testing.assert_close(logits, fresh_logits(model, other)[reused:], atol=1e-4, rtol=1e-4)

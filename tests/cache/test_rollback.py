"""Snapshots and rollback: a forward pass keeps the recurrent state after each of its last K tokens, and a
slot goes back to any of them without recompute. Checked against recomputing that prefix from scratch."""

import copy

import pytest
import torch

from deltaserve.errors import DeltaserveError

from tests.conftest import ARCHES


def fresh(model, tokens: list[list[int]], max_len=64):
    """Logits [N, T, V] and the state after feeding each row whole to a new state (rows in slots 0..N-1)."""
    state = model.new_state(len(tokens), max_len)
    logits = model(torch.tensor(tokens), state, list(range(len(tokens))), logits="all")
    return logits, state


def assert_same_recurrent(state, slot, ref, ref_slot):
    for mine, theirs in zip(state.conv + state.ssm, ref.conv + ref.ssm):
        if mine is not None:
            torch.testing.assert_close(mine[slot], theirs[ref_slot], atol=1e-5, rtol=1e-5)
    assert int(state.lengths[slot]) == int(ref.lengths[ref_slot])


def assert_close_logits(got, want):
    """float32 logits of the same tokens computed in passes of other shapes: the kernels block their sums by the
    pass's length, so they differ by float32 rounding, which grows with the logits' size (MoE ones reach ~4)."""
    torch.testing.assert_close(got, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHES)
def test_rollback_to_each_position_equals_recompute(arch, loaded):
    model, _ = loaded(arch)
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, model.config.vocab_size, (2, 17), generator=g).tolist()
    slots, before, T, K = [2, 0], [11, 6], 5, 7  # K > T: the oldest snapshots hold the state before the pass
    state = model.new_state(3, 64)
    for s, seq, n in zip(slots, seqs, before):
        model(torch.tensor([seq[:n]]), state, [s])
    model(torch.tensor([seq[n:n + T] for seq, n in zip(seqs, before)]), state, slots, snapshots=K)
    for back in range(T + 1):
        rolled = copy.deepcopy(state)
        for s, seq, n in zip(slots, seqs, before):
            rolled.rollback(s, n + T - back)
            _, ref = fresh(model, [seq[:n + T - back]])
            assert_same_recurrent(rolled, s, ref, 0)
        nxt = [seq[n + T - back] for seq, n in zip(seqs, before)]  # the token that comes next
        got = model(torch.tensor([[t] for t in nxt]), rolled, slots)  # the KV cache was cut there too
        for row, (seq, n) in enumerate(zip(seqs, before)):
            want, _ = fresh(model, [seq[:n + T - back + 1]])
            assert_close_logits(got[row], want[0, -1])


@pytest.mark.parametrize("arch", ARCHES)
def test_save_and_restore_a_slot(arch, loaded):
    model, _ = loaded(arch)
    seq = torch.randint(0, model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(2)).tolist()
    state = model.new_state(2, 64)
    model(torch.tensor([seq[:9]]), state, [1])
    saved = state.save_recurrent(1)
    model(torch.tensor([seq[9:20]]), state, [1])  # wander off, then come back to 9 tokens
    state.load_recurrent(1, saved)
    got = model(torch.tensor([seq[9:]]), state, [1], logits="all")
    want, ref = fresh(model, [seq])
    assert_close_logits(got[0], want[0, 9:])
    assert_same_recurrent(state, 1, ref, 0)


def test_rollback_refuses_what_it_cannot_do(loaded):
    model, _ = loaded("qwen35")
    state = model.new_state(2, 32)
    with pytest.raises(DeltaserveError, match="no snapshots"):
        state.rollback(0, 0)
    model(torch.tensor([[1, 2, 3, 4, 5, 6]]), state, [0], snapshots=3)
    with pytest.raises(DeltaserveError, match="no snapshots for slot 1"):
        state.rollback(1, 0)
    with pytest.raises(DeltaserveError, match="lengths 4..6"):
        state.rollback(0, 3)  # older than the snapshots reach
    state.rollback(0, 5)
    state.rollback(0, 4)  # any kept position, in any order, until the slot moves on
    model(torch.tensor([[7, 8, 9]]), state, [0])
    with pytest.raises(DeltaserveError, match="now at 7"):
        state.rollback(0, 6)
    with pytest.raises(DeltaserveError, match="cannot cut to 8"):
        state.truncate(0, 8)


def test_kv_rows_copy_out_and_in():
    from deltaserve.models.state import HybridState

    s = HybridState.allocate([True, False, False], n_slots=2, max_len=9, conv=(2, 3), ssm=(1, 2, 2),
                             k=(2, 5), v=(2, 3))
    for t in s.tensors():
        t.copy_(torch.randn(t.shape))
    k, v = s.read_kv(0, 2, 7)
    assert k[0] is None and k[1].shape == (5, 2, 5) and v[2].shape == (5, 2, 3)
    s.write_kv(1, 3, k, v)
    for cache in s.k[1:] + s.v[1:]:
        assert torch.equal(cache[1, 3:8], cache[0, 2:7])
    s.lengths[1] = 8
    kept = [cache[1, :3].clone() for cache in s.k[1:] + s.v[1:]]
    s.truncate(1, 3)  # the KV cache of slot 1 now ends after 3 tokens
    assert s.lengths.tolist() == [0, 3]
    for cache, before in zip(s.k[1:] + s.v[1:], kept):  # zeros past the new length, the rest as it was
        assert torch.equal(cache[1, :3], before) and not cache[1, 3:8].any()

"""QwenModel against transformers (float32, eager, torch fallback kernels) on tiny random checkpoints:
prefill logits, greedy decoding after a chunked prefill, and batched decoding of uneven sequences."""

from __future__ import annotations

import pytest
import torch

from deltaserve.errors import DeltaserveError
from deltaserve.loader import open_checkpoint
from deltaserve.models import QwenModel


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def ours(tiny) -> QwenModel:
    return QwenModel.from_checkpoint(open_checkpoint(tiny.path))


def reference_logits(tiny, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tiny.model(ids, use_cache=False).logits.float()


def test_prefill_logits_match_transformers(tiny, ours):
    ids = torch.randint(0, ours.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(1))
    ref = reference_logits(tiny, ids)
    state = ours.new_state(2, 32)
    got = ours(ids, state, [0, 1], logits="all")
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert rel_err(got, ref) < 1e-4
    assert state.lengths.tolist() == [23, 23]

    last = ours(ids, ours.new_state(2, 32), torch.tensor([1, 0]), logits="last")
    assert last.shape == (2, ours.config.vocab_size)
    assert rel_err(last, ref[:, -1]) < 1e-4


def test_greedy_after_chunked_prefill_matches_transformers(tiny, ours):
    prompt = torch.randint(0, ours.config.vocab_size, (1, 17), generator=torch.Generator().manual_seed(2))
    n_new = 32

    expected = prompt  # transformers, recomputing the whole sequence at every step
    for _ in range(n_new):
        nxt = reference_logits(tiny, expected)[:, -1].argmax(-1, keepdim=True)
        expected = torch.cat([expected, nxt], dim=1)

    state = ours.new_state(1, 64)
    chunks = [ours(prompt[:, a:b], state, [0], logits="all") for a, b in ((0, 5), (5, 12), (12, 17))]
    one_shot = ours(prompt, ours.new_state(1, 64), [0], logits="all")
    assert rel_err(torch.cat(chunks, dim=1), one_shot) < 1e-5

    tokens = prompt
    logits = chunks[-1][:, -1]
    for _ in range(n_new):
        nxt = logits.argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
        logits = ours(nxt, state, [0])
    assert tokens.tolist() == expected.tolist()
    assert int(state.lengths[0]) == 17 + n_new


def test_forward_rejects_bad_input(ours):
    state = ours.new_state(2, 8)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(DeltaserveError, match="distinct"):
        ours(ids, state, [1, 1])
    with pytest.raises(DeltaserveError, match="one slot per row"):
        ours(ids, state, [0])
    with pytest.raises(DeltaserveError, match="int64"):
        ours(ids.int(), state, [0, 1])
    with pytest.raises(DeltaserveError, match="token ids"):
        ours(ids + ours.config.vocab_size, state, [0, 1])
    ours(torch.zeros(1, 6, dtype=torch.long), state, [1])
    with pytest.raises(DeltaserveError, match="max_len 8"):
        ours(ids, state, [0, 1])
    assert state.lengths.tolist() == [0, 6]  # a rejected call changes nothing

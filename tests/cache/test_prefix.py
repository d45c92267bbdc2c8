"""PrefixStore on its own: the trie of checkpoint blocks, its byte count, least-recently-used eviction."""

import pytest
import torch

from deltaserve.cache.prefix import PrefixStore
from deltaserve.models.state import RecurrentCopy
from deltaserve.errors import DeltaserveError

N = 4  # tokens per block
KV_BYTES = 2 * N * 3 * 4  # one attention layer: keys and values of N tokens, 3 floats each
STATE_BYTES = 5 * 4  # one recurrent layer: 5 floats


def kv(start, end):
    rows = torch.arange(start, end, dtype=torch.float32)[:, None].expand(end - start, 3).clone()
    return [None, rows], [None, -rows]  # layer 0 is recurrent, layer 1 attention


def state(length):
    return lambda: RecurrentCopy([torch.full((5,), float(length)), None], [None, None], length)


def put(store, tokens):
    store.put(tokens, kv, state(len(tokens)))


def checkpoint_end(store, tokens):
    path = store.checkpoint_path(tokens, len(tokens))
    return path[-1].end if path else 0


def test_blocks_rebuild_the_prefix_and_share_a_common_start():
    store = PrefixStore(N, budget_bytes=10**6)
    a = list(range(12))
    b = a[:8] + [99, 98, 97, 96]
    put(store, a[:4])
    put(store, a)  # the block at 8 was never checkpointed: it keeps KV rows only
    put(store, b)
    assert len(store.blocks) == 4 and store.checkpoints == 3
    assert store.nbytes == 4 * KV_BYTES + 3 * STATE_BYTES
    path = store.checkpoint_path(b + [5], limit=13)
    assert [blk.end for blk in path] == [4, 8, 12] and path[-1].tokens == (99, 98, 97, 96)
    assert torch.equal(torch.cat([blk.k[1] for blk in path]), kv(0, 12)[0][1])  # KV of the whole prefix
    assert path[-1].recurrent.conv[0][0] == 12
    assert checkpoint_end(store, a[:8] + [1, 2, 3, 4]) == 4  # block 8 has no state: back to 4
    assert checkpoint_end(store, a[:11]) == 4  # 12 is past the prompt
    assert checkpoint_end(store, [7] + a) == 0


def test_eviction_keeps_the_budget_and_drops_the_least_recently_used():
    per_leaf = KV_BYTES + STATE_BYTES
    store = PrefixStore(N, budget_bytes=3 * per_leaf)
    prompts = [[p] * N for p in range(4)]  # four unrelated one-block prefixes
    for p in prompts[:3]:
        put(store, p)
    store.touch(store.checkpoint_path(prompts[0], N))  # prompt 0 is used again: now the most recent
    put(store, prompts[3])
    assert [i for i, p in enumerate(prompts) if checkpoint_end(store, p)] == [0, 2, 3]
    assert store.nbytes == sum(b.nbytes() for b in store.blocks) == 3 * per_leaf


def test_an_inner_block_drops_its_state_before_its_rows():
    store = PrefixStore(N, budget_bytes=10**6)
    long = list(range(3 * N))
    put(store, long[:N])
    put(store, long[:2 * N])
    put(store, long)
    store.budget = 3 * KV_BYTES + STATE_BYTES  # room for the rows of all three and one state
    put(store, long)  # any put enforces the budget
    assert [checkpoint_end(store, long[:n]) for n in (N, 2 * N, 3 * N)] == [0, 0, 3 * N]
    assert len(store.blocks) == 3 and store.nbytes == store.budget
    store.budget = 0  # the leaf goes, then its parents: without a state or children they are useless
    put(store, long[:N])
    assert len(store.blocks) == 0 and store.nbytes == 0


def test_put_checks_the_length():
    with pytest.raises(DeltaserveError, match="every 4 tokens, not after 6"):
        put(PrefixStore(N, 100), list(range(6)))

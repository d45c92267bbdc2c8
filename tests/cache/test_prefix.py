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


def test_a_mark_between_block_boundaries_keeps_its_tail_rows_and_state():
    store = PrefixStore(N, 10_000)
    a = list(range(11))  # two blocks (8 tokens), then a tail of 3
    store.put_mark(a, kv, state(11))
    assert checkpoint_end(store, a) == 0  # the blocks hold KV rows only
    path, mark = store.best_mark(a + [99], limit=12)
    assert [b.end for b in path] == [4, 8] and (mark.end, mark.tail) == (11, (8, 9, 10))
    assert mark.k[1][:, 0].tolist() == [8, 9, 10] and mark.recurrent.length == 11
    assert store.best_mark(a[:10] + [7], limit=11) is None  # the tail differs: no mark on this path
    assert store.best_mark(a, limit=10) is None  # the mark ends past the limit
    short = [5, 6]  # shorter than a block: hangs off the root
    store.put_mark(short, kv, state(2))
    assert store.best_mark(short + [1, 2], 4)[1].end == 2
    assert store.nbytes == 2 * KV_BYTES + 5 * KV_BYTES // N + 2 * STATE_BYTES


def test_marks_are_evicted_least_recently_used_first_with_their_blocks():
    one = KV_BYTES + KV_BYTES // 2 + STATE_BYTES  # a block of 4, a tail of 2 and a state
    store = PrefixStore(N, 2 * one)
    first, second, third = ([s] * 6 for s in (1, 2, 3))
    store.put_mark(first, kv, state(6))
    store.put_mark(second, kv, state(6))
    store.touch([store.best_mark(first, 6)[1]])  # first is used again: second is now the oldest
    store.put_mark(third, kv, state(6))
    assert store.best_mark(second, 6) is None and store.best_mark(first, 6) is not None
    assert store.nbytes == 2 * one and len(store.blocks) == 2  # second's block went with its mark

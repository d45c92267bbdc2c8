"""What each rank of the pipeline tests runs, in processes of its own (torch.multiprocessing, spawn).

Rank 0 compares the pipeline with the whole model loaded in one process from the same float32 file; the
other ranks only serve it. A failed check raises on rank 0, and the test sees that exception.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from deltaserve.dist import DistributedError, join
from deltaserve.engine.llm import LLM, load
from deltaserve.engine.runner import ModelRunner
from deltaserve.models import layers, packed
from deltaserve.models.state import Snapshots
from deltaserve.ops import fused

TOL = dict(atol=1e-5, rtol=1e-5)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Pipeline stages run one process's operations in its order, tensor shards sum partial products (heads,
    columns, experts) in another, and micro-batches give the GEMMs other row counts, hence other blockings. Float32
    rounding of a sum scales with the terms summed, not with the result: a logit near 0 among logits of 4 differs
    by ~4 eps per rounding, so the bound is 1e-5 of the largest logit's size (the one process itself is 2.5e-5
    from float64 on the MoE files, whose logits reach 4.2; a micro-batched MoE pass measured 1.3e-5 from the
    unsplit one at a logit of 0.03)."""
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got, want, atol=TOL["atol"] * scale, rtol=TOL["rtol"])


def setup(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)


def check_family(rank: int, path: str, port: int, split: str) -> None:
    """split: "pp" or "tp", over 2 ranks."""
    setup(rank, 2, port)
    loaded = join(path, **{split: 2}, timeout_s=60)
    if rank != 0:
        assert loaded is None
        return
    pipe, tokenizer = loaded
    ref, _ = load(path)
    _logits(pipe, ref)
    _batched_equals_alone(pipe, ref)
    _generation(pipe, tokenizer, path)


def _logits(pipe, ref) -> None:
    """Prefill (every position's logits) then decode, two sequences of different lengths at once."""
    gen = torch.Generator().manual_seed(1)
    V = ref.config.vocab_size
    a, b = ModelRunner(pipe, n_slots=3, max_len=96, checkpoint_interval=0), \
        ModelRunner(ref, n_slots=3, max_len=96, checkpoint_interval=0)
    prompt = torch.randint(0, V, (2, 63), generator=gen).tolist()
    assert_same(a.forward([2, 0], prompt, "all"), b.forward([2, 0], prompt, "all"))
    # what a checkpoint copies, gathered from both ranks: the one process's keys, values and delta-rule states
    (ka, va), (kb, vb) = a.state.read_kv(2, 0, 63), b.state.read_kv(2, 0, 63)
    pairs = list(zip(ka + va + a.state.save_recurrent(2).ssm, kb + vb + b.state.save_recurrent(2).ssm))
    assert any(y is not None for _, y in pairs)
    for x, y in pairs:
        assert (x is None) == (y is None)
        if y is not None:
            assert_same(x, y)
    for _ in range(3):
        step = torch.randint(0, V, (2, 1), generator=gen).tolist()
        assert_same(a.forward([2, 0], step), b.forward([2, 0], step))
    # verify + rollback: keep 2 of 4 drafted tokens, then both continue alike
    draft = torch.randint(0, V, (1, 4), generator=gen).tolist()
    assert_same(a.verify([0], draft), b.verify([0], draft))
    n = len(a.history[0]) - 2
    a.rollback(0, n)
    b.rollback(0, n)
    assert_same(a.forward([0], [[7]]), b.forward([0], [[7]]))


def _batched_equals_alone(pipe, ref) -> None:
    """Two prompts through the pipeline together give the logits the whole model gives each alone."""
    V = ref.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    rows = torch.randint(0, V, (2, 17), generator=gen).tolist()
    together = ModelRunner(pipe, n_slots=2, max_len=64, checkpoint_interval=0).forward([1, 0], rows)
    for i, row in enumerate(rows):
        alone = ModelRunner(ref, n_slots=1, max_len=64, checkpoint_interval=0).forward([0], [row])
        assert_same(together[i:i + 1], alone)


def _generation(pipe, tokenizer, path: str) -> None:
    """Greedy text, prefix checkpoints restored for a second prompt, and n-gram speculation (verify and
    rollback every step) give the tokens of the whole model."""
    opts = dict(max_len=160, prefill_chunk=8, checkpoint_interval=8)
    ours, theirs = LLM(loaded=(pipe, tokenizer), **opts), LLM(path, **opts)
    first = list(range(3, 40))
    second = first[:29] + [5, 6, 7]  # leaves the first prompt past its checkpoint at 24
    for prompt in (first, second):
        got = ours.generate(prompt, max_tokens=12, temperature=0).token_ids
        assert got == theirs.generate(prompt, max_tokens=12, temperature=0).token_ids, prompt
    assert ours.runner.cache.hits >= 1, "the second prompt restored no checkpoint"
    ours.runner.release(0)
    ours.runner.reset(0)  # from an empty slot: the speculation's acceptances come from the prompt alone
    theirs.runner.reset(0)
    loop = [11, 12, 13, 14, 15] * 6
    got = ours.generate(loop, max_tokens=16, temperature=0, speculative="ngram").token_ids
    assert got == theirs.generate(loop, max_tokens=16, temperature=0).token_ids


def check_quantised(rank: int, path: str, port: int, int8: bool) -> None:
    """A quantised file in 2 tensor shards (its blocks sliced) against one process on the same file: prefill
    and decode logits, and greedy tokens. int8=False: every rank multiplies float32 activations by the exact
    weights, the same kernels on the same blocks; the shards differ from one process only by float32 sums
    in another order, bound as float files' but 10x wider: these files' single float32 process is itself
    3-5e-4 from float64 (their prefill sums dequantised blocks in GEMMs), the shards measured 5e-5 from it.
    int8=True (the default, llama.cpp's rounding of activations: Q8_K for K-quants, Q8_0 for Q8_0, bfloat16 for BF16
    where the CPU has AVX512_BF16): one ulp of difference in an activation can move its rounding by a step, and a step moves logits by up to 0.3 (measured: one ulp
    of noise on one norm weight of one process); bound by half of what rounding every activation does
    (int8 against float activations in one process), and no greedy comparison. The prefill runs on the registers'
    path, not on AMX tiles where the CPU has them: on the tiles the same sums in another order already move the BF16
    MoE file's logits as far as rounding does (tiles against registers in one process: 1.04 against 1.03, a router
    choice flipping; the shards on tiles were 0.60 from one process, on the registers 0.026). The tiles' products
    are tested against float64 in tests/ops."""
    setup(rank, 2, port)
    # K-quant, Q8_0 and BF16 files' activation rounding
    packed.INT8_ACTIVATIONS = layers.Q8_INT8_ACTIVATIONS = layers.BF16_ROUNDED_ACTIVATIONS = int8
    if int8 and fused.available():
        fused.extension().set_amx(False)
    loaded = join(path, tp=2, timeout_s=60)
    if rank != 0:
        return
    shards, tokenizer = loaded
    ref, _ = load(path)
    prompt = torch.randint(0, ref.config.vocab_size, (2, 63), generator=torch.Generator().manual_seed(1)).tolist()
    steps = [prompt] + [[[5 + t], [9 + t]] for t in range(3)]

    def run(model) -> list[torch.Tensor]:
        runner = ModelRunner(model, n_slots=3, max_len=96, checkpoint_interval=0)
        return [runner.forward([2, 0], step, "all" if i == 0 else "last") for i, step in enumerate(steps)]
    got, want = run(shards), run(ref)
    if int8:
        packed.INT8_ACTIVATIONS = layers.Q8_INT8_ACTIVATIONS = layers.BF16_ROUNDED_ACTIVATIONS = False
        rounding = max(float((a - b).abs().max()) for a, b in zip(want, run(ref)))
        worst = max(float((a - b).abs().max()) for a, b in zip(got, want))
        assert worst <= rounding / 2, (worst, rounding)
        return
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4 * max(1.0, float(b.abs().max())), rtol=1e-4)
    ours, theirs = LLM(loaded=(shards, tokenizer), max_len=96), LLM(path, max_len=96)
    text = "The river starts as a thin line of water high in the hills."
    assert ours.generate(text, max_tokens=12, temperature=0, ignore_eos=True).token_ids == \
        theirs.generate(text, max_tokens=12, temperature=0, ignore_eos=True).token_ids


def check_dead_rank(rank: int, path: str, port: int, how: str, timeout_s: float, out) -> None:
    """Rank 0 stops or kills rank 1, then runs a pass over 3 slots in 2 micro-batches (rank 0 sends the first
    and runs the second before it waits): a DistributedError must come within the timeout."""
    setup(rank, 2, port)
    from deltaserve.dist import group

    group.join(2, timeout_s)
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    loaded = join(path, pp=2, timeout_s=timeout_s)
    if rank != 0:
        return
    pipe, _ = loaded
    pipe.micro_batches = 2  # 3 slots go in micro-batches of 2 and 1
    runner = ModelRunner(pipe, n_slots=3, max_len=32, checkpoint_interval=0)
    runner.forward([0, 1, 2], [[1, 2, 3]] * 3)
    os.kill(pids[1], signal.SIGSTOP if how == "hang" else signal.SIGKILL)
    began = time.monotonic()
    try:
        runner.forward([0, 1, 2], [[4]] * 3)
        out.put(("no error", 0.0))
    except DistributedError as e:
        out.put((str(e), time.monotonic() - began))
    try:
        runner.forward([0, 1, 2], [[5]] * 3)
        out.put(("no error", 0.0))
    except DistributedError as e:  # at once: the link is broken for good
        out.put((str(e), time.monotonic() - began))
    if how == "hang":
        os.kill(pids[1], signal.SIGKILL)
    out.close()
    out.join_thread()  # what was put reaches the test before the exit below
    os._exit(0)  # the group cannot be left cleanly with a dead peer


def check_micro_batches(rank: int, path: str, port: int, draft: str) -> None:
    """Passes over 5 slots in 2 and 3 micro-batches: prefill (every position's logits), decode, verify +
    rollback, and each slot's state after, against the whole model in one process running the same
    micro-batches one after another (bitwise: the same operations on the same rows), and against the pass
    unsplit in one process (within 1e-5 of the logits' size: CPU GEMMs choose their blocking by the rows they
    get, so a row's sums round differently in a batch of 2 than in one of 5). Then several requests at once with n-gram
    speculation (verify passes over several slots, split, then rollback) through the engine, drafted by
    n-gram lookup and by `draft` (the model quantised: most drafts kept, some not)."""
    setup(rank, 2, port)
    loaded = join(path, pp=2, timeout_s=60, micro_batches=1)
    if rank != 0:
        return
    pipe, tokenizer = loaded
    ref, _ = load(path)
    whole = _micro_steps(ref)
    pipe.micro_batches = 1
    for got, want in zip(_micro_steps(pipe), whole):
        assert (got is None) == (want is None)
        assert got is None or torch.equal(got, want)
    for m in (2, 3):
        pipe.micro_batches = m
        got = _micro_steps(pipe)
        for a, b, c in zip(got, _micro_steps(InTurns(ref, m)), whole):
            assert (a is None) == (b is None)
            if b is not None:
                assert torch.equal(a, b)
                assert_same(a, c)
    pipe.micro_batches = 2
    _engine_speculating(pipe, tokenizer, path, "ngram")
    assert _engine_speculating(pipe, tokenizer, path, draft).steps > 0


class InTurns:
    """The whole model in one process running each pass's rows as m micro-batches one after another (sizes
    as even as they go, the first ones larger), the per-token states of a pass that keeps them put together
    row by row for rollback."""

    def __init__(self, model, m: int):
        self.model, self.m = model, m

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, input_ids, state, slots, logits="last", snapshots=0):
        n = len(slots)
        m = min(n, self.m)
        sizes = [n // m + (i < n % m) for i in range(m)]
        outs, kept = [], []
        for ids, rows in zip(input_ids.split(sizes), slots.split(sizes)):
            outs.append(self.model(ids, state, rows, logits=logits, snapshots=snapshots))
            kept.append(state.snapshots)
        if snapshots:
            def cat(layers):
                return [None if t[0] is None else torch.cat(t) for t in zip(*layers)]
            state.snapshots = Snapshots([s for k in kept for s in k.slots], [x for k in kept for x in k.lengths],
                                        kept[0].tokens, kept[0].depth, cat([k.conv for k in kept]),
                                        cat([k.ssm for k in kept]))
        return torch.cat(outs)

    forward = __call__


def _micro_steps(model) -> list:
    """Logits of each pass and every slot's state (KV rows, conv and delta-rule states) at the end."""
    gen = torch.Generator().manual_seed(4)
    V = model.config.vocab_size
    runner = ModelRunner(model, n_slots=6, max_len=64, checkpoint_interval=0)
    slots = [4, 0, 2, 5, 1]
    out = [runner.forward(slots, torch.randint(0, V, (5, 13), generator=gen).tolist(), "all")]
    for _ in range(3):
        out.append(runner.forward(slots, torch.randint(0, V, (5, 1), generator=gen).tolist()))
    verified = [0, 2, 5]
    out.append(runner.verify(verified, torch.randint(0, V, (3, 4), generator=gen).tolist()))
    for slot, keep in zip(verified, (1, 3, 4)):  # of the 4 verified tokens
        runner.rollback(slot, len(runner.history[slot]) - 4 + keep)
    out.append(runner.forward(slots, torch.randint(0, V, (5, 1), generator=gen).tolist()))
    for slot in sorted(slots):
        k, v = runner.state.read_kv(slot, 0, int(runner.state.lengths[slot]))
        saved = runner.state.save_recurrent(slot)
        out += k + v + saved.conv + saved.ssm
    return out


def _engine_speculating(pipe, tokenizer, path: str, speculative: str):
    """Three requests decoding together, speculating, give the tokens each gives alone in one process; the
    engine's speculator (its counts)."""
    from deltaserve.engine.engine import Engine
    from deltaserve.engine.sampling import SamplingParams
    from tests.engine.runs import run_to_end

    prompts = [[11, 12, 13, 14, 15] * 5, [7, 8, 9] * 7, list(range(3, 26))]
    solo = LLM(path, max_len=128)
    want = [solo.generate(p, max_tokens=16, temperature=0, ignore_eos=True).token_ids for p in prompts]
    engine = Engine(pipe, tokenizer, n_slots=3, max_len=128, prefill_chunk=8, checkpoint_interval=16,
                    speculative=speculative, spec_tokens=3)
    done = run_to_end(engine, prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert [d.token_ids for d in done] == want, speculative
    return engine.speculator

"""Pipeline and tensor parallel over 2 processes (gloo over loopback) against the whole model in one process.

Each family's tiny float32 file (head counts that 2 divides) in 2 stages and in 2 tensor shards: logits of
prefill, decode and verify within 1e-5 (of the logits' scale for shards, see ranks.assert_same), the state a
checkpoint gathers, rollback, batched == alone, greedy generation with prefix checkpoints restored and
n-gram speculation (tests/dist/ranks.py).
Then a rank that dies or hangs: rank 0 gets a DistributedError within the timeout, and at once after it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from deltaserve.convert import make_model
from deltaserve.dist.stage import split_layers
from deltaserve.dist.tensor import TensorPart
from deltaserve.errors import DeltaserveError
from deltaserve.loader import open_checkpoint
from deltaserve.models import load_model

from . import ranks

from tests.conftest import ARCHES
from tests.processes import free_port


# tiny's shapes with head counts 2 divides (tiny has 3 key heads), still odd: hidden 96, K 32 != V 48,
# HV = 2H; Kimi with 5 experts, so its ranks hold 2 and 3
EVEN_HEADS = {"qwen35": dict(linear_k_heads=2, linear_v_heads=4, linear_v_dim=48),
              "kimi-linear": dict(kda_heads=2, num_heads=2, num_experts=5)}


@pytest.fixture(scope="module")
def two_way(tmp_path_factory):
    """arch -> a tiny float32 file both splits cut in 2 (made once)."""
    root, made = tmp_path_factory.mktemp("two-way"), {}

    def get(arch: str):
        if arch not in made:
            changes = EVEN_HEADS["kimi-linear" if arch == "kimi-linear" else "qwen35"]
            made[arch] = make_model(arch, "tiny", "f32", root / f"{arch}.gguf", seed=3, changes=changes).gguf_path
        return made[arch]
    return get


@pytest.mark.parametrize("split", ["pp", "tp"])
@pytest.mark.parametrize("arch", ARCHES)
def test_two_ranks_match_one_process(arch, split, two_way):
    mp.spawn(ranks.check_family, args=(str(two_way(arch)), free_port(), split), nprocs=2)


def test_tensor_parallel_refuses_what_it_cannot_split(model_path, two_way):
    with pytest.raises(DeltaserveError, match="--tp 2 must divide qwen35's head counts .*linear_k_heads 3"):
        load_model(open_checkpoint(model_path("qwen35")), part=TensorPart(0, 2))  # tiny: 3 key heads
    with pytest.raises(DeltaserveError, match="--tp 2 must divide kimi-linear's .*kda_heads 3, num_heads 3"):
        load_model(open_checkpoint(model_path("kimi-linear")), part=TensorPart(0, 2))
    with pytest.raises(DeltaserveError, match="splits MoE layers by expert, but the model has 5 experts"):
        load_model(open_checkpoint(two_way("kimi-linear")), part=TensorPart(0, 6))
    half = load_model(open_checkpoint(two_way("qwen35")), part=TensorPart(1, 2))  # what rank 1 holds: half the heads
    whole = load_model(open_checkpoint(two_way("qwen35")))
    assert half.layers[0].mixer.out_proj.weight.shape[1] * 2 == whole.layers[0].mixer.out_proj.weight.shape[1]
    torch.testing.assert_close(half.layers[0].mixer.A, whole.layers[0].mixer.A[2:])  # value heads 2, 3 of 4


def test_torchrun_runs_the_command_line_across_two_ranks(model_path, tmp_path):
    """`torchrun --nproc-per-node 2 -m deltaserve run MODEL --pp 2` writes what one process writes."""
    args = [str(model_path("qwen35")), "-p", "ROMEO:", "-n", "10", "--temperature", "0"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    one = subprocess.run([sys.executable, "-m", "deltaserve", "run", *args], capture_output=True, text=True,
                         env=env, timeout=300)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()), "-m", "deltaserve", "run", *args, "--pp", "2"]
    two = subprocess.run(torchrun, capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and len(one.stdout) > len("ROMEO:\n")


def test_without_torchrun_the_error_says_how_to_launch(model_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "deltaserve", "run", str(model_path("qwen35")), "-p", "x",
                           "--pp", "2"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and "torchrun --nproc-per-node 2" in done.stderr, done.stderr


@pytest.mark.parametrize("how", ["dies", "hang"])
def test_a_dead_or_hung_rank_gives_a_clear_error_within_the_timeout(how, model_path):
    timeout = 4.0
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=ranks.check_dead_rank, args=(r, str(model_path("qwen35")), port, how, timeout, out))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        first, second = out.get(timeout=120), out.get(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for message, _ in (first, second):
        assert "rank 0: 'forward' failed" in message and "--dist-timeout" in message, message
    assert first[1] < timeout + 3, f"the error took {first[1]:.1f} s with a {timeout} s timeout"
    assert second[1] - first[1] < 0.5, "a broken pipeline must refuse at once, not wait again"


def test_split_balances_weights_and_leaves_every_rank_a_layer(model_path):
    """Rank 0 also holds the embedding (the tied head): the cut is within a layer of the most even one, found
    here by trying every cut."""
    model = load_model(open_checkpoint(model_path("qwen35")))
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    embed = model.embed.weight.numel()
    stages = split_layers(model, 2)
    assert [r.start for r in stages] == [0, stages[0].stop] and stages[-1].stop == len(sizes)
    held = [sum(sizes[i] for i in r) for r in stages]
    held[0] += embed + model.norm.weight.numel()
    best = min(abs((embed + sum(sizes[:c])) - sum(sizes[c:])) for c in range(1, len(sizes)))
    assert abs(held[0] - held[1]) <= best + max(sizes)  # within a layer of the best cut
    assert split_layers(model, len(sizes)) == [range(i, i + 1) for i in range(len(sizes))]
    with pytest.raises(Exception, match="at most 4 pipeline stages"):
        split_layers(model, 5)


def test_gloo_is_there():
    assert torch.distributed.is_available() and torch.distributed.is_gloo_available()


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_micro_batches_give_the_unsplit_pass_and_one_process(arch, two_way, tmp_path):
    draft = make_model(arch, "tiny", "q8_0", tmp_path / "draft.gguf", seed=3, changes=EVEN_HEADS["qwen35"]).gguf_path
    mp.spawn(ranks.check_micro_batches, args=(str(two_way(arch)), free_port(), str(draft)), nprocs=2)


def test_micro_batches_without_a_pipeline_are_refused(model_path):
    done = subprocess.run([sys.executable, "-m", "deltaserve", "run", str(model_path("qwen35")), "-p", "x",
                           "--micro-batches", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "--micro-batches 2 splits the passes of a pipeline: it needs --pp" in done.stderr

"""A model spread over several processes or machines with torch.distributed: pipeline parallel (`--pp N`,
dist/pipeline.py) and tensor parallel (`--tp N`, dist/tensor.py).

Every process runs the same command line under torchrun; `join` loads this rank's part and returns the
model on rank 0, which serves as if the model were local; the other ranks work rank 0's commands until it
stops, and get None.
"""

from __future__ import annotations

import atexit
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from deltaserve.dist import group
from deltaserve.dist.group import DistributedError, Link
from deltaserve.dist.pipeline import PipelineModel, work_stage
from deltaserve.dist.spread import SpreadModel, SpreadState
from deltaserve.dist.stage import StagePart
from deltaserve.dist.tensor import TensorModel, TensorPart, sum_outputs, work_shard
from deltaserve.errors import DeltaserveError
from deltaserve.loader import open_checkpoint
from deltaserve.models import load_model
from deltaserve.tokenizer import Tokenizer

LOAD_TIMEOUT_S = 3600  # ranks load their parts at their own pace: the first pass waits for the slowest


def join(path: str | Path, *, pp: int = 1, tp: int = 1, dtype: torch.dtype = torch.float32,
         kv_dtype: torch.dtype | None = None, timeout_s: float = 120.0, micro_batches: int = 1):
    """This process's part of the checkpoint at `path` spread over pp pipeline stages or tp tensor shards
    (every rank reads only its own tensors, from the same file or its own copy at that path). Rank 0:
    (model, tokenizer), the other ranks stopped when it exits (atexit). Other ranks: None once rank 0 said
    stop. timeout_s: how long any rank waits for another before giving up with a DistributedError.
    micro_batches (--pp): the most micro-batches a pass is split into (default 1: unsplit)."""
    if pp > 1 and tp > 1:
        raise DeltaserveError(f"--pp {pp} with --tp {tp}: one kind of split at a time so far")
    world_size = max(pp, tp)
    rank = group.join(world_size, timeout_s, "--pp" if pp > 1 else "--tp")
    ckpt = open_checkpoint(Path(path))
    part = StagePart(rank, world_size) if pp > 1 else TensorPart(rank, world_size)
    model = load_model(ckpt, dtype=dtype, kv_dtype=kv_dtype, part=part)
    if tp > 1:
        sum_outputs(model, part)
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=max(timeout_s, LOAD_TIMEOUT_S)), wait_all_ranks=True)
    except Exception as e:
        raise DistributedError(f"rank {rank}: another rank did not finish loading its part ({e})") from e
    if rank != 0:
        try:
            work_stage(model, part.stage, timeout_s) if pp > 1 else work_shard(model, part, timeout_s)
        finally:
            group.leave()
        return None
    link = Link(world_size, timeout_s)
    atexit.register(_close, link)
    tokenizer = (Tokenizer.from_gguf_metadata(ckpt.metadata, str(ckpt.path)) if hasattr(ckpt, "metadata")
                 else Tokenizer.from_hf_dir(Path(path)))
    spread = PipelineModel(model, part.stages, link, micro_batches) if pp > 1 else TensorModel(model, part, link)
    return spread, tokenizer


def _close(link: Link) -> None:
    link.close()
    group.leave()


__all__ = ["DistributedError", "PipelineModel", "SpreadModel", "SpreadState", "TensorModel", "join"]

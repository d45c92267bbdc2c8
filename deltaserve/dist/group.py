"""The process group of a distributed model, and rank 0's command channel to the other ranks.

Every rank joins one torch.distributed group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), over gloo. Rank 0 decides everything and sends each decision as a command: a small pickled
tuple broadcast to all ranks, followed by the tensors that command moves, point to point. Every collective
has the group's timeout, so a rank that died or hangs turns into a `DistributedError` naming the rank and
the operation within that time; an idle rank 0 sends a heartbeat so that its workers, which wait for the
next command, can tell an idle server from a dead one.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from deltaserve.errors import DeltaserveError

ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(DeltaserveError):
    """Another rank failed, hung past the timeout, or shut down: the distributed model cannot go on."""


def join(world_size: int, timeout_s: float, flag: str = "--pp") -> int:
    """Join the group torchrun describes in the environment; this process's rank. world_size: the ranks the
    command line asked for (`flag`, --pp or --tp), which must be torchrun's WORLD_SIZE."""
    missing = [k for k in ENV if k not in os.environ]
    if missing:
        raise DeltaserveError(f"{flag} {world_size} runs one process per rank under torchrun (e.g. `torchrun "
                              f"--nproc-per-node {world_size} -m deltaserve serve MODEL {flag} {world_size}`); "
                              f"{', '.join(missing)} not set")
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise DeltaserveError(f"{flag} {world_size} needs {world_size} processes, but torchrun started "
                              f"WORLD_SIZE={os.environ['WORLD_SIZE']}")
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank()


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _failed(what: str, error: BaseException, timeout_s: float) -> DistributedError:
    return DistributedError(f"rank {dist.get_rank()}: {what} failed: another rank died, hung for more than "
                            f"{timeout_s:g} s (--dist-timeout) or shut down ({type(error).__name__}: "
                            f"{str(error).split(' This is typically')[0]})")  # gloo's advice after it repeats ours


class Link:
    """Rank 0's end: one command at a time (a lock), each broadcast to every rank and then its tensors sent
    or received. A failure inside a command leaves the ranks out of step, so it breaks the link for good:
    every later command raises the same error at once instead of waiting for the timeout again."""

    def __init__(self, world_size: int, timeout_s: float, heartbeat: bool = True):
        self.world_size, self.timeout_s = world_size, timeout_s
        self.error: DistributedError | None = None
        self.on_break: Callable[[DistributedError], None] | None = None  # called once, when the link breaks
        self.bytes_sent = self.bytes_received = 0  # tensors only: the activations and checkpoint copies
        self._lock = threading.RLock()
        self._last = time.monotonic()
        self._stop = threading.Event()
        if heartbeat:
            threading.Thread(target=self._beat, name="deltaserve-heartbeat", daemon=True).start()

    @contextmanager
    def command(self, op: str, *args) -> Iterator[None]:
        """Tell every rank to run `op` with `args`; the body moves the command's tensors (send / recv)."""
        with self._lock:
            if self.error is not None:
                raise self.error
            try:
                dist.broadcast_object_list([(op, args)], src=0)
                yield
            except Exception as e:
                self.error = e if isinstance(e, DistributedError) else _failed(f"'{op}'", e, self.timeout_s)
                self._stop.set()
                if self.on_break is not None:
                    self.on_break(self.error)
                raise self.error from e
            finally:
                self._last = time.monotonic()

    def send(self, tensors: Sequence[torch.Tensor], dst: int) -> None:
        self.bytes_sent += send(tensors, dst)

    def recv(self, shapes: Sequence[Shape], src: int) -> list[torch.Tensor]:
        out = recv(shapes, src)
        self.bytes_received += sum(t.numel() * t.element_size() for t in out)
        return out

    def isend(self, t: torch.Tensor, dst: int) -> Pending:
        self.bytes_sent += t.numel() * t.element_size()
        return isend(t, dst)

    def irecv(self, shape: Shape, src: int) -> Pending:
        self.bytes_received += math.prod(shape[0]) * shape[1].itemsize
        return irecv(shape, src)

    def close(self) -> None:
        """Tell the other ranks to exit (they do once they read it); nothing to do on a broken link."""
        self._stop.set()
        if self.error is None:
            try:
                with self.command("stop"):
                    pass
            except DistributedError:
                pass

    def _beat(self) -> None:
        interval = max(0.05, self.timeout_s / 4)
        while not self._stop.wait(interval / 2):
            if time.monotonic() - self._last >= interval and self._lock.acquire(blocking=False):
                try:
                    if self.error is None and not self._stop.is_set():
                        with self.command("ping"):
                            pass
                except DistributedError:
                    return
                finally:
                    self._lock.release()


def next_command(timeout_s: float) -> tuple[str, tuple]:
    """A worker's wait for rank 0's next command (op, args)."""
    box = [None]
    try:
        dist.broadcast_object_list(box, src=0)
    except Exception as e:
        raise _failed("waiting for rank 0", e, timeout_s) from e
    return box[0]


Shape = tuple[tuple[int, ...], torch.dtype]


def send(tensors: Sequence[torch.Tensor], dst: int) -> int:
    """Send each tensor to rank dst; the bytes sent. Both ends know the shapes: an empty tensor is skipped."""
    sent = 0
    for t in tensors:
        if t.numel():
            dist.send(t.contiguous(), dst)
            sent += t.numel() * t.element_size()
    return sent


def recv(shapes: Sequence[Shape], src: int) -> list[torch.Tensor]:
    """Tensors of these (shape, dtype) from rank src, in the order it sent them."""
    out = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]
    for t in out:
        if t.numel():
            dist.recv(t, src)
    return out


class Pending:
    """A tensor on its way (isend / irecv): wait() once it is there, within the group's timeout. The
    tensor is kept here until then, as gloo reads or writes it in the background."""

    def __init__(self, t: torch.Tensor, work):
        self.tensor, self.work = t, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.tensor


def isend(t: torch.Tensor, dst: int) -> Pending:
    """Start sending t to rank dst (not empty: both ends know the shape)."""
    t = t.contiguous()
    return Pending(t, dist.isend(t, dst))


def irecv(shape: Shape, src: int) -> Pending:
    """Start receiving a tensor of this (shape, dtype) from rank src; several from one rank arrive in order."""
    t = torch.empty(shape[0], dtype=shape[1])
    return Pending(t, dist.irecv(t, src))

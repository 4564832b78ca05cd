"""A process group of its own for broadcasting weights from trainer rank 0 to every engine.

It is separate from the trainer's data-parallel group (the engines are not trainer ranks): rank 0 is
trainer rank 0, ranks 1..n are the engines. gloo on CPU, NCCL when the members hold GPUs. Tensors go
in the order of ``meta`` (sorted parameter names), which both sides get from the driver, so no shape or
name travels over the group itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "torch.float32"


def describe(state: dict[str, Tensor]) -> list[TensorMeta]:
    return [TensorMeta(k, tuple(state[k].shape), str(state[k].dtype)) for k in sorted(state)]


class BroadcastFailed(RuntimeError):
    """A weight broadcast failed on this member, which has left the group (gloo)."""


class WeightGroup:
    """Membership in the weight-broadcast group; ``send`` on rank 0, ``receive`` on the others."""

    def __init__(self, host: str, port: int, rank: int, world: int, timeout: timedelta = TIMEOUT) -> None:
        store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # Typed loosely: torch's stubs do not declare the backends' broadcast(tensor, root).
        self.group: Any
        if self.device == "cuda":  # not exercised on the CPU test machines
            self.group = dist.ProcessGroupNCCL(store, rank, world, dist.ProcessGroupNCCL.Options())
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world, timeout)
        self.rank = rank

    def send(self, state: dict[str, Tensor]) -> None:
        for meta in describe(state):
            self._broadcast(state[meta.name].contiguous().to(self.device))

    def receive(self, metas: list[TensorMeta]) -> dict[str, Tensor]:
        out = {}
        for meta in metas:
            buf = torch.empty(
                meta.shape, dtype=getattr(torch, meta.dtype.removeprefix("torch.")), device=self.device
            )
            self._broadcast(buf)
            out[meta.name] = buf.cpu()
        return out

    def _broadcast(self, t: Tensor) -> None:
        if self.group is None:
            raise RuntimeError(
                "internal: this member left the weight group after a failed broadcast, and the group was "
                "not formed again before the next one (CollectiveSync forms it at the next publish)"
            )
        try:
            self.group.broadcast(t, 0).wait()
        except RuntimeError as err:
            if self.device == "cuda":  # NCCL reports a lost member through its watchdog: not handled here
                raise
            # A member died, or the group timed out. The broadcast runs down a tree, so the members around
            # this one may wait on it for the rest of the timeout (10 minutes by default): leaving the group
            # closes this member's connections, which fails their waits at once.
            self.group = None
            raise BroadcastFailed(str(err)) from err

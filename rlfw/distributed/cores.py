"""One machine's cores shared between the pools: a process whose phase is done lends its threads.

On one CPU machine the rollout actor and the trainer rank each own a core (``engine.cpu_threads``,
``trainer.cpu_threads``), and in an async run the shorter phase leaves its core idle until the next
step. With ``lend_idle_cores=true`` every such process holds a seat in a small shared ledger (a file
the driver creates in the run folder, mapped into each process): a seat reads its owner's thread count
while the owner is idle and 0 while it works. A working process may then run its thread-count-independent
kernels (:mod:`rlfw.kernels.threads`) on its own threads plus every idle seat's, and narrows again as
soon as a neighbour gets busy. Those kernels give the same bits at any thread count, so lending changes
how fast a step runs, never what it computes.

Each seat has one writer (its owner); readers see each byte whole, so no lock is needed. A process that
dies keeps its last state: busy (nothing more is lent) or idle (its neighbours may briefly run a thread
more than the machine has cores; slower, not wrong).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

LEDGER_FILE = "cores.ledger"


def create_ledger(run_dir: Path, seats: int) -> Path:
    """Create the ledger for ``seats`` processes in ``run_dir``; every seat starts busy (lends nothing)."""
    path = run_dir / LEDGER_FILE
    path.write_bytes(bytes(max(seats, 1)))
    return path


@dataclass(frozen=True)
class Seat:
    """Where one process sits in the ledger: the file and its index (picklable, for actor arguments)."""

    path: str
    index: int


class CoreLedger:
    """A process's view of the ledger: mark itself busy or idle, and ask how many threads it may use."""

    def __init__(self, seat: Seat, own_threads: int) -> None:
        self.index = seat.index
        self.own = max(1, min(own_threads, 255))
        self.cores = os.cpu_count() or 1
        with open(seat.path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        if self.index >= len(self._map):
            raise ValueError(f"core ledger {seat.path} has {len(self._map)} seats; seat {self.index} asked")
        self._map[self.index] = self.own  # idle until its first phase

    def threads(self) -> int:
        """Own threads plus every idle neighbour's, capped at the machine's cores."""
        lent = sum(self._map[:]) - self._map[self.index]
        return min(self.own + lent, max(self.cores, self.own))

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Mark this process working for the enclosed phase (it lends nothing meanwhile)."""
        self._map[self.index] = 0
        try:
            yield
        finally:
            self._map[self.index] = self.own


def join(seat: Seat | None, own_threads: int) -> CoreLedger | None:
    """Take ``seat`` (None: no ledger in this run) and let this process's kernels borrow idle cores."""
    if seat is None:
        return None
    from rlfw.kernels import threads

    ledger = CoreLedger(seat, own_threads)
    threads.set_lender(ledger.threads)
    return ledger


@contextmanager
def working(ledger: CoreLedger | None) -> Iterator[None]:
    """``ledger.busy()``, or nothing without a ledger."""
    if ledger is None:
        yield
        return
    with ledger.busy():
        yield

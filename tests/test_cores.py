"""``lend_idle_cores``: the core ledger the pools share on one machine, and how kernels widen through it."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfw.config import ConfigError
from rlfw.distributed.cores import CoreLedger, Seat, create_ledger, join, working
from rlfw.kernels import threads


def _ledger(tmp_path: Path, seats: int, own: list[int]) -> list[CoreLedger]:
    path = str(create_ledger(tmp_path, seats))
    return [CoreLedger(Seat(path, i), n) for i, n in enumerate(own)]


def test_a_busy_process_borrows_the_threads_of_idle_neighbours_only(tmp_path: Path) -> None:
    engine, trainer, other = _ledger(tmp_path, 3, [1, 1, 2])
    engine.cores = trainer.cores = other.cores = 64  # as if on a large machine
    assert trainer.threads() == 1 + 1 + 2  # everyone idle
    with engine.busy():
        assert trainer.threads() == 1 + 2
        with other.busy():
            assert trainer.threads() == 1
    assert trainer.threads() == 4  # the neighbours lend again once their phase ends


def test_borrowing_never_exceeds_the_machine(tmp_path: Path) -> None:
    a, b = _ledger(tmp_path, 2, [3, 3])
    a.cores = 4
    assert a.threads() == 4
    a.cores = 2  # a process given more threads than cores keeps its own count
    assert a.threads() == 3


def test_a_seat_past_the_ledger_is_refused(tmp_path: Path) -> None:
    path = str(create_ledger(tmp_path, 2))
    with pytest.raises(ValueError, match="2 seats; seat 2"):
        CoreLedger(Seat(path, 2), 1)


def _hold_busy(path: str, ready: Any, done: Any) -> None:  # two multiprocessing Events
    ledger = CoreLedger(Seat(path, 1), 1)
    with ledger.busy():
        ready.set()
        done.wait(60)


def test_another_process_marking_itself_busy_is_seen_here(tmp_path: Path) -> None:
    """The ledger is a shared mapping: the trainer rank and the engine actor are separate processes."""
    path = str(create_ledger(tmp_path, 2))
    here = CoreLedger(Seat(path, 0), 1)
    here.cores = 8
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_busy, args=(path, ready, done))
    child.start()
    try:
        assert ready.wait(60)
        assert here.threads() == 1  # the neighbour works: nothing lent
        done.set()
        child.join(60)
        assert child.exitcode == 0
        assert here.threads() == 2  # it left its phase (and the process) idle
    finally:
        done.set()
        child.join(5)


def test_widened_kernels_run_on_the_lent_threads_and_return_to_their_own(tmp_path: Path) -> None:
    path = str(create_ledger(tmp_path, 2))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ledger = join(Seat(path, 0), 1)
        assert ledger is not None
        ledger.cores = 8
        seen = []
        with threads.widened():
            seen.append(torch.get_num_threads())  # the neighbour (seat 1) has not joined: 0 lent
        CoreLedger(Seat(path, 1), 3)  # joins idle, lending 3
        with working(ledger), threads.widened():
            seen.append(torch.get_num_threads())
        assert seen == [1, 4]
        assert torch.get_num_threads() == 1
    finally:
        threads.set_lender(None)
        torch.set_num_threads(before)


def test_without_a_ledger_nothing_is_lent() -> None:
    assert join(None, 1) is None
    own = torch.get_num_threads()
    with working(None), threads.widened():
        assert torch.get_num_threads() == own


def test_lending_needs_one_machine() -> None:
    from rlfw.config import RunConfig

    with pytest.raises(ConfigError, match="lend_idle_cores=true .* needs a local run"):
        RunConfig(lend_idle_cores=True, ray_address="10.0.0.1:6379")

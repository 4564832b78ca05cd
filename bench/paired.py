"""Paired timing for benchmarks: alternate two workloads so machine noise hits both alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def paired_medians(a: Callable[[], None], b: Callable[[], None], reps: int) -> tuple[float, float]:
    """Median seconds of ``a`` and of ``b`` over ``reps`` alternating runs, after one warm-up each."""
    ta, tb = alternated_medians([a, b], reps)
    return ta, tb


def alternated_medians(workloads: Sequence[Callable[[], object]], reps: int) -> list[float]:
    """Median seconds of each workload over ``reps`` rounds that run every workload once, in order, after
    one warm-up each."""
    for f in workloads:
        f()
    times: list[list[float]] = [[] for _ in workloads]
    for _ in range(reps):
        for f, acc in zip(workloads, times, strict=True):
            _sync()
            t0 = time.perf_counter()
            f()
            _sync()
            acc.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def alternated_block_medians(workloads: Sequence[Callable[[], object]], reps: int, calls: int) -> list[float]:
    """Median seconds per call of each workload, timed as blocks of ``calls`` back-to-back calls with one
    synchronisation at each end (so a GPU kernel of tens of microseconds is not timed as a launch plus a
    sync), the workloads' blocks alternated over ``reps`` rounds after one warm-up call each."""
    blocks = [lambda f=f: [f() for _ in range(calls)] for f in workloads]
    return [t / calls for t in alternated_medians(blocks, reps)]

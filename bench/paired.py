"""Paired timing for benchmarks: alternate two workloads so machine noise hits both alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def paired_medians(a: Callable[[], None], b: Callable[[], None], reps: int) -> tuple[float, float]:
    """Median seconds of ``a`` and of ``b`` over ``reps`` alternating runs, after one warm-up each."""
    a(), b()
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(reps):
        for f, acc in ((a, ta), (b, tb)):
            _sync()
            t0 = time.perf_counter()
            f()
            _sync()
            acc.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)

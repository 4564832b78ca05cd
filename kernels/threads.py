"""How many threads the thread-count-independent CPU kernels may use at this moment.

The compiled kernels (:mod:`rlfw.kernels.cpu_native`: the linear, the attention, RMSNorm, RoPE, SiLU-mul
and their backward passes) compute every output element on one thread in a fixed
order, so their bits do not depend on how many threads run them (tested).
That makes them safe to widen on the fly: a process that is told a neighbour's cores are idle can run
these kernels on more threads than its own share, and narrow again when the neighbour gets busy, without
any result changing. Everything else keeps the process's own thread count (torch's other ops and the BLAS
library may split reductions differently at a different count).

Who says how many threads are free is the caller's business (``rlfw.distributed.cores`` on one
machine); this module only holds the callable and applies it around each kernel call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_lender: Callable[[], int] | None = None
_calls = [0, 0]  # kernel calls under widened(), and how many of them ran on more than the own threads


def set_lender(lender: Callable[[], int] | None) -> None:
    """Install ``lender`` (returns the threads the kernels may use now), or remove it with ``None``."""
    global _lender
    _lender = lender


def lending() -> bool:
    """Whether a lender is installed (``lend_idle_cores=true``): the linears' backward then runs the
    compiled kernel too, so gradients keep their bits whenever threads are lent."""
    return _lender is not None


@contextmanager
def widened() -> Iterator[None]:
    """Run the enclosed kernel call on the lender's thread count when it exceeds this thread's own."""
    want = _lender() if _lender is not None else 0
    own = torch.get_num_threads()
    _calls[0] += 1
    if want <= own:
        yield
        return
    _calls[1] += 1
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(own)


def counts() -> tuple[int, int]:
    """Kernel calls so far in this process, and how many of them ran widened (on lent threads)."""
    return _calls[0], _calls[1]

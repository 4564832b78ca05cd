"""Bit-pattern comparison helpers: bitwise claims are checked on bits, not with ``torch.equal``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits(t: Tensor) -> Tensor:
    """The raw bit pattern of a float tensor (integer tensors are returned as they are)."""
    t = t.detach().contiguous()
    return t.view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


def assert_same_bits(a: Tensor, b: Tensor, what: str = "") -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    differ = bits(a) != bits(b)
    assert not bool(differ.any()), f"{what}: {int(differ.sum())} of {differ.numel()} elements differ in bits"


def embed_row(row: Tensor, n_rows: int, at: int, seed: int) -> Tensor:
    """A batch of ``n_rows`` random rows like ``row`` (``[1, ...]``) with ``row`` placed at index ``at``."""
    g = torch.Generator().manual_seed(seed)
    batch = torch.randn((n_rows, *row.shape[1:]), generator=g).to(row.dtype)
    batch[at] = row[0]
    return batch


NEIGHBOURS = ("random", "zeros", "huge", "copies")
"""What the rows around a row under test hold: random values, zeros, values near 1e30 (whose squares and
products overflow), or copies of the row itself."""


def surround(row: Tensor, lead: tuple[int, ...], at: tuple[int, ...], kind: str, seed: int) -> Tensor:
    """A batch ``[*lead, *row.shape]`` of ``kind`` rows (see :data:`NEIGHBOURS`) with ``row`` at ``at``."""
    g = torch.Generator().manual_seed(seed)
    shape = (*lead, *row.shape)
    if kind == "zeros":
        batch = torch.zeros(shape, dtype=row.dtype)
    elif kind == "huge":
        batch = (torch.randn(shape, generator=g) * 1e30).to(row.dtype)
    elif kind == "copies":
        batch = row.expand(shape).clone()
    elif kind == "random":
        batch = torch.randn(shape, generator=g).to(row.dtype)
    else:
        raise ValueError(f"kind={kind!r}; allowed values: {', '.join(NEIGHBOURS)}")
    batch[at] = row
    return batch


DTYPES = (torch.float32, torch.bfloat16)


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the enclosed code with torch on ``threads`` threads, then restore the count it had."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)

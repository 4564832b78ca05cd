"""Row reductions whose bits depend only on the row.

torch reduces the last dim of a contiguous tensor one output at a time in a fixed order, except in one
case: a reduction with a *single* output over at least 32768 elements is split across threads (a
"two-pass" reduction). A lone vocabulary row would then be summed in a different order than the same
row inside a batch. We therefore never hand torch a long row: rows longer than :data:`SUM_CHUNK` are
summed in fixed zero-padded chunks first, then the chunk sums are added, so every row of a given length
is reduced by the same program whatever the number of rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

SUM_CHUNK = 1024
"""Longest run of elements torch reduces in one go (well under the 32768-element threading threshold)."""


def row_sum(x: Tensor) -> Tensor:
    """Sum over the last dim with an order fixed by the row length alone. ``x [..., D] -> [...]``."""
    x = x.contiguous()
    d = x.shape[-1]
    if d <= SUM_CHUNK:
        return x.sum(-1)
    # The whole chunks are summed in place; only the last, partial one is copied to be zero-padded (a
    # padded copy of the whole row would be a second pass over a real vocabulary's logits). Each chunk
    # is the same contiguous run of SUM_CHUNK elements either way, so the same sum.
    full = d - d % SUM_CHUNK
    sums = x[..., :full].unflatten(-1, (-1, SUM_CHUNK)).sum(-1)
    if full < d:
        tail = F.pad(x[..., full:], (0, SUM_CHUNK - (d - full))).sum(-1, keepdim=True)
        sums = torch.cat([sums, tail], -1)
    return sums.sum(-1)


def row_max(x: Tensor) -> Tensor:
    """Max over the last dim, with ``-0.0`` turned into ``+0.0``.

    A max is exact, but when a row holds both zeros its sign depends on which one the scan met first;
    adding ``+0.0`` removes that freedom (``-0.0 + 0.0 == +0.0`` and every other value is unchanged).
    """
    return x.contiguous().amax(-1) + 0.0

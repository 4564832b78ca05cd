"""``tile_dot``: the tile product the Triton kernels use, with a row's result independent of its row.

On a GPU ``tl.dot`` reduces each output element inside one MMA tile in an order fixed by the tile shape,
whatever the other rows hold. Under ``TRITON_INTERPRET=1`` it is numpy's matmul, i.e. the BLAS library's,
whose micro-kernels treat rows differently by their index within the tile (measured with OpenBLAS 0.3.30:
10 of 16 rows of a ``[16, 16] @ [16, 32]`` product change bits when moved to row 0). There the product is
spelled as a broadcast multiply and a sum over K, which numpy reduces slice by slice in ascending K for
every element alike.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether Triton runs its interpreter (decided before any kernel is defined, as Triton itself does)."""


@triton.jit
def tile_dot(a, b, ROW_EXACT: tl.constexpr):
    """``a [M, K] @ b [K, N]`` in fp32; ``ROW_EXACT`` (pass ``INTERPRETED``): the broadcast-sum form."""
    if ROW_EXACT:
        return tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    else:
        return tl.dot(a, b, input_precision="ieee")

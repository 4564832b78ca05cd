"""Batch-invariant matmul on the exact torch path.

Measured on CPU (torch 2.13, MKL): ``F.linear`` in fp32 gives a row different bits when it is alone
(a GEMV) than inside a batch, and with two threads the blocked GEMM splits long reductions differently
for different row counts. Two fixed choices remove both effects:

* rows are padded to a multiple of :data:`ROW_BLOCK` and viewed as ``[N/16, 16, K]`` blocks, so the
  library never sees a one-row (GEMV) problem and every block is the same shape;
* the reduction dim is cut into fixed :data:`K_TILE` slices whose partial products are added in
  ascending order in fp32 (no split-K chosen by the library).

bf16 operands are widened to fp32 (exact), multiplied and accumulated in fp32 and rounded to bf16 once
at the end, so bf16 invariance follows from fp32 invariance rather than from rounding hiding changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ROW_BLOCK = 16
K_TILE = 256


def _row_blocks(a: Tensor) -> Tensor:
    """``a [..., M, K] -> [..., ceil(M/16), 16, K]`` zero-padded."""
    pad = (-a.shape[-2]) % ROW_BLOCK
    return F.pad(a, (0, 0, 0, pad)).unflatten(-2, (-1, ROW_BLOCK))


def _k_tiled(a: Tensor, b: Tensor) -> Tensor:
    """``a [..., K] @ b [..., K, N]`` with partial products over fixed K tiles added in ascending order."""
    k = a.shape[-1]
    acc = torch.matmul(a[..., :K_TILE], b[..., :K_TILE, :])
    for k0 in range(K_TILE, k, K_TILE):
        acc = acc + torch.matmul(a[..., k0 : k0 + K_TILE], b[..., k0 : k0 + K_TILE, :])
    return acc


def block_matmul(a: Tensor, b: Tensor) -> Tensor:
    """fp32 ``a [..., M, K] @ b [..., K, N] -> [..., M, N]``; row ``m`` of the result depends only on
    row ``m`` of ``a`` (and ``b``).

    A 2-D ``b`` is shared by all blocks (torch folds the blocks into one GEMM with M a multiple of 16);
    a batched ``b`` is broadcast over the row blocks of its batch entry.
    """
    m = a.shape[-2]
    blocks = _row_blocks(a.float())
    bf = b.float()
    if bf.dim() > 2:
        bf = bf.unsqueeze(-3)
    out = _k_tiled(blocks, bf)
    return out.flatten(-3, -2)[..., :m, :]


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x [..., K] @ weight[N, K].T -> [..., N]`` in ``x.dtype``, fp32 accumulation, invariant rows."""
    rows = x.reshape(-1, x.shape[-1])
    out = block_matmul(rows, weight.t())
    return out.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)

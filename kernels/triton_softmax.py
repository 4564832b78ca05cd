"""Triton row log-softmax and token log-probs.

One program per row walks the vocabulary in fixed ``LSM_BLOCK_V`` chunks: a max pass (``+ 0.0`` turns a
``-0.0`` max into ``+0.0``, as on the torch path), a sum-of-exp pass, then ``(x - max) - lse`` is
written. Token log-probs gather ``x`` in torch and apply that identical arithmetic to the row stats, so
they have the same bits as gathering from the written log-softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlfw.kernels.triton_config import LSM_BLOCK_V


@triton.jit
def _row_stats_kernel(x_ptr, m_ptr, lse_ptr, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * width may pass 2^31
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(x_ptr + row * V + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(x, axis=0))
    m = m + 0.0
    s = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(x_ptr + row * V + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        s += tl.sum(tl.exp(x - m), axis=0)
    tl.store(m_ptr + row, m)
    tl.store(lse_ptr + row, tl.log(s))


@triton.jit
def _log_softmax_kernel(x_ptr, m_ptr, lse_ptr, y_ptr, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * width may pass 2^31
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    x = tl.load(x_ptr + row * V + offs, mask=mask, other=0.0).to(tl.float32)
    y = (x - tl.load(m_ptr + row)) - tl.load(lse_ptr + row)
    tl.store(y_ptr + row * V + offs, y, mask=mask)


def row_stats(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(rows [N, V], max [N], lse_shifted [N])`` in fp32 for ``logits [..., V]``."""
    v = logits.shape[-1]
    rows = logits.reshape(-1, v).contiguous()
    m = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
    lse = torch.empty_like(m)
    _row_stats_kernel[(rows.shape[0],)](rows, m, lse, v, BLOCK_V=LSM_BLOCK_V)
    return rows, m, lse


def log_softmax(logits: Tensor) -> Tensor:
    """fp32 log-softmax over the last dim."""
    rows, m, lse = row_stats(logits)
    y = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
    grid = (rows.shape[0], triton.cdiv(rows.shape[1], LSM_BLOCK_V))
    _log_softmax_kernel[grid](rows, m, lse, y, rows.shape[1], BLOCK_V=LSM_BLOCK_V)
    return y.reshape(logits.shape)


def token_logp(logits: Tensor, ids: Tensor) -> Tensor:
    """fp32 ``log_softmax(logits)[..., ids]``."""
    rows, m, lse = row_stats(logits)
    x = rows.gather(-1, ids.reshape(-1, 1)).squeeze(-1).float()
    return ((x - m) - lse).reshape(ids.shape)

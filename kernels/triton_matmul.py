"""Triton matmul with fixed tiles and an ascending K loop (no split-K).

Each program owns one ``[MM_BLOCK_M, MM_BLOCK_N]`` output tile and walks K in ``MM_BLOCK_K`` steps from 0
upwards, so an output element is reduced by the same sequence of tile products whatever the number of
rows. Operands are widened to fp32 before the tile product (exact for bf16; required by the interpreter,
whose bf16 ``tl.dot`` is wrong); :func:`~rlfw.kernels.triton_dot.tile_dot` keeps CUDA from using TF32 and
the interpreter from BLAS's row-dependent order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlfw.kernels.triton_config import MM_BLOCK_K, MM_BLOCK_M, MM_BLOCK_N
from rlfw.kernels.triton_dot import INTERPRETED, tile_dot


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_EXACT: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a_mask = (rm[:, None] < M) & (ks[None, :] < K)
        b_mask = (ks[:, None] < K) & (rn[None, :] < N)
        a = tl.load(a_ptr + rm[:, None] * stride_am + ks[None, :] * stride_ak, mask=a_mask, other=0.0)
        b = tl.load(b_ptr + ks[:, None] * stride_bk + rn[None, :] * stride_bn, mask=b_mask, other=0.0)
        acc += tile_dot(a.to(tl.float32), b.to(tl.float32), ROW_EXACT)
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def matmul(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``a [M, K] @ b [K, N] -> [M, N]`` in ``out_dtype``, fp32 accumulation."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(m, MM_BLOCK_M), triton.cdiv(n, MM_BLOCK_N))
    _matmul_kernel[grid](
        a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        BLOCK_M=MM_BLOCK_M, BLOCK_N=MM_BLOCK_N, BLOCK_K=MM_BLOCK_K, ROW_EXACT=INTERPRETED,
    )  # fmt: skip
    return c


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x [..., K] @ weight[N, K].T -> [..., N]`` in ``x.dtype``."""
    rows = x.reshape(-1, x.shape[-1])
    out = matmul(rows, weight.t(), x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])

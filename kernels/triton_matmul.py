"""Triton matmul with a fixed K slice and an ascending K loop (no split-K).

Each program owns one output tile and walks K in fixed slices from 0 upwards, so an output element is
reduced by the same sequence of slice products whatever the number of rows. The output tile, warps and
pipeline depth (:func:`~rlfw.kernels.triton_config.matmul_tiles`) follow the row count: they decide which
elements are computed together, never an element's own chain.

Operands: fp32 goes through :func:`~rlfw.kernels.triton_dot.tile_dot` (IEEE fp32 FMA chains, no TF32);
bf16/fp16 goes into the tensor cores as it is, accumulated in fp32 (``WIDEN=False``). Under the
interpreter (``TRITON_INTERPRET=1``), whose 16-bit ``tl.dot`` is wrong, every operand is widened to fp32
(exact) and the product is the broadcast-sum form, so CPU tests check the same loop structure.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlfw.kernels.triton_config import MM_BLOCK_K, MM_BLOCK_K_16, matmul_tiles
from rlfw.kernels.triton_dot import INTERPRETED, tile_dot

_TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_EXACT: tl.constexpr,
    WIDEN: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Offsets in 64 bits (an LM head's M x vocabulary passes 2^31 at about 14,000 rows); the tile
    # pointers then move along K by pointer arithmetic.
    rm64, rn64, rk64 = rm.to(tl.int64), rn.to(tl.int64), rk.to(tl.int64)
    a_ptrs = a_ptr + rm64[:, None] * stride_am + rk64[None, :] * stride_ak
    b_ptrs = b_ptr + rk64[:, None] * stride_bk + rn64[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a_mask = (rm[:, None] < M) & (ks[None, :] < K)
        b_mask = (ks[:, None] < K) & (rn[None, :] < N)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
        if WIDEN:
            acc += tile_dot(a.to(tl.float32), b.to(tl.float32), ROW_EXACT)
        else:  # 16-bit operands into the tensor cores, fp32 accumulator
            acc = tl.dot(a, b, acc)
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    c_ptrs = c_ptr + rm64[:, None] * stride_cm + rn64[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def into_tensor_cores(a: Tensor, b: Tensor) -> bool:
    """Whether ``a @ b`` takes its operands into the tensor cores unwidened: both bf16 (or both fp16),
    on a GPU (the interpreter widens everything)."""
    return not INTERPRETED and a.dtype == b.dtype and a.dtype in _TENSOR_CORE_DTYPES


def matmul(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``a [M, K] @ b [K, N] -> [M, N]`` in ``out_dtype``, fp32 accumulation."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    widen = not into_tensor_cores(a, b)
    tiles = matmul_tiles(m)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _matmul_kernel[grid](
        a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=MM_BLOCK_K if widen else MM_BLOCK_K_16,
        ROW_EXACT=INTERPRETED, WIDEN=widen, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return c


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x [..., K] @ weight[N, K].T -> [..., N]`` in ``x.dtype``."""
    rows = x.reshape(-1, x.shape[-1])
    out = matmul(rows, weight.t(), x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])

"""Triton RMSNorm: one program per row, fp32 sum of squares, same rounding points as the torch path; and
its closed-form backward in one launch (plus the weight gradient's sum over rows)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * width may pass 2^31
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / D
    normed = (x * tl.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(y_ptr + row * D + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))``; result dtype follows torch promotion of the two."""
    d = x.shape[-1]
    rows = x.reshape(-1, d).contiguous()
    y = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight.contiguous(), y, d, eps, BLOCK_D=triton.next_power_of_2(d)
    )
    return y.reshape(*x.shape[:-1], d)


@triton.jit
def _rms_norm_backward_kernel(x_ptr, w_ptr, g_ptr, dx_ptr, gn_ptr, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * width may pass 2^31
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    n = x * r
    gw = g * w
    dx = r * (gw - n * (tl.sum(gw * n, axis=0) / D))
    tl.store(dx_ptr + row * D + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(gn_ptr + row * D + offs, g * n, mask=mask)


def rms_norm_backward(x: Tensor, weight: Tensor, grad: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)`` of :func:`rms_norm` for the output gradient ``grad``: the closed form of
    :mod:`rlfw.kernels.grads` in fp32, one program per row (``dx`` in ``x.dtype``); ``dweight`` is the
    per-row ``g * n`` summed over the rows in fp32, in ``weight.dtype``."""
    d = x.shape[-1]
    if weight.numel() != d:
        raise ValueError(f"rms_norm_backward: weight of {weight.numel()} values for rows of {d}")
    rows = x.reshape(-1, d).contiguous()
    g = grad.reshape(-1, d).contiguous()
    dx = torch.empty_like(rows)
    gn = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _rms_norm_backward_kernel[(rows.shape[0],)](
            rows, weight.contiguous(), g, dx, gn, d, eps, BLOCK_D=triton.next_power_of_2(d)
        )
    return dx.reshape(x.shape), gn.sum(0).reshape(weight.shape).to(weight.dtype)

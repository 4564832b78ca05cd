"""RMSNorm with fp32 accumulation, one row at a time."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlfw.kernels import cpu_native
from rlfw.kernels.autograd import needs_grad
from rlfw.kernels.reduce import row_sum
from rlfw.kernels.threads import widened


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dim.

    On CPU with fp32 ``x`` and ``weight`` the compiled kernel (``kernels/csrc/elementwise.cpp``) computes each
    row alone: its sum of squares in a fixed lane order, then ``weight * (x * r)``, with or without autograd
    (under autograd its backward is compiled too). Elsewhere the same formula and rounding points as the
    default op (normalise in fp32, round to ``x.dtype``, then scale by ``weight``), with the mean taken as
    :func:`row_sum` divided by the row length so its order is fixed per row. ``rsqrt`` gives the same bits
    on torch's vector and scalar paths in fp32 (checked by a test), so position inside the batch cannot
    change it.
    """
    if _compiled(x, weight):
        if needs_grad(x, weight):
            out: Tensor = _RMSNorm.apply(x, weight, eps)
            return out
        return _compiled_rms_norm(x, weight, eps)[0]
    xf = x.float()
    normed = xf * inverse_rms(xf, eps).unsqueeze(-1)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out_dtype == torch.float32:
        return weight * normed.to(x.dtype)
    # A product of two bf16 values is exact in fp32, so one rounding gives a bf16 multiply's bits. Done
    # this way because torch's vector and scalar bf16 multiplies give a NaN (a zero row with eps=0)
    # different payloads, which would make the bits of such a row depend on its place in the batch.
    return (weight.float() * normed.to(x.dtype).float()).to(out_dtype)


def _compiled(x: Tensor, weight: Tensor) -> bool:
    """Whether the compiled kernel serves this call: fp32 CPU operands with non-empty rows."""
    return cpu_native.serves(x, weight) and x.shape[-1] > 0 and x.numel() > 0


def _compiled_rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The compiled forward: ``(y, r)`` with ``y`` shaped like ``x`` and ``r`` its rows' ``rsqrt``."""
    d = x.shape[-1]
    with widened():
        y, r = cpu_native.module().rms_norm(x.reshape(-1, d).contiguous(), weight.contiguous(), eps)
    return y.view(x.shape), r.view(x.shape[:-1])


def inverse_rms(xf: Tensor, eps: float) -> Tensor:
    """``1 / sqrt(mean(xf^2) + eps)`` per row of fp32 ``xf``, the mean a :func:`row_sum` divided by the
    row length."""
    return torch.rsqrt(row_sum(xf * xf) / xf.shape[-1] + eps)


class _RMSNorm(torch.autograd.Function):
    """The compiled fp32 :func:`rms_norm` (the no-grad path's kernel, so the same bits) keeping each row's
    ``rsqrt`` for the compiled backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, r = _compiled_rms_norm(x, weight, eps)
        ctx.save_for_backward(x, r, weight)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, r, weight = ctx.saved_tensors
        d = x.shape[-1]
        with widened():
            dx, dw = cpu_native.module().rms_norm_backward(
                grad.reshape(-1, d).contiguous(),
                x.reshape(-1, d).contiguous(),
                r.reshape(-1),
                weight.contiguous(),
            )
        return dx.view(x.shape), dw, None

"""RMSNorm with fp32 accumulation, one row at a time."""

from __future__ import annotations

import torch
from torch import Tensor

from rlfw.kernels.reduce import row_sum


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dim.

    Same formula and rounding points as the default op (normalise in fp32, round to ``x.dtype``, then
    scale by ``weight``), with the mean taken as :func:`row_sum` divided by the row length so its order
    is fixed per row. ``rsqrt`` gives the same bits on torch's vector and scalar paths in fp32 (checked by
    a test), so position inside the batch cannot change it.
    """
    xf = x.float()
    mean_sq = row_sum(xf * xf) / x.shape[-1]
    normed = xf * torch.rsqrt(mean_sq + eps).unsqueeze(-1)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out_dtype == torch.float32:
        return weight * normed.to(x.dtype)
    # A product of two bf16 values is exact in fp32, so one rounding gives a bf16 multiply's bits. Done
    # this way because torch's vector and scalar bf16 multiplies give a NaN (a zero row with eps=0)
    # different payloads, which would make the bits of such a row depend on its place in the batch.
    return (weight.float() * normed.to(x.dtype).float()).to(out_dtype)

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
    return weight * normed.to(x.dtype)

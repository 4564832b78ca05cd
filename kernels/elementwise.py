"""Elementwise ops (RoPE, SwiGLU gate) with bits that do not depend on where an element sits.

Elementwise is not automatically invariant on CPU: torch runs the bulk of a tensor through SIMD code
and the last few elements of each contiguous run through scalar code, and for some functions the two
disagree. Measured here: ``F.silu`` differs between the two paths on ~3.6% of fp32 inputs, so a row at
the end of a batch could get other bits than the same row in the middle. ``exp`` and IEEE
``+ - * /`` agree on both paths (a test checks ``exp``), so SiLU is spelt with those.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE in fp32: ``x [B, T, H, D]``, ``cos``/``sin [B, T, D]``; result in ``x.dtype``."""
    xf = x.float()
    cos, sin = cos[:, :, None, :].float(), sin[:, :, None, :].float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def silu(x: Tensor) -> Tensor:
    """``x * sigmoid(x)`` spelt as ``x / (1 + exp(-x))``: ops whose SIMD and scalar paths agree."""
    return x / (1.0 + torch.exp(-x))


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` computed in fp32 and rounded to ``gate.dtype`` once.

    Without autograd the same IEEE operations run in place on one buffer (same bits, one allocation
    instead of four).
    """
    g = gate if gate.dtype == torch.float32 else gate.float()
    u = up if up.dtype == torch.float32 else up.float()
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        out = silu(g) * u
    else:
        denom = torch.neg(g).exp_().add_(1.0)
        out = torch.div(g, denom, out=denom).mul_(u)
    return out if out.dtype == gate.dtype else out.to(gate.dtype)

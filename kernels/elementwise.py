"""Elementwise ops (RoPE, SwiGLU gate) with bits that do not depend on where an element sits.

Elementwise is not automatically invariant on CPU: torch runs the bulk of a tensor through SIMD code
and the last few elements of each contiguous run through scalar code, and for some functions the two
disagree. Measured here: ``F.silu`` differs between the two paths on ~3.6% of fp32 inputs, so a row at
the end of a batch could get other bits than the same row in the middle. ``exp`` and IEEE
``+ - * /`` agree on both paths (a test checks ``exp``), so SiLU is spelt with those.

On CPU the compiled kernels (``kernels/csrc/elementwise.cpp``) serve RoPE (fp32; the same IEEE
operations as the torch spelling, so the same bits), SiLU-mul (with the kernels' own exp) and the
trainer's backward of both: one pass over memory each instead of a chain of small ops or autograd nodes,
whose bits do not depend on the thread count (so a trainer may widen them onto lent cores). Under autograd
the wrappers below run the no-grad path's kernel forward and only keep what their backward needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlfw.kernels import cpu_native
from rlfw.kernels.autograd import needs_grad
from rlfw.kernels.threads import widened


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE in fp32: ``x [B, T, H, D]``, ``cos``/``sin [B, T, D]``; result in ``x.dtype``.

    On CPU the compiled kernel computes :func:`rope_reference`'s operations in the same order (same bits);
    with autograd on an fp32 ``x`` its backward is the compiled one too."""
    if (
        x.dim() != 4
        or cos.dim() != 3
        or cos.shape[-1] != x.shape[-1]
        or not cpu_native.serves(cos, sin)
        or x.device.type != "cpu"
    ):
        return rope_reference(x, cos, sin)
    cos, sin = cos.expand(*x.shape[:2], -1).contiguous(), sin.expand(*x.shape[:2], -1).contiguous()
    if needs_grad(x):
        if x.dtype != torch.float32:
            return rope_reference(x, cos, sin)
        out: Tensor = _Rope.apply(x, cos, sin)
        return out
    out = _compiled_rope(x if x.dtype == torch.float32 else x.float(), cos, sin)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _compiled_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The compiled RoPE on fp32 ``x`` and contiguous ``[B, T, D]`` tables."""
    with widened():
        out: Tensor = cpu_native.module().rope(x.contiguous(), cos, sin)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _compiled_rope(x, cos, sin)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        with widened():
            dx: Tensor = cpu_native.module().rope_backward(grad.contiguous(), cos, sin)
        return dx, None, None


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE spelt with torch ops (other devices, bf16 training, and the reference the kernel matches)."""
    xf = x.float()
    cos, sin = cos[:, :, None, :].float(), sin[:, :, None, :].float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def silu(x: Tensor) -> Tensor:
    """``x * sigmoid(x)`` spelt as ``x / (1 + exp(-x))``: ops whose SIMD and scalar paths agree."""
    return x / (1.0 + torch.exp(-x))


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` computed in fp32 and rounded to ``gate.dtype`` once.

    On CPU the compiled kernel computes :func:`silu`'s operations with the kernels' own exp (glibc's expf
    algorithm, the attention's: torch's vectorised exp differs from it on about 0.07% of floats), with or
    without autograd (under autograd its backward is compiled too). Elsewhere the torch spelling; without
    autograd its IEEE operations run in place on one buffer (same bits, one allocation instead of four).
    """
    g = gate if gate.dtype == torch.float32 else gate.float()
    u = up if up.dtype == torch.float32 else up.float()
    if cpu_native.serves(g, u) and g.shape == u.shape:
        if needs_grad(g, u):
            fused: Tensor = _SiluMul.apply(g, u)
            out = fused
        else:
            out = _compiled_silu_mul(g, u, keep_denom=False)[0]
    elif needs_grad(g, u):
        out = silu(g) * u
    else:
        denom = torch.neg(g).exp_().add_(1.0)
        out = torch.div(g, denom, out=denom).mul_(u)
    return out if out.dtype == gate.dtype else out.to(gate.dtype)


def _compiled_silu_mul(g: Tensor, u: Tensor, keep_denom: bool) -> list[Tensor]:
    """The compiled forward on fp32 ``g`` and ``u``: ``[out]``; ``[out, 1 + exp(-g)]`` with ``keep_denom``."""
    with widened():
        outs: list[Tensor] = cpu_native.module().silu_mul(g.contiguous(), u.contiguous(), keep_denom)
    return [o.view(g.shape) for o in outs]


class _SiluMul(torch.autograd.Function):
    """:func:`silu_mul` with the compiled backward: the forward is the no-grad path's kernel (same bits)
    and keeps ``1 + exp(-gate)`` for the backward."""

    @staticmethod
    def forward(ctx: Any, g: Tensor, u: Tensor) -> Tensor:
        out, denom = _compiled_silu_mul(g, u, keep_denom=True)
        ctx.save_for_backward(g, u, denom)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        g, u, denom = ctx.saved_tensors
        with widened():
            dg, du = cpu_native.module().silu_mul_backward(
                grad.contiguous(), g.contiguous(), u.contiguous(), denom.contiguous()
            )
        return dg, du

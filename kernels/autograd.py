"""Training wrappers: the forward is the inference op bit for bit, the backward is plain torch math.

Ops spelt with differentiable torch ops whose forward already *is* the inference op (log-softmax, router
gates; RMSNorm, RoPE and SiLU off CPU) need no wrapper. On CPU in fp32, RMSNorm, RoPE, SiLU-mul
(:mod:`~rlfw.kernels.norm`, :mod:`~rlfw.kernels.elementwise`) and the attention
(:class:`~rlfw.kernels.attention.CompiledBackward`) carry their own wrappers with compiled backward
passes. The two here:

* :class:`InvariantLinear`: the padded forward would make autograd save padded copies; its backward is
  the two textbook matmuls ``dx = g @ W`` and ``dW = g.T @ x`` (fixed shapes, deterministic on CPU).
* :func:`recompute_backward`: for attention, whose tiled forward works in place on reused buffers and
  masks with finite stand-ins for ``-inf`` (not differentiable as written). The backward recomputes the
  reference math (:func:`~rlfw.kernels.attention.attention_reference`) under autograd, like activation
  checkpointing, and differentiates that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlfw.kernels import matmul, threads

LinearFn = Callable[[Tensor, Tensor], Tensor]


class InvariantLinear(torch.autograd.Function):
    """``forward_fn(x, weight)`` forward; ``x [..., K] @ weight[N, K].T`` gradients."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, forward_fn: LinearFn) -> Tensor:
        ctx.save_for_backward(x, weight)
        return forward_fn(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        rows = x.reshape(-1, x.shape[-1])
        dx = dw = None
        if g.device.type == "cpu" and threads.lending():  # cores lent at any moment: the compiled
            # kernel, whose bits do not depend on the thread count
            if ctx.needs_input_grad[0]:
                dx = _as(matmul.grad_input(g, weight).reshape(x.shape), x.dtype)
            if ctx.needs_input_grad[1]:
                dw = _as(matmul.grad_weight(g, rows), weight.dtype)
            return dx, dw, None
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(_as(g, weight.dtype), weight).reshape(x.shape)
            dx = _as(dx, x.dtype)
        if ctx.needs_input_grad[1]:
            dw = _as(torch.matmul(_as(g.t(), x.dtype), rows), weight.dtype)
        return dx, dw, None


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)`` without a dispatch when it is already ``dtype``."""
    return t if t.dtype == dtype else t.to(dtype)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, forward_fn: Callable[..., Tensor], reference_fn: Callable[..., Tensor], *args: Any
    ) -> Tensor:
        ctx.reference_fn = reference_fn
        ctx.args = [a.detach() if isinstance(a, Tensor) else a for a in args]
        ctx.save_for_backward(*[a for a in args if isinstance(a, Tensor)])
        return forward_fn(*args)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if isinstance(a, Tensor) else a for a in ctx.args]
        wants = [
            isinstance(a, Tensor) and need for a, need in zip(args, ctx.needs_input_grad[2:], strict=True)
        ]
        inputs = [
            a.detach().requires_grad_(w) if isinstance(a, Tensor) else a
            for a, w in zip(args, wants, strict=True)
        ]
        with torch.enable_grad():
            out = ctx.reference_fn(*inputs)
        targets = [a for a, w in zip(inputs, wants, strict=True) if w]
        grads = iter(torch.autograd.grad(out, targets, grad) if targets else ())
        return (None, None, *[next(grads) if w else None for w in wants])


def needs_grad(*args: Any) -> bool:
    """Whether a call on ``args`` is recorded by autograd: grad mode on and a tensor among them requiring
    grad (non-tensor arguments are ignored)."""
    return torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)


def recompute_backward(
    forward_fn: Callable[..., Tensor], reference_fn: Callable[..., Tensor], *args: Any
) -> Tensor:
    """``forward_fn(*args)``, differentiated as ``reference_fn(*args)`` (recomputed in backward).

    Without grad mode (scoring, engine) this is a plain call, so the wrapper cannot change any bits.
    """
    if not needs_grad(*args):
        return forward_fn(*args)
    out: Tensor = _Recompute.apply(forward_fn, reference_fn, *args)
    return out

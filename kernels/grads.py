"""Training wrappers with closed-form backward passes, for the GPU op sets (Triton and vLLM kernels) and the
CPU log-softmax (whose forward is a compiled kernel, :mod:`rlfw.kernels.softmax`).

The forward is the inference kernel itself (so a trainer's grad forward keeps its bits); the backward is the
textbook gradient in fp32 torch ops, written out rather than obtained by recomputing the reference forward
under autograd (:func:`~rlfw.kernels.autograd.recompute_backward`). On a GPU a step of a small model is
bound by the host's launches: the recomputed reference costs a nested autograd pass per call, and a
profile of the invariant 13M train step on an H200 put about half of the host's time there
(``bench/RESULTS.md``). Gradients equal the reference's to rounding; they carry no bitwise claim.

* :func:`rms_norm`: ``y = w * (x * r)``, ``r = 1 / sqrt(mean(x^2) + eps)``;
  ``dx = r * (gn - n * mean(gn * n))`` with ``n = x * r``, ``gn = g * w``; ``dw = sum(g * n)``.
* :func:`log_softmax`: ``dlogits = g - softmax * sum(g)``; :func:`token_logp` (the gather at ``ids``):
  ``dlogits = onehot(ids) * g - softmax * g``.
* :func:`attention`: the masked-softmax attention of
  :func:`~rlfw.kernels.attention.attention_reference`, its probabilities recomputed in fp32 and
  differentiated by hand (``dv = p^T go``, ``ds = p * (go v^T - rowsum(.. * p))``, ``dq = ds k``,
  ``dk = ds^T q``, times the scale).

RMSNorm and attention take the gradient function as an argument: the torch spelling here
(:func:`rms_norm_grads`, :func:`attention_grads`), or a Triton kernel of the same math that the GPU op
sets pass (:mod:`rlfw.kernels.triton_norm`, :mod:`rlfw.kernels.triton_attention`: one launch per norm
instead of about 17 torch ops, two per attention instead of about 35, and the attention's
probabilities never held whole).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlfw.kernels.attention import group_queries, reference_probabilities, ungroup
from rlfw.kernels.autograd import needs_grad

NormFn = Callable[[Tensor, Tensor, float], Tensor]
LogSoftmaxFn = Callable[[Tensor], Tensor]
TokenLogpFn = Callable[[Tensor, Tensor], Tensor]
AttentionFn = Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]


def _sum_to(t: Tensor, shape: torch.Size) -> Tensor:
    """``t`` summed over its leading dims down to ``shape`` (a broadcast weight's gradient)."""
    return t.reshape(-1, *shape).sum(0)


def rms_norm_grads(x: Tensor, weight: Tensor, grad: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)`` of ``weight * (x * r)`` for the output gradient ``grad``, in fp32 torch ops."""
    xf = x.float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    n = xf * r
    g = grad.float()
    gn = g * weight.float()
    dx = (r * (gn - n * (gn * n).mean(-1, keepdim=True))).to(x.dtype)
    return dx, _sum_to(g * n, weight.shape).to(weight.dtype)


NormGradsFn = Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, eps: float, forward_fn: NormFn, grads_fn: NormGradsFn
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        ctx.grads_fn = grads_fn
        return forward_fn(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        dx, dw = ctx.grads_fn(x, weight, grad, ctx.eps)
        return (
            dx if ctx.needs_input_grad[0] else None,
            dw if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
        )


def rms_norm(
    forward_fn: NormFn, x: Tensor, weight: Tensor, eps: float, grads_fn: NormGradsFn = rms_norm_grads
) -> Tensor:
    """``forward_fn(x, weight, eps)``, with the closed-form RMSNorm gradient under autograd: ``grads_fn``
    (:func:`rms_norm_grads`, or a fused kernel of the same math such as
    :func:`~rlfw.kernels.triton_norm.rms_norm_backward`)."""
    if not needs_grad(x, weight):
        return forward_fn(x, weight, eps)
    out: Tensor = _RMSNorm.apply(x, weight, eps, forward_fn, grads_fn)
    return out


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, forward_fn: LogSoftmaxFn) -> Tensor:
        out = forward_fn(logits)
        ctx.save_for_backward(out)
        ctx.dtype = logits.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (out,) = ctx.saved_tensors
        g = grad.float()
        return (g - out.exp() * g.sum(-1, keepdim=True)).to(ctx.dtype), None


def log_softmax(forward_fn: LogSoftmaxFn, logits: Tensor) -> Tensor:
    """``forward_fn(logits)`` (fp32 log-softmax), with the closed-form gradient under autograd."""
    if not needs_grad(logits):
        return forward_fn(logits)
    out: Tensor = _LogSoftmax.apply(logits, forward_fn)
    return out


class _TokenLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, ids: Tensor, forward_fn: TokenLogpFn) -> Tensor:
        ctx.save_for_backward(logits, ids)
        return forward_fn(logits, ids)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        logits, ids = ctx.saved_tensors
        g = grad.float().unsqueeze(-1)
        d = torch.softmax(logits.float(), dim=-1).mul_(-g)
        d.scatter_add_(-1, ids.unsqueeze(-1), g)
        return d.to(logits.dtype), None, None


def token_logp(forward_fn: TokenLogpFn, logits: Tensor, ids: Tensor) -> Tensor:
    """``forward_fn(logits, ids)`` (fp32 log-prob of ``ids``), with the closed-form gradient."""
    if not needs_grad(logits):
        return forward_fn(logits, ids)
    out: Tensor = _TokenLogp.apply(logits, ids, forward_fn)
    return out


def attention_grads(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, grad: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`~rlfw.kernels.attention.attention_reference` for the output gradient
    ``grad``, in fp32 torch ops (the probabilities ``[B, Hkv, R, S]`` held whole)."""
    t, hkv = q.shape[1], k.shape[2]
    qg, pos, p = reference_probabilities(q, k, q_pos, scale)  # [B, Hkv, R, D], [B, Hkv, R], [.., S]
    kf = k.float().transpose(1, 2)  # [B, Hkv, S, D]
    vf = v.float().transpose(1, 2)
    go = group_queries(grad, hkv).masked_fill((pos < 0)[..., None], 0.0)  # padding rows: zeroed out
    dv = torch.matmul(p.transpose(-1, -2), go).transpose(1, 2).to(v.dtype)
    dp = torch.matmul(go, vf.transpose(-1, -2))
    ds = p.mul_(dp - (dp * p).sum(-1, keepdim=True)).mul_(scale)
    dq = ungroup(torch.matmul(ds, kf), t).to(q.dtype)
    dk = torch.matmul(ds.transpose(-1, -2), qg).transpose(1, 2).to(k.dtype)
    return dq, dk, dv


AttentionGradsFn = Callable[[Tensor, Tensor, Tensor, Tensor, float, Tensor], tuple[Tensor, Tensor, Tensor]]


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_pos: Tensor,
        scale: float,
        forward_fn: AttentionFn,
        grads_fn: AttentionGradsFn,
    ) -> Tensor:
        ctx.save_for_backward(q, k, v, q_pos)
        ctx.scale = scale
        ctx.grads_fn = grads_fn
        return forward_fn(q, k, v, q_pos, scale)

    @staticmethod
    def backward(
        ctx: Any, grad: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None, None, None]:
        q, k, v, q_pos = ctx.saved_tensors
        dq, dk, dv = ctx.grads_fn(q, k, v, q_pos, ctx.scale, grad)
        need = ctx.needs_input_grad
        return (
            dq if need[0] else None,
            dk if need[1] else None,
            dv if need[2] else None,
            None,
            None,
            None,
            None,
        )


def attention(
    forward_fn: AttentionFn,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    scale: float,
    grads_fn: AttentionGradsFn = attention_grads,
) -> Tensor:
    """``forward_fn(q, k, v, q_pos, scale)`` (causal attention over the batch's own K/V, see
    :meth:`~rlfw.kernels.registry.Ops.attention`), with the closed-form gradient under autograd:
    ``grads_fn`` (:func:`attention_grads`, or the Triton kernels of the same math,
    :func:`~rlfw.kernels.triton_attention.attention_backward`)."""
    if not needs_grad(q, k, v):
        return forward_fn(q, k, v, q_pos, scale)
    out: Tensor = _Attention.apply(q, k, v, q_pos, scale, forward_fn, grads_fn)
    return out

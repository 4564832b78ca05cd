"""Plain torch ops: fast, but a row's result may depend on the batch around it.

This is ``kernels=default``. It is the reference the invariant kernels are compared against and what
users measure the mismatch of.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rlfw.kernels.attention import take_rows


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DefaultOps:
    name = "default"

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return F.linear(x, weight)

    def prepare_weights(self, weights: Iterable[Tensor], refresh: bool = False) -> None:
        """Nothing to prepare: BLAS packs per call."""

    def held_weights(self, weights: Iterable[Tensor]) -> AbstractContextManager[None]:
        """Nothing to keep: BLAS packs per call."""
        return nullcontext()

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        xf = x.float()
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        return (xf * cos + rotate_half(xf) * sin).to(x.dtype)

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up

    def attention(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        q_pos: Tensor,
        scale: float,
        rows: Tensor | None = None,
    ) -> Tensor:
        k_cache, v_cache = take_rows(k_cache, v_cache, rows, q_pos)
        _, _, hq, _ = q.shape
        hkv = k_cache.shape[2]
        slots = torch.arange(k_cache.shape[1], device=q.device)
        visible = slots[None, None, :] <= q_pos[:, :, None]  # [B, T, S]
        # Padding queries see slot 0 only, so softmax stays finite; their output is zeroed below.
        visible = visible | (q_pos[:, :, None] < 0) & (slots[None, None, :] == 0)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k_cache.transpose(1, 2),
            v_cache.transpose(1, 2),
            attn_mask=visible[:, None, :, :],
            scale=scale,
            enable_gqa=hq != hkv,
        ).transpose(1, 2)
        return out.masked_fill((q_pos < 0)[:, :, None, None], 0.0)

    def log_softmax(self, logits: Tensor) -> Tensor:
        return torch.log_softmax(logits.float(), dim=-1)

    def token_logp(self, logits: Tensor, ids: Tensor) -> Tensor:
        return self.log_softmax(logits).gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    def entropy(self, logits: Tensor) -> Tensor:
        logp = self.log_softmax(logits)
        return -(logp.exp() * logp).sum(-1)

    def cached_block(self, *_: Any) -> Tensor | None:
        """No fused block: the model runs the ops one by one."""
        return None

    def router_topk(self, logits: Tensor, k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids

    def router_weights(self, logits: Tensor, ids: Tensor, norm_topk_prob: bool) -> Tensor:
        weights = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
        if norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights

    def describe(self) -> dict[str, Any]:
        """The bit-relevant choices of this op set (see :mod:`rlfw.kernels.describe`)."""
        from rlfw.kernels.describe import describe_default

        return describe_default()

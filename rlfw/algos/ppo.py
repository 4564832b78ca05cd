"""The PPO clipped surrogate, per token."""

from __future__ import annotations

import torch
from torch import Tensor

from rlfw.algos.weights import ppo_active


def ppo_surrogate(
    log_ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token PPO loss max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A), with r = exp(log_ratio).

    With `dual_clip` = c, negative-advantage tokens are further bounded by -c A (Ye et al., 2020), so a
    huge ratio on a bad token cannot dominate the batch.

    log_ratio: [B, T] log(q / old), with grad through q; adv: [B, T].
    Returns (loss [B, T], clipped [B, T] bool: where the clip removed the token's gradient).
    """
    ratio = torch.exp(log_ratio)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    clipped = ~ppo_active(ratio.detach(), adv, eps_low, eps_high, dual_clip)
    return loss, clipped

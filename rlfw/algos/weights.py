"""Per-token weight rules shared by the corrections: truncation, masking and the PPO clip region.

Each is a function of ratios (not log ratios) and is used without gradient: the corrections multiply a
detached weight into the score term, so the gradient is `weight * A * grad log q`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def truncate(ratio: Tensor, cap: float) -> Tensor:
    """TIS weight min(ratio, cap); any shape."""
    return ratio.clamp(max=cap)


def in_window(ratio: Tensor, lo: float, hi: float) -> Tensor:
    """Boolean: lo <= ratio <= hi; any shape."""
    return (ratio >= lo) & (ratio <= hi)


def sequence_in_window(log_ratio: Tensor, mask: Tensor, lo: float, hi: float) -> Tensor:
    """Boolean [B, T]: whether the geometric-mean ratio of each sequence lies in [lo, hi], broadcast to
    its tokens. The geometric mean is exp(mean of log ratio over the sequence's masked tokens); a sequence
    with no masked token counts as kept (it contributes nothing either way).

    log_ratio, mask: [B, T].
    """
    m = mask.bool()
    total = torch.where(m, log_ratio, torch.zeros_like(log_ratio)).sum(-1)
    count = m.sum(-1).clamp(min=1).to(log_ratio.dtype)
    geo = torch.exp(total / count)
    keep = in_window(geo, lo, hi) | ~m.any(-1)
    return keep.unsqueeze(-1).expand_as(m)


def ppo_active(
    ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> Tensor:
    """Boolean: where the PPO surrogate still has gradient (the clip has not taken over).

    The clipped objective min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) is flat in r where A > 0 and
    r > 1 + eps_high, or A < 0 and r < 1 - eps_low; the dual clip max(., c A) for A < 0 also flattens
    r > c. ratio and adv broadcast together.
    """
    pos = (adv > 0) & (ratio <= 1 + eps_high)
    neg = (adv < 0) & (ratio >= 1 - eps_low)
    if dual_clip is not None:
        neg = neg & (ratio <= dual_clip)
    return pos | neg | (adv == 0)


def ppo_weight(
    ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> Tensor:
    """Score-function weight of the PPO surrogate: d/dlogq of its value is A * ratio * active, so the
    surrogate's gradient equals that of -sg(ratio * active) * A * log q. ratio and adv broadcast."""
    active = ppo_active(ratio, adv, eps_low, eps_high, dual_clip)
    return torch.where(active, ratio, torch.zeros_like(ratio))


def masked_weight(ratio: Tensor, keep: Tensor) -> Tensor:
    """MIS weight: the ratio where `keep`, else 0 (a dropped token, even one whose ratio overflowed to inf,
    contributes exactly 0). ratio and keep broadcast."""
    return torch.where(keep, ratio, torch.zeros_like(ratio))

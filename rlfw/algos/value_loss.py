"""The clipped value loss of PPO (the value head itself belongs to the model)."""

from __future__ import annotations

import torch
from torch import Tensor


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    num_tokens: float | int | Tensor,
    clip_eps: float | None = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """0.5 max((V - R)^2, (V_clip - R)^2) summed over masked tokens and divided by `num_tokens`.

    V_clip = old_V + clamp(V - old_V, -clip_eps, clip_eps) keeps the value update in a trust region like
    the policy's; taking the max makes the clip pessimistic (it can only raise the loss). clip_eps=None
    gives the plain squared error. values: [B, T] with grad; old_values, returns, mask: [B, T] constants.
    num_tokens is the global count, as for the policy loss. Metrics: `loss/value`, `value/clip_frac`.
    """
    m = mask.bool()
    old_values, returns = old_values.detach(), returns.detach()
    err = (values - returns) ** 2
    if clip_eps is None:
        per_token, clipped = err, torch.zeros_like(m)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        err_clip = (v_clip - returns) ** 2
        per_token, clipped = torch.maximum(err, err_clip), err_clip.detach() > err.detach()
    loss = 0.5 * torch.where(m, per_token, torch.zeros_like(per_token)).sum() / num_tokens
    clip_frac = (clipped & m).sum().float() / m.sum().clamp(min=1).float()
    return loss, {"loss/value": loss.detach(), "value/clip_frac": clip_frac}

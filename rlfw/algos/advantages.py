"""Advantage estimators: group-relative baselines (GRPO, leave-one-out) and GAE for PPO."""

from __future__ import annotations

import torch
from torch import Tensor

GROUP_BASELINES: tuple[str, ...] = ("mean", "leave_one_out")


def group_advantages(
    rewards: Tensor, baseline: str = "mean", scale_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-sequence advantages from rewards [num_groups, G] of G samples per prompt; returns [num_groups, G].

    - baseline `mean` (GRPO): A_i = r_i - mean(r);
    - baseline `leave_one_out` (RLOO): A_i = r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean(r)), a
      baseline independent of the sample it scores, so the estimator stays unbiased.
    With `scale_by_std` the result is divided by (std + eps), std the group's unbiased (G - 1) standard
    deviation as in common GRPO code; without it (Dr. GRPO) prompts are not re-weighted by their spread.
    A group whose rewards are all equal gets advantage 0 either way.
    """
    if baseline not in GROUP_BASELINES:
        raise ValueError(f"baseline={baseline!r} is not valid; allowed: {' | '.join(GROUP_BASELINES)}")
    g = rewards.shape[-1]
    if g < 2 and (scale_by_std or baseline == "leave_one_out"):
        raise ValueError(f"group size G={g}: std scaling and leave-one-out need G >= 2")
    centred = rewards - rewards.mean(-1, keepdim=True)
    adv = centred * (g / (g - 1)) if baseline == "leave_one_out" else centred
    if scale_by_std:
        adv = adv / (rewards.std(-1, keepdim=True) + eps)
    return adv


def to_tokens(seq_values: Tensor, mask: Tensor) -> Tensor:
    """Broadcast one value per sequence [B] to its tokens [B, T]; 0 outside `mask` [B, T]."""
    return torch.where(mask.bool(), seq_values.unsqueeze(-1), torch.zeros((), dtype=seq_values.dtype))


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over each sequence's masked tokens; returns (advantages, returns).

    rewards, values, mask: [B, T]; outputs [B, T], 0 outside the mask. Masked-out positions are skipped,
    not treated as steps: the value and the running GAE carry across them unchanged, so padding at the
    end and interleaved non-trainable tokens (tool outputs in a multi-turn response) both work. The last
    masked token is terminal (bootstrap value 0), so its reward (e.g. the sequence reward) enters there.
        delta_t = r_t + gamma V_next - V_t,   A_t = delta_t + gamma lam A_next,   R_t = A_t + V_t.
    Values are read as constants (detached).
    """
    m = mask.bool()
    values = values.detach()
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_value = torch.where(m[:, t], values[:, t], next_value)
        next_adv = torch.where(m[:, t], adv_t, next_adv)
        advantages[:, t] = torch.where(m[:, t], adv_t, torch.zeros_like(adv_t))
    returns = torch.where(m, advantages + values, torch.zeros_like(values))
    return advantages, returns

"""From rewarded samples to per-sample advantages (GRPO groups), dropping samples whose reward failed."""

from __future__ import annotations

from collections import defaultdict

import torch

from rlfw.algos import group_advantages
from rlfw.types import Sample


def grpo_advantages(
    samples: list[Sample], std_scaling: bool, leave_one_out: bool
) -> tuple[list[Sample], list[float]]:
    """Keep samples with a reward; normalise rewards within each prompt's group.

    A group left with a single sample (the others' rewards failed) has no baseline and is dropped too.
    """
    groups: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        if s.reward is not None:
            groups[s.prompt_id].append(s)
    kept: list[Sample] = []
    advantages: list[float] = []
    for members in groups.values():
        if len(members) < 2:
            continue
        rewards = torch.tensor([[s.reward for s in members if s.reward is not None]])
        adv = group_advantages(rewards, "leave_one_out" if leave_one_out else "mean", std_scaling)
        kept += members
        advantages += adv[0].tolist()
    return kept, advantages

"""From rewarded samples to the :class:`~rlfw.types.TrainBatch` the trainer ranks receive (its docstring
gives the layout): GRPO groups normalised on the driver, or PPO's token rewards for the trainer's critic."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from rlfw.algos import group_advantages
from rlfw.types import Sample, TrainBatch


def make_batch(samples: list[Sample], algo: str, std_scaling: bool, leave_one_out: bool) -> TrainBatch:
    """GRPO (``algo="grpo"``) normalises rewards within each prompt's group; PPO hands the rewards to the
    trainer's critic. Samples whose reward failed are left out either way."""
    if algo == "ppo":
        kept = [s for s in samples if s.reward is not None]
        return collate(kept, [0.0] * len(kept), token_rewards=True)
    kept, advantages = grpo_advantages(samples, std_scaling, leave_one_out)
    return collate(kept, advantages)


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


def collate(samples: list[Sample], advantages: list[float], token_rewards: bool = False) -> TrainBatch:
    """Pad samples into a :class:`TrainBatch`; ``advantages[i]`` is broadcast over sample ``i``'s tokens.

    With ``token_rewards`` (PPO) each sample's reward is also placed at its last response token, for the
    trainer's GAE.
    """
    width = max((s.tokens.shape[0] for s in samples), default=1)
    b, k = len(samples), samples[0].topk_ids.shape[1] if samples else 0
    tokens = torch.zeros(b, width, dtype=torch.long)
    attention = torch.zeros_like(tokens)
    per_token = {name: torch.zeros(b, width - 1) for name in ("sampler_logp", "decode_logp", "prefill_logp")}
    adv = torch.zeros(b, width - 1)
    version = torch.zeros(b, width - 1, dtype=torch.long)
    mask = torch.zeros(b, width - 1, dtype=torch.bool)
    topk_ids = torch.zeros(b, width - 1, k, dtype=torch.long)
    topk_logp = torch.full((b, width - 1, k), float("-inf"))
    routed = _routed(samples, width)
    for i, s in enumerate(samples):
        n, p = s.tokens.shape[0], s.prompt_P.shape[0]
        span = slice(p - 1, n - 1)
        tokens[i, :n], attention[i, :n], mask[i, span] = s.tokens, 1, True
        for name, t in per_token.items():
            t[i, span] = getattr(s, name)
        adv[i, span], version[i, span] = advantages[i], s.version_T
        topk_ids[i, span], topk_logp[i, span] = s.topk_ids, s.topk_logp
        if routed is not None and s.routed_experts is not None:
            routed[i, :n] = s.routed_experts
    return TrainBatch(
        tokens,
        attention,
        mask,
        advantages=adv,
        version=version,
        topk_ids=topk_ids,
        topk_logp=topk_logp,
        routed_experts=routed,
        rewards=_terminal_rewards(samples, width) if token_rewards else None,
        prefilled=_prefilled(samples, mask),
        decode_topk_logp=_head(samples, "decode_topk_logp", width, k),
        prefill_topk_logp=_head(samples, "prefill_topk_logp", width, k),
        **per_token,
    )


def _head(samples: list[Sample], name: str, width: int, k: int) -> Tensor | None:
    """``[B, L-1, K]`` an engine stream at the sampler's top-k ids (-inf off the response), or None when
    some sample lacks it (an engine that does not record it)."""
    if not samples or any(getattr(s, name) is None for s in samples):
        return None
    head = torch.full((len(samples), width - 1, k), float("-inf"))
    for i, s in enumerate(samples):
        p, n = s.prompt_P.shape[0], s.tokens.shape[0]
        head[i, p - 1 : n - 1] = getattr(s, name)
    return head


def _prefilled(samples: list[Sample], mask: Tensor) -> Tensor | None:
    """``[B, L-1]`` True on response tokens whose sequence has a prefill value; None when all have one."""
    if all(s.prefilled for s in samples):
        return None
    rows = torch.tensor([s.prefilled for s in samples], dtype=torch.bool)
    return mask & rows[:, None]


def _terminal_rewards(samples: list[Sample], width: int) -> Tensor:
    rewards = torch.zeros(len(samples), width - 1)
    for i, s in enumerate(samples):
        rewards[i, s.tokens.shape[0] - 2] = float(s.reward or 0.0)  # prediction index of the last token
    return rewards


def _routed(samples: list[Sample], width: int) -> Tensor | None:
    first = samples[0].routed_experts if samples else None
    if first is None:
        return None
    return torch.zeros(len(samples), width, *first.shape[1:], dtype=torch.long)

"""Collate rollout samples into a :class:`~rlfw.types.TrainBatch` (its docstring gives the layout)."""

from __future__ import annotations

import torch
from torch import Tensor

from rlfw.types import Sample, TrainBatch


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
        **per_token,
    )


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


def micro_batches(batch: TrainBatch, size: int) -> list[TrainBatch]:
    return [batch.rows(slice(i, i + size)) for i in range(0, len(batch), size)]

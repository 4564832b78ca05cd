"""MoE router: fp32 softmax, top-k with a declared tie rule, and gate weights for replay (R3).

Tie rule: experts are ranked by their fp32 probability, and among equal probabilities the lowest expert
index wins. ``torch.topk`` makes no such promise, so the ranking is a *stable* descending sort: a stable
sort keeps equal keys in their original (ascending index) order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfw.kernels.reduce import row_sum
from rlfw.kernels.softmax import softmax

TIE_RULE = "lowest_index"


def _gate(probs: Tensor, ids: Tensor, norm_topk_prob: bool) -> Tensor:
    weights = probs.gather(-1, ids)
    if norm_topk_prob:
        weights = weights / row_sum(weights).unsqueeze(-1)
    return weights


def router_topk(logits: Tensor, k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """``logits [N, E] -> (weights [N, k] fp32, ids [N, k] int64)``, ids in descending weight order."""
    probs = softmax(logits)
    ids = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[..., :k]
    return _gate(probs, ids, norm_topk_prob), ids


def router_weights(logits: Tensor, ids: Tensor, norm_topk_prob: bool) -> Tensor:
    """Gate weights of the given experts ``ids [N, k]``; the same bits :func:`router_topk` gives them."""
    return _gate(softmax(logits), ids, norm_topk_prob)

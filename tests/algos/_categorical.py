"""A one-step categorical policy over a small vocabulary, for exact expectations by enumeration.

The expected gradient of a correction's loss under the sampler is sum_a mu_a grad loss(a), computed by
building one single-token batch per action a; no sampling is involved, so equalities hold to rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfw.algos import CorrectionConfig, LossInputs, policy_loss

F64 = torch.float64
LOGITS = torch.tensor([0.3, -0.2, 1.0, 0.0, -0.7], dtype=F64)
ADV = torch.tensor([1.0, -0.5, 0.3, 2.0, -1.5], dtype=F64)
# A large numerical discrepancy: ratios p / mu ~ [0.46, 3.0, 1.4, 0.92, 6.1] (TIS, MIS and IcePop all act).
WIDE = torch.tensor([1.1, -0.8, 0.0, 0.4, -1.5], dtype=F64)
# A mild one: every ratio p / mu inside [0.8, 1.6], so neither the TIS cap nor the MIS window acts.
MILD = torch.tensor([0.2, -0.3, 0.1, 0.25, -0.35], dtype=F64)


def score(logits: Tensor) -> Tensor:
    """[V, V] closed-form scores: row a is grad_z log softmax(z)_a = onehot(a) - p."""
    p = logits.softmax(0)
    return torch.eye(len(p), dtype=F64) - p


def true_loss_grad(logits: Tensor, adv: Tensor) -> Tensor:
    """-grad_z E_{a~p}[A_a] = -sum_a p_a A_a (onehot(a) - p): the on-policy gradient of the loss."""
    return -(logits.softmax(0) * adv) @ score(logits)


def action_batch(
    z: Tensor, sampler_logits: Tensor, a: int, adv: Tensor, k: int, old_logits: Tensor | None
) -> LossInputs:
    """Single-token batch for action a: trainer = prefill = decode = log softmax(z), sampler = log softmax of
    `sampler_logits`; the head is the sampler's top-k; the PPO reference (the generating weights) is the
    distribution log softmax(old_logits), or the trainer itself (no lag) when it is None."""
    logp, logmu = z.log_softmax(0), sampler_logits.log_softmax(0)
    logold = logp.detach() if old_logits is None else old_logits.log_softmax(0)
    ids = logmu.topk(k).indices

    def cell(x: Tensor) -> Tensor:
        return x.reshape(1, 1)

    return LossInputs(
        trainer_logp=cell(logp[a]),
        sampler_logp=cell(logmu[a]),
        decode_logp=cell(logp[a].detach()),
        prefill_logp=cell(logp[a].detach()),
        old_logp=cell(logold[a]),
        advantages=cell(adv[a]),
        mask=torch.ones(1, 1, dtype=torch.bool),
        num_tokens=1,
        sampler_topk_ids=ids.reshape(1, 1, k),
        sampler_topk_logp=logmu[ids].reshape(1, 1, k),
        trainer_topk_logp=logp[ids].reshape(1, 1, k),
        reference_topk_logp=logold[ids].reshape(1, 1, k),
    )


def per_action_grads(
    cfg: CorrectionConfig,
    logits: Tensor,
    sampler_logits: Tensor,
    adv: Tensor,
    k: int | None = None,
    old_logits: Tensor | None = None,
) -> Tensor:
    """[V, V]: row a is grad_z of the loss when the sampler drew action a."""
    rows = []
    for a in range(len(logits)):
        z = logits.clone().requires_grad_()
        loss, _ = policy_loss(action_batch(z, sampler_logits, a, adv, k or len(logits), old_logits), cfg)
        (g,) = torch.autograd.grad(loss, z)
        rows.append(g)
    return torch.stack(rows)


def expected_grad(
    cfg: CorrectionConfig,
    logits: Tensor,
    sampler_logits: Tensor,
    adv: Tensor,
    k: int | None = None,
    old_logits: Tensor | None = None,
) -> Tensor:
    """E_{a~mu}[grad_z loss(a)], exactly."""
    mu = sampler_logits.softmax(0)
    return mu @ per_action_grads(cfg, logits, sampler_logits, adv, k, old_logits)

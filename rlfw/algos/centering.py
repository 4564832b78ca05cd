r"""Score centering over the sampler's top-k head with a tail model (Marek & Ryabinin, "Score Centering
Stabilizes Off-policy RL").

Derivation. A token a is drawn from the sampler mu; the trainer's policy is p (log p = q in the streams).
A weighted score-function estimator uses w_a A grad log p_a, with w = phi(p / mu) for a weight rule phi
(unit weights, truncated IS, masked IS, the PPO clip region). Under constant reward its expectation is
A E_mu[w grad log p], which is not 0 once phi differs from the exact ratio: the update drifts although no
action is better than another. Centering subtracts that expectation from every sample's score:

    g = A (w_a grad log p_a - c),   c = E_{v~mu}[w_v grad log p_v] = sum_v mu_v phi(p_v / mu_v) grad log p_v,

so E_mu[g] = Cov_mu(A, w grad log p) and a constant A gives exactly 0. As a loss with detached weights:

    loss = -sg(A) [ sg(w_a) log p_a - sum_v sg(mu_v w_v) log p_v ].

The sum runs over the whole vocabulary; the rollout keeps only the sampler's top-k head H. The tail
T = V \ H is modelled as proportional to the trainer: mu_v = alpha p_v on T, with
alpha = (1 - Q_H) / (1 - P_H) (Q_H, P_H the sampler's and trainer's head masses), so every tail token has
ratio p_v / mu_v = 1 / alpha and the tail sum collapses, using sum_T grad p_v = -grad P_H, to head terms:

    sum_T mu_v phi(1/alpha) grad log p_v = alpha phi(1/alpha) sum_T grad p_v
                                          = -alpha phi(1/alpha) sum_H p_v grad log p_v.

Hence c = sum_H [mu_v phi(p_v / mu_v) - alpha phi(1/alpha) p_v] grad log p_v, all coefficients detached.
Two checks follow. With untruncated IS (phi(r) = r) every coefficient is mu_v (p_v / mu_v) - p_v = 0, so
centering equals plain IS exactly, for any k. With H the full vocabulary the tail vanishes and c is the
exact expectation.

Numerics: tail masses are 1 - exp(logsumexp(head)) via expm1; a sampler tail mass within rounding of 0
(k ulps) counts as no tail; the trainer's tail mass is floored at one ulp so alpha stays finite.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

WeightRule = Callable[[Tensor, Tensor], Tensor]
"""phi(ratio, adv) -> weight, elementwise, ratio and adv broadcast together; applied without gradient."""


def unit_weight(ratio: Tensor, adv: Tensor) -> Tensor:
    """phi = 1: centre the plain score under the sampler."""
    return torch.ones_like(ratio)


def tail_mass(head_logp: Tensor) -> Tensor:
    """[B, T] probability mass outside a head given its log-probs [B, T, k] (-inf entries allowed)."""
    return (-torch.expm1(torch.logsumexp(head_logp, dim=-1))).clamp(min=0.0)


@torch.no_grad()
def _coefficients(trainer_head: Tensor, sampler_head: Tensor, adv: Tensor, phi: WeightRule) -> Tensor:
    eps = torch.finfo(trainer_head.dtype).eps
    p = torch.exp(trainer_head)
    mu = torch.exp(sampler_head)
    head = torch.where(mu > 0, mu * phi(p / mu, adv.unsqueeze(-1)), torch.zeros_like(mu))
    mu_tail = tail_mass(sampler_head)
    p_tail = tail_mass(trainer_head).clamp(min=eps)
    has_tail = mu_tail > eps * sampler_head.shape[-1]
    alpha = torch.where(has_tail, mu_tail / p_tail, torch.ones_like(mu_tail))
    tail = torch.where(has_tail, alpha * phi(1 / alpha, adv), torch.zeros_like(alpha))
    coef = head - tail.unsqueeze(-1) * p
    return torch.where(torch.isfinite(coef), coef, torch.zeros_like(coef))


def centering_term(
    trainer_head_logp: Tensor, sampler_head_logp: Tensor, adv: Tensor, phi: WeightRule
) -> Tensor:
    """The centering term sum_H sg(coef_v) log p_v per token ([B, T]), whose gradient is c above.

    trainer_head_logp: [B, T, k] trainer log-probs at the sampler's top-k ids, with grad;
    sampler_head_logp: [B, T, k] the sampler's log-probs of those ids; adv: [B, T].
    Head entries the trainer gives -inf (a replayed transform removed them) contribute nothing.
    """
    coef = _coefficients(trainer_head_logp.detach(), sampler_head_logp, adv, phi)
    finite = torch.isfinite(trainer_head_logp)
    logp = torch.where(finite, trainer_head_logp, torch.zeros_like(trainer_head_logp))
    return (coef * logp).sum(-1)

r"""The discrepancy-lag correction's centring term: centre the numerical discrepancy, clip the lag.

Setting. A token a is drawn from the sampler mu. The weights that generated it define the distribution
old (the PPO reference stream: the prefill or decode stream, or the trainer's scoring pass); the trainer's
current policy is q. The total ratio q / mu splits into the lag q / old (a real policy change) and the
numerical ratio old / mu (same weights, different arithmetic or precision).

Target. PPO clipping against the sampler's weights, as if the token had been drawn from old:

    G = E_{v~old}[ A w_v grad log q_v ],   w_v = ppo_weight(q_v / old_v, A)

(the score-function weight of the clipped surrogate: the lag ratio where the clip has not taken over,
else 0; see `rlfw.algos.weights.ppo_weight`).

Estimator. From a token a drawn from mu,

    g = A ( w_a grad log q_a - c ),   c = sum_v (mu_v - old_v) w_v grad log q_v,

with every coefficient detached. Its expectation under mu is

    E_mu[g] = A ( sum_v mu_v w_v grad log q_v - c ) = A sum_v old_v w_v grad log q_v = G

for a constant A (and per action for any A, as in score centering: c only removes the part of the
expectation that sampling from mu instead of old adds). The two limits the correction must meet:

* no numerical discrepancy (mu = old): c = 0, and g is `ppo_sampler`'s gradient token by token;
* no lag (q = old): every w is 1 (ratio 1 lies inside the clip), and sum_v old_v grad log q_v =
  sum_v grad q_v = 0, so c = sum_v mu_v grad log q_v: score centering with unit weights.

With lag and no discrepancy a constant advantage gives E_old[w grad log q], which is 0 while no token is
clipped (sum_v q_v grad log q_v = 0), exactly as for `ppo_sampler`. Scaling a centred score by the
sampled token's weight alone (unit weights inside c) would instead leave A E_old[grad log q] != 0.

Head and tail. The rollout records mu only on the sampler's top-k head H, and the trainer and the
reference are gathered at the same ids. The tail T = V \ H is modelled as proportional to the trainer:
mu_v = alpha q_v and old_v = beta q_v on T, with alpha = (1 - M_H) / (1 - Q_H) and
beta = (1 - O_H) / (1 - Q_H) (M_H, O_H, Q_H the head masses of mu, old and q). Every tail token then has
lag ratio 1 / beta and weight w_T = ppo_weight(1 / beta, A), and with sum_T grad q_v = -sum_H grad q_v:

    sum_T (mu_v - old_v) w_v grad log q_v = (alpha - beta) w_T sum_T grad q_v
                                          = -(alpha - beta) w_T sum_H q_v grad log q_v,

    c = sum_H [ (mu_v - old_v) w_v - (alpha - beta) w_T q_v ] grad log q_v.

Both limits survive the tail model: mu = old on the whole vocabulary gives alpha = beta and a zero head
coefficient; q = old gives beta = 1, w = 1 and the coefficient mu_v - alpha q_v of unit-weight centering
(`rlfw.algos.centering`). With H the whole vocabulary the tail vanishes and c is exact. Tail masses use
the same numerics as centering (a tail within rounding of 0 counts as none; the trainer's is floored).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfw.algos.centering import WeightRule, tail_mass


@torch.no_grad()
def _coefficients(
    trainer_head: Tensor, sampler_head: Tensor, reference_head: Tensor, adv: Tensor, phi: WeightRule
) -> Tensor:
    eps = torch.finfo(trainer_head.dtype).eps
    q, mu, old = torch.exp(trainer_head), torch.exp(sampler_head), torch.exp(reference_head)
    weight = phi(q / old, adv.unsqueeze(-1))
    head = torch.where((mu > 0) | (old > 0), (mu - old) * weight, torch.zeros_like(mu))
    q_tail = tail_mass(trainer_head).clamp(min=eps)
    threshold = eps * sampler_head.shape[-1]
    mu_tail, old_tail = tail_mass(sampler_head), tail_mass(reference_head)
    alpha = torch.where(mu_tail > threshold, mu_tail / q_tail, torch.zeros_like(mu_tail))
    beta = torch.where(old_tail > threshold, old_tail / q_tail, torch.zeros_like(old_tail))
    # A reference with no tail mass says nothing about the lag there: its tail terms carry weight 0.
    tail_weight = torch.where(beta > 0, phi(1 / beta.clamp(min=eps), adv), torch.zeros_like(beta))
    tail = torch.where(alpha != beta, (alpha - beta) * tail_weight, torch.zeros_like(alpha))
    coef = head - tail.unsqueeze(-1) * q
    return torch.where(torch.isfinite(coef), coef, torch.zeros_like(coef))


def lag_centering_term(
    trainer_head_logp: Tensor,
    sampler_head_logp: Tensor,
    reference_head_logp: Tensor,
    adv: Tensor,
    phi: WeightRule,
) -> Tensor:
    """The centring term sum_H sg(coef_v) log q_v per token ([B, T]), whose gradient is c above.

    trainer_head_logp: [B, T, k] trainer log-probs at the sampler's top-k ids, with grad;
    sampler_head_logp / reference_head_logp: [B, T, k] the sampler's and the PPO reference's log-probs of
    those ids; adv: [B, T]; phi: the lag weight rule (the PPO clip region). Head entries the trainer gives
    -inf (a replayed transform removed them) contribute nothing.
    """
    coef = _coefficients(trainer_head_logp.detach(), sampler_head_logp, reference_head_logp, adv, phi)
    finite = torch.isfinite(trainer_head_logp)
    logq = torch.where(finite, trainer_head_logp, torch.zeros_like(trainer_head_logp))
    return (coef * logq).sum(-1)

"""The corrections of design §3, one small function each, in a registry keyed by `correction.name`.

Each maps a `CorrectionBatch` and the config to (per-token loss [B, T], metrics); its registry entry also
declares what it reads beyond the four streams (the trainer's log-probs at the sampler's top-k ids). The
per-token loss is only read on valid tokens; aggregation over tokens or sequences happens in
`policy_loss`. Weights are detached, so a token's gradient is (weight) * A * grad log q unless the
correction says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlfw.algos.batch import CorrectionBatch
from rlfw.algos.centering import WeightRule, centering_term, tail_mass, unit_weight
from rlfw.algos.config import CorrectionConfig
from rlfw.algos.dlc import lag_centering_term
from rlfw.algos.ppo import ppo_surrogate
from rlfw.algos.ratios import factor_name, select_log_ratio
from rlfw.algos.weights import in_window, masked_weight, ppo_active, ppo_weight, sequence_in_window, truncate

Metrics = dict[str, Tensor]
Correction = Callable[[CorrectionBatch, CorrectionConfig], tuple[Tensor, Metrics]]


def _frac(flag: Tensor, valid: Tensor) -> Tensor:
    """Fraction of valid tokens where `flag` holds (0 when there is none)."""
    return (flag & valid).sum().float() / valid.sum().clamp(min=1).float()


def _selected(batch: CorrectionBatch, cfg: CorrectionConfig) -> tuple[str, Tensor]:
    """Metric name and log ratio [B, T] of the factors this correction covers."""
    factors = cfg.selected_factors
    return factor_name(factors), select_log_ratio(batch.log_factors, factors)


def _mis_keep(log_ratio: Tensor, batch: CorrectionBatch, cfg: CorrectionConfig) -> Tensor:
    """[B, T] bool: tokens MIS keeps, judged per token or by the sequence's geometric-mean ratio."""
    lo, hi = cfg.mis_window
    if cfg.mis_level == "sequence":
        return sequence_in_window(log_ratio, batch.valid, lo, hi)
    return in_window(torch.exp(log_ratio), lo, hi)


def none(batch: CorrectionBatch, cfg: CorrectionConfig) -> tuple[Tensor, Metrics]:
    """Plain policy gradient: the ratio is assumed to be 1, loss = -A log q."""
    return -batch.adv * batch.logp, {}


def tis(batch: CorrectionBatch, cfg: CorrectionConfig) -> tuple[Tensor, Metrics]:
    """Token-level truncated IS: loss = -min(rho_f, C) A log q, rho_f the product of the chosen factors.
    Truncation trades the bias -E_mu[(rho - C)_+ A grad log q] for bounded variance."""
    name, log_ratio = _selected(batch, cfg)
    ratio = torch.exp(log_ratio)
    loss = -truncate(ratio, cfg.tis_cap) * batch.adv * batch.logp
    return loss, {f"ratio/{name}/clip_frac": _frac(ratio > cfg.tis_cap, batch.valid)}


def mis(batch: CorrectionBatch, cfg: CorrectionConfig) -> tuple[Tensor, Metrics]:
    """Masked IS: loss = -rho_f 1[kept] A log q. A token (or, at sequence level, a whole sequence by its
    geometric-mean ratio) outside the window is dropped rather than truncated, so the bias is exactly the
    dropped IS mass; kept tokens carry their own token ratio at either level."""
    name, log_ratio = _selected(batch, cfg)
    keep = _mis_keep(log_ratio, batch, cfg)
    loss = -masked_weight(torch.exp(log_ratio), keep) * batch.adv * batch.logp
    return loss, {f"ratio/{name}/mask_frac": _frac(~keep, batch.valid)}


def icepop(batch: CorrectionBatch, cfg: CorrectionConfig) -> tuple[Tensor, Metrics]:
    """IcePop: masked IS on the numerical ratio times the PPO surrogate on the lag ratio q / old. The
    numerical ratio is old / mu, reference over sampler (the total minus the lag), so the two parts
    split the total ratio whichever stream the PPO reference is: decode x sampler against the prefill
    stream, the sampler factor alone against the decode stream (in-flight updates), every factor against
    the trainer's scoring pass (an engine without a bitwise contract). `factors` set explicitly masks that
    product instead. A token whose masked ratio leaves [alpha, beta] is dropped; the rest keep their
    weight and the usual clip."""
    name, log_ratio = ("numerical", batch.log_numerical) if cfg.on_numerical else _selected(batch, cfg)
    lo, hi = cfg.icepop_bounds
    ratio = torch.exp(log_ratio)
    keep = in_window(ratio, lo, hi)
    surrogate, clipped = ppo_surrogate(batch.log_lag, batch.adv, cfg.clip_eps, cfg.clip_high, cfg.dual_clip)
    loss = masked_weight(ratio, keep) * surrogate
    metrics = {
        f"ratio/{name}/mask_frac": _frac(~keep, batch.valid),
        "ratio/lag/clip_frac": _frac(clipped, batch.valid),
    }
    return loss, metrics


def ppo_sampler(batch: CorrectionBatch, cfg: CorrectionConfig) -> tuple[Tensor, Metrics]:
    """PPO clip whose reference is the weights that generated each token (the prefill stream at the
    token's version), not the trainer before the batch: the trust region is then measured from the policy
    the data really came from, and the sampler-side factors are left uncorrected."""
    surrogate, clipped = ppo_surrogate(batch.log_lag, batch.adv, cfg.clip_eps, cfg.clip_high, cfg.dual_clip)
    return surrogate, {"ratio/lag/clip_frac": _frac(clipped, batch.valid)}


def _head(batch: CorrectionBatch, cfg: CorrectionConfig) -> tuple[Tensor, Tensor]:
    if batch.trainer_head is None or batch.sampler_head is None:
        raise ValueError(
            f"correction.name={cfg.name} needs LossInputs.trainer_topk_logp and LossInputs.sampler_topk_logp"
        )
    return batch.trainer_head, batch.sampler_head


def _head_metrics(trainer_head: Tensor, sampler_head: Tensor, valid: Tensor) -> Metrics:
    count = valid.sum().clamp(min=1)
    return {
        "centering/sampler_head_mass": (1 - tail_mass(sampler_head.detach()))[valid].sum() / count,
        "centering/trainer_head_mass": (1 - tail_mass(trainer_head.detach()))[valid].sum() / count,
    }


Combined = tuple[WeightRule, Tensor, Metrics]
"""What a rule combined with centering provides: the weight rule phi, a detached per-token scale [B, T]
(sequence-level MIS drops whole sequences) and its metrics."""


def _combine_none(batch: CorrectionBatch, cfg: CorrectionConfig, log_ratio: Tensor) -> Combined:
    return unit_weight, torch.ones_like(log_ratio), {}


def _combine_tis(batch: CorrectionBatch, cfg: CorrectionConfig, log_ratio: Tensor) -> Combined:
    def phi(r: Tensor, adv: Tensor) -> Tensor:
        return truncate(r, cfg.tis_cap)

    clipped = torch.exp(log_ratio) > cfg.tis_cap
    return phi, torch.ones_like(log_ratio), {"ratio/total/clip_frac": _frac(clipped, batch.valid)}


def _combine_mis(batch: CorrectionBatch, cfg: CorrectionConfig, log_ratio: Tensor) -> Combined:
    lo, hi = cfg.mis_window
    keep = _mis_keep(log_ratio, batch, cfg)
    metrics = {"ratio/total/mask_frac": _frac(~keep, batch.valid)}
    if cfg.mis_level == "sequence":
        return (lambda r, adv: r), keep.to(log_ratio.dtype), metrics

    def phi(r: Tensor, adv: Tensor) -> Tensor:
        return masked_weight(r, in_window(r, lo, hi))

    return phi, torch.ones_like(log_ratio), metrics


def _combine_ppo(batch: CorrectionBatch, cfg: CorrectionConfig, log_ratio: Tensor) -> Combined:
    def phi(r: Tensor, adv: Tensor) -> Tensor:
        return ppo_weight(r, adv, cfg.clip_eps, cfg.clip_high, cfg.dual_clip)

    clipped = ~ppo_active(torch.exp(log_ratio), batch.adv, cfg.clip_eps, cfg.clip_high, cfg.dual_clip)
    return phi, torch.ones_like(log_ratio), {"ratio/total/clip_frac": _frac(clipped, batch.valid)}


_COMBINE: dict[str, Callable[[CorrectionBatch, CorrectionConfig, Tensor], Combined]] = {
    "none": _combine_none,
    "tis": _combine_tis,
    "mis": _combine_mis,
    "ppo": _combine_ppo,
}


def centering(batch: CorrectionBatch, cfg: CorrectionConfig) -> tuple[Tensor, Metrics]:
    """Score centering under the sampler (see `rlfw.algos.centering` for the derivation):
    loss = -sg(A) [sg(w_a) log p_a - sum_H sg(coef_v) log p_v], w = phi(p / mu) from `combine_with`,
    p the trainer's probabilities (log p_a is `trainer_logp`, log p_v on the head `trainer_topk_logp`).
    The ratio is trainer vs sampler (the total), the only one known for every head token."""
    trainer_head, sampler_head = _head(batch, cfg)
    log_ratio = batch.log_factors["total"]
    phi, scale, metrics = _COMBINE[cfg.combine_with](batch, cfg, log_ratio)
    weight = phi(torch.exp(log_ratio), batch.adv) * scale
    term = centering_term(trainer_head, sampler_head, batch.adv, phi) * scale
    loss = -batch.adv * (weight * batch.logp - term)
    return loss, metrics | _head_metrics(trainer_head, sampler_head, batch.valid)


def dlc(batch: CorrectionBatch, cfg: CorrectionConfig) -> tuple[Tensor, Metrics]:
    """Discrepancy-lag correction: PPO-clip the lag against the sampler's weights, centre the numerical
    discrepancy (the derivation is in `rlfw.algos.dlc`):

        grad = A (w_a grad log q_a - sum_v (mu_v - old_v) w_v grad log q_v),  w = ppo_weight(q / old, A),

    whose expectation under the sampler mu is the PPO-clip gradient under the generating weights old:
    with no numerical discrepancy (mu = old) the centring term is 0 and this is `ppo_sampler`, token by
    token; with no lag (q = old) every w is 1 and this is score centering with unit weights.
    """
    trainer_head, sampler_head = _head(batch, cfg)
    if batch.reference_head is None:
        raise ValueError(
            "correction.name=dlc needs LossInputs.reference_topk_logp (the PPO reference at the sampler's "
            "top-k ids)"
        )
    lag = torch.exp(batch.log_lag.detach())
    weight = ppo_weight(lag, batch.adv, cfg.clip_eps, cfg.clip_high, cfg.dual_clip)

    def phi(r: Tensor, adv: Tensor) -> Tensor:
        return ppo_weight(r, adv, cfg.clip_eps, cfg.clip_high, cfg.dual_clip)

    term = lag_centering_term(trainer_head, sampler_head, batch.reference_head, batch.adv, phi)
    loss = -batch.adv * (weight * batch.logp - term)
    clipped = ~ppo_active(lag, batch.adv, cfg.clip_eps, cfg.clip_high, cfg.dual_clip)
    return loss, {"ratio/lag/clip_frac": _frac(clipped, batch.valid)} | _head_metrics(
        trainer_head, sampler_head, batch.valid
    )


@dataclass(frozen=True)
class CorrectionRule:
    """A registry entry: the loss function and what it needs from the trainer's forward."""

    loss: Correction
    needs_topk: bool = False
    """Reads `trainer_topk_logp` (the trainer's log-probs at the sampler's top-k ids): the score-centring
    corrections. The trainer gathers that head only when the correction asks for it."""
    needs_reference_head: bool = False
    """Also reads `reference_topk_logp` (the PPO reference at the sampler's top-k ids): dlc."""


CORRECTIONS: dict[str, CorrectionRule] = {
    "none": CorrectionRule(none),
    "tis": CorrectionRule(tis),
    "mis": CorrectionRule(mis),
    "icepop": CorrectionRule(icepop),
    "centering": CorrectionRule(centering, needs_topk=True),
    "ppo_sampler": CorrectionRule(ppo_sampler),
    "dlc": CorrectionRule(dlc, needs_topk=True, needs_reference_head=True),
}

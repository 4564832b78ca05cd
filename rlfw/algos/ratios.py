"""Ratio decomposition, effective sample size and the per-factor ratio metrics.

The importance ratio between the trainer (q) and the sampler (mu) is split, in log space and per token,
into factors that each name one source of mismatch (design §2):

    log q - log mu = (log q - log s^P)     trainer: trainer vs engine prefill (numerics and policy lag)
                   + (log s^P - log s^D)   decode:  prefill vs decode path (mid-sequence weight/KV staleness)
                   + (log s^D - log mu)    sampler: decode vs what the sampler recorded (precision)
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfw.algos.config import FACTORS

# The product of all three factors is the total. (The "numerical" ratio is not a fixed product of factors:
# it is reference / sampler, which spans different factors for different PPO references; see
# `CorrectionBatch.log_numerical`.)
_COMBINED_NAMES: dict[tuple[str, ...], str] = {FACTORS: "total"}


def decompose(
    trainer_logp: Tensor, prefill_logp: Tensor, decode_logp: Tensor, sampler_logp: Tensor
) -> dict[str, Tensor]:
    """Per-token log factors of the importance ratio; every input and output is [B, T].

    `total` is computed as trainer + decode + sampler (in that order) rather than q - mu, so the identity
    `total == trainer + decode + sampler` holds bit for bit; it equals q - mu up to rounding.
    Gradients flow through `trainer_logp` into the trainer factor and `total`.
    """
    trainer = trainer_logp - prefill_logp
    decode = prefill_logp - decode_logp
    sampler = decode_logp - sampler_logp
    return {"trainer": trainer, "decode": decode, "sampler": sampler, "total": trainer + decode + sampler}


def factor_name(factors: tuple[str, ...]) -> str:
    """Metric name of a product of factors given in canonical order: a factor's own name, `total` for all
    three, otherwise the names joined by `+`."""
    return _COMBINED_NAMES.get(factors, "+".join(factors))


def select_log_ratio(log_factors: dict[str, Tensor], factors: tuple[str, ...]) -> Tensor:
    """Log of the product of the chosen factors ([B, T]); all three returns `total` itself, so a
    correction over every factor sees exactly the decomposed total."""
    if factors == FACTORS:
        return log_factors["total"]
    out = log_factors[factors[0]]
    for name in factors[1:]:
        out = out + log_factors[name]
    return out


def _valid(w: Tensor, mask: Tensor | None) -> Tensor:
    return torch.ones_like(w, dtype=torch.bool) if mask is None else mask.bool()


def ess(w: Tensor, mask: Tensor | None = None) -> Tensor:
    """Normalised effective sample size (sum w)^2 / (N * sum w^2) over the unmasked entries, in (0, 1].

    w: non-negative weights of any shape; mask: same shape, nonzero = counted (None = all).
    Returns a 0-dim tensor; NaN when nothing is counted or all counted weights are 0 (undefined).
    Large log-weights overflow here; use `ess_from_log` for them.
    """
    valid = _valid(w, mask)
    w = torch.where(valid, w, torch.zeros_like(w))
    n = valid.sum().to(w.dtype)
    return w.sum() ** 2 / (n * (w * w).sum())


def ess_from_log(logw: Tensor, mask: Tensor | None = None) -> Tensor:
    """`ess` of exp(logw), stable for any range of log-weights: ESS/N is scale-free, so the largest
    unmasked log-weight is subtracted before exponentiating. logw: any shape; mask: same shape or None."""
    valid = _valid(logw, mask)
    if not bool(valid.any()):
        return torch.full((), float("nan"), dtype=logw.dtype, device=logw.device)
    shift = logw.detach()[valid].max()
    w = torch.exp(torch.where(valid, logw.detach() - shift, torch.full_like(logw, -torch.inf)))
    return ess(w, valid)


def sequence_ess(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """ESS/N over sequences: each sequence's weight is the product of its token ratios (the sum of its
    masked log ratios), so a small per-token spread compounds over a long sequence as it does for the
    sequence-level estimator. log_ratio, mask: [B, T]; rows with no masked token are not counted."""
    m = mask.bool()
    per_seq = torch.where(m, log_ratio.detach(), torch.zeros_like(log_ratio)).sum(-1)
    return ess_from_log(per_seq, m.any(-1))


def ratio_metrics(name: str, log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Metrics of one ratio over the masked tokens (design §6), all detached.

    log_ratio: [B, T] log ratio; mask: [B, T] (nonzero = counted).
    - `ratio/{name}/mean`: mean of the ratio exp(log r), not of log r: a mean of 1 is what an unbiased
      weight has under the sampler;
    - `ratio/{name}/max_abs_log`: the worst token's |log r|;
    - `ratio/{name}/k3_kl`: mean of (r - 1) - log r, the non-negative k3 estimator of KL(mu || q);
    - `ratio/{name}/hist`: the masked log ratios as a 1-D tensor, for a histogram.
    Scalars are NaN when no token is counted.
    """
    lr = log_ratio.detach()[mask.bool()]
    lr = lr.to(torch.promote_types(lr.dtype, torch.float32))
    prefix = f"ratio/{name}"
    if lr.numel() == 0:
        nan = torch.full((), float("nan"), dtype=lr.dtype, device=lr.device)
        return {
            f"{prefix}/mean": nan,
            f"{prefix}/max_abs_log": nan,
            f"{prefix}/k3_kl": nan,
            f"{prefix}/hist": lr,
        }
    return {
        f"{prefix}/mean": torch.exp(lr).mean(),
        f"{prefix}/max_abs_log": lr.abs().max(),
        f"{prefix}/k3_kl": (torch.expm1(lr) - lr).mean(),
        f"{prefix}/hist": lr,
    }

"""KL to a reference policy, estimated from the sampled tokens (Schulman's k1, k2, k3).

With ``r = ref_logp - logp`` per token (the log of reference over policy at the sampled token):

* ``k1 = -r``: unbiased for KL(policy || reference) under samples from the policy, high variance,
  can be negative;
* ``k2 = r^2 / 2``: biased, low variance, never negative;
* ``k3 = exp(r) - 1 - r``: unbiased and never negative (the default).

The loss adds ``algo.kl_coef`` times the token mean of the estimate; gradient flows through ``logp``.
"""

from __future__ import annotations

from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from ``logp`` and ``ref_logp`` (same shape)."""
    r = ref_logp - logp
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return 0.5 * r * r
    if estimator == "k3":
        return r.exp() - 1.0 - r
    raise ValueError(f"algo.kl_estimator={estimator!r}; allowed: {', '.join(KL_ESTIMATORS)}")

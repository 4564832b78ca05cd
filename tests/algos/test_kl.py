"""KL estimators against the closed form: over every token of a small vocabulary, weighted by the policy's
probabilities, k1 and k3 are exactly KL(policy || reference) and k2 is half the second moment of the log
ratio. If one breaks, ``algo.kl_coef`` regularises towards something other than the reference."""

from __future__ import annotations

import pytest
import torch

from rlfw.algos.kl import kl_estimate


def _pair(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.log_softmax(torch.randn(7, dtype=torch.float64, generator=g) * 2, -1)
    r = torch.log_softmax(torch.randn(7, dtype=torch.float64, generator=g), -1)
    return p, r


@pytest.mark.parametrize("seed", range(5))
def test_expectations_under_the_policy_match_the_closed_form(seed: int) -> None:
    logp, ref = _pair(seed)
    prob = logp.exp()
    kl = float((prob * (logp - ref)).sum())  # KL(policy || reference)
    assert kl > 0
    expect = {e: float((prob * kl_estimate(logp, ref, e)).sum()) for e in ("k1", "k2", "k3")}
    assert expect["k1"] == pytest.approx(kl, rel=1e-12)
    assert expect["k3"] == pytest.approx(kl, rel=1e-12)  # E[r] = 0 term vanishes: E[exp(r)] = 1
    assert expect["k2"] == pytest.approx(float((prob * 0.5 * (logp - ref) ** 2).sum()), rel=1e-12)


def test_k2_and_k3_are_never_negative_and_all_vanish_at_the_reference() -> None:
    logp, ref = _pair(9)
    assert (kl_estimate(logp, ref, "k2") >= 0).all() and (kl_estimate(logp, ref, "k3") >= 0).all()
    assert (kl_estimate(logp, ref, "k1") < 0).any()  # k1 can go negative token by token
    for e in ("k1", "k2", "k3"):
        assert torch.equal(kl_estimate(ref, ref, e), torch.zeros_like(ref))
    with pytest.raises(ValueError, match="algo.kl_estimator='k4'"):
        kl_estimate(logp, ref, "k4")

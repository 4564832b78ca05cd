"""Exact expectations over a small categorical policy (all actions enumerated, no sampling).

The expected gradient of each correction's loss under the sampler mu is compared with the on-policy
gradient -E_p[A grad log p] and with the closed form of its bias. rho = p / mu, s_a = onehot(a) - p.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlfw.algos import CorrectionConfig, policy_loss

from ._categorical import (
    ADV,
    LOGITS,
    MILD,
    WIDE,
    action_batch,
    expected_grad,
    per_action_grads,
    score,
    true_loss_grad,
)

TOL = 1e-12


def _rho() -> torch.Tensor:
    return LOGITS.softmax(0) / (LOGITS + WIDE).softmax(0)


def test_the_wide_discrepancy_triggers_every_rule() -> None:
    rho = _rho()  # preconditions, so the bias tests below cannot pass vacuously
    assert (rho > 2).any() and (rho < 0.5).any() and (rho > 5).any()


def test_untruncated_is_is_unbiased() -> None:
    g = expected_grad(CorrectionConfig(name="tis", tis_cap=math.inf), LOGITS, LOGITS + WIDE, ADV)
    assert torch.allclose(g, true_loss_grad(LOGITS, ADV), atol=TOL)


def test_tis_bias_is_the_truncated_mass() -> None:
    # E_mu[min(rho, C) A s] = E_p[A s] - E_mu[(rho - C)_+ A s]
    # so in loss space (loss = -objective) the bias is +E_mu[(rho - C)_+ A s].
    mu, rho = (LOGITS + WIDE).softmax(0), _rho()
    bias = (mu * (rho - 2.0).clamp(min=0) * ADV) @ score(LOGITS)
    g = expected_grad(CorrectionConfig(name="tis", tis_cap=2.0), LOGITS, LOGITS + WIDE, ADV)
    assert bias.abs().max() > 1e-3
    assert torch.allclose(g - true_loss_grad(LOGITS, ADV), bias, atol=TOL)


@pytest.mark.parametrize(
    ("cfg", "window"),
    [
        (CorrectionConfig(name="mis"), (0.5, 2.0)),
        (CorrectionConfig(name="icepop"), (0.5, 5.0)),  # no lag here (old = prefill = q): PPO ratio 1
    ],
)
def test_masking_bias_is_the_masked_mass(cfg: CorrectionConfig, window: tuple[float, float]) -> None:
    # E_mu[rho 1[kept] A s] = E_p[A s] - E_p[1[dropped] A s]: the bias is exactly the dropped on-policy mass.
    # (Here trainer = prefill = decode, so the total and the numerical ratio coincide.)
    p, rho = LOGITS.softmax(0), _rho()
    dropped = ((rho < window[0]) | (rho > window[1])).to(p.dtype)
    bias = (p * dropped * ADV) @ score(LOGITS)
    g = expected_grad(cfg, LOGITS, LOGITS + WIDE, ADV)
    assert dropped.sum() >= 1
    assert torch.allclose(g - true_loss_grad(LOGITS, ADV), bias, atol=TOL)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_centering_with_untruncated_is_equals_plain_is(k: int) -> None:
    # With phi(r) = r every centering coefficient is mu_v (p_v / mu_v) - p_v = 0, whatever the head size.
    is_grad = expected_grad(CorrectionConfig(name="tis", tis_cap=math.inf), LOGITS, LOGITS + WIDE, ADV)
    cfg = CorrectionConfig(name="centering", combine_with="tis", tis_cap=math.inf)
    assert torch.allclose(expected_grad(cfg, LOGITS, LOGITS + WIDE, ADV, k=k), is_grad, atol=TOL)
    assert torch.allclose(is_grad, true_loss_grad(LOGITS, ADV), atol=TOL)


# Drift: constant reward, so the true gradient is 0, with a fixed numerical discrepancy between sampler and
# trainer (trainer = engine weights; no lag). Plain PG drifts by -E_mu[s] = p - mu; the corrections that
# are unbiased here, or centre the score under mu, give exactly 0; PPO clipped against the sampler's weights
# sees ratio 1 and inherits the drift.
ONES = torch.ones(5, dtype=torch.float64)
DRIFT_FREE = [
    CorrectionConfig(name="tis", tis_cap=math.inf),
    CorrectionConfig(name="tis"),  # the cap C = 2 is not reached under the mild discrepancy
    CorrectionConfig(name="mis"),  # nor is the window left
    CorrectionConfig(name="centering"),
    CorrectionConfig(
        name="centering", combine_with="tis", tis_cap=1.1
    ),  # truncation binds, centering removes it
    CorrectionConfig(name="centering", combine_with="ppo", clip_eps=0.1),
    CorrectionConfig(name="dlc"),
]
DRIFTING = [
    CorrectionConfig(name="none"),
    CorrectionConfig(name="ppo_sampler"),
    CorrectionConfig(name="tis", tis_cap=1.1),
]


@pytest.mark.parametrize("cfg", DRIFT_FREE, ids=lambda c: f"{c.name}-{c.combine_with}-{c.tis_cap}")
def test_no_drift_under_constant_reward(cfg: CorrectionConfig) -> None:
    rho = LOGITS.softmax(0) / (LOGITS + MILD).softmax(0)
    assert 0.8 < rho.min() and rho.max() < 1.6
    g = expected_grad(cfg, LOGITS, LOGITS + MILD, ONES)
    assert g.abs().max() < 1e-6


@pytest.mark.parametrize("cfg", DRIFTING, ids=lambda c: f"{c.name}-{c.tis_cap}")
def test_drift_under_constant_reward(cfg: CorrectionConfig) -> None:
    g = expected_grad(cfg, LOGITS, LOGITS + MILD, ONES)
    assert g.abs().max() > 1e-3
    if cfg.name in ("none", "ppo_sampler"):  # plain PG and PPO at ratio 1: -E_mu[s] = -(mu - p)
        drift = -((LOGITS + MILD).softmax(0) - LOGITS.softmax(0))
        assert torch.allclose(g, drift, atol=TOL)


# Policy lag as a real distribution: the generating weights `old` differ from the trainer's by a shift of
# the logits, so q / old ranges over ~[0.84, 1.19] (inside PPO's clip at eps 0.2) or, under LAG_WIDE,
# leaves it on both sides (the clip acts for both advantage signs).
LAG = torch.tensor([-0.1, 0.08, 0.05, -0.07, 0.1], dtype=torch.float64)
LAG_WIDE = torch.tensor([-0.6, 0.5, 0.05, -0.4, 0.7], dtype=torch.float64)


def test_the_lags_are_inside_and_outside_the_clip() -> None:
    mild = LOGITS.softmax(0) / (LOGITS + LAG).softmax(0)
    wide = LOGITS.softmax(0) / (LOGITS + LAG_WIDE).softmax(0)
    assert 0.8 < mild.min() and mild.max() < 1.2
    assert wide.min() < 0.8 and wide.max() > 1.2


@pytest.mark.parametrize("lag", [LAG, LAG_WIDE], ids=["inside_clip", "clipped"])
@pytest.mark.parametrize("k", [2, 5])
def test_dlc_without_numerical_discrepancy_is_ppo_sampler_token_by_token(lag: torch.Tensor, k: int) -> None:
    # The sampler is the generating policy itself (mu = old): DLC's centring term is 0 for every action.
    old = LOGITS + lag
    dlc = per_action_grads(CorrectionConfig(name="dlc"), LOGITS, old, ADV, k=k, old_logits=old)
    ppo = per_action_grads(CorrectionConfig(name="ppo_sampler"), LOGITS, old, ADV, k=k, old_logits=old)
    assert ppo.abs().max() > 1e-2
    assert torch.allclose(dlc, ppo, atol=TOL)


def test_dlc_under_pure_lag_does_not_drift() -> None:
    # Constant reward, sampler = old, lag inside the clip: E_old[(q / old) grad log q] = grad sum q = 0. A
    # centred score scaled by the sampled token's lag weight alone would drift by A E_old[grad log q] != 0.
    old = LOGITS + LAG
    for name in ("dlc", "ppo_sampler"):
        g = expected_grad(CorrectionConfig(name=name), LOGITS, old, ONES, old_logits=old)
        assert g.abs().max() < 1e-12
    lag_free_drift = (old.softmax(0) @ score(LOGITS)).abs().max()
    assert lag_free_drift > 1e-2  # what the unit-weight centring would have left


@pytest.mark.parametrize("k", [1, 3, 5])
def test_dlc_without_lag_is_unit_weight_centering(k: int) -> None:
    # old = q (no lag): every lag weight is 1 and the centring term is that of score centering.
    dlc = per_action_grads(CorrectionConfig(name="dlc"), LOGITS, LOGITS + WIDE, ADV, k=k)
    centred = per_action_grads(CorrectionConfig(name="centering"), LOGITS, LOGITS + WIDE, ADV, k=k)
    assert torch.allclose(dlc, centred, atol=TOL)


def test_dlc_bias_under_lag_and_discrepancy_is_the_centring_covariance() -> None:
    # Full head, lag inside the clip (w = q / old), sampler != old. With g = A (w_a s_a - c) and
    # c = sum_v (mu_v - old_v) w_v s_v:
    #   E_mu[g] = E_old[A w s] + sum_v (mu_v - old_v) (A_v - E_mu[A]) w_v s_v
    # and E_old[A w s] = E_q[A s], the on-policy gradient: the only bias is centering's covariance term,
    # which vanishes for a constant advantage.
    old = LOGITS + LAG
    sampler = old + MILD
    p, q_old, mu, s_ = LOGITS.softmax(0), old.softmax(0), sampler.softmax(0), score(LOGITS)
    w = p / q_old
    bias = -(((mu - q_old) * (ADV - mu @ ADV) * w) @ s_)
    g = expected_grad(CorrectionConfig(name="dlc"), LOGITS, sampler, ADV, k=5, old_logits=old)
    assert bias.abs().max() > 1e-4
    assert torch.allclose(g, true_loss_grad(LOGITS, ADV) + bias, atol=TOL)
    flat = expected_grad(CorrectionConfig(name="dlc"), LOGITS, sampler, ONES, k=5, old_logits=old)
    assert flat.abs().max() < 1e-12


@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_dlc_clips_the_lag_weight_inside_the_centring_term(dual_clip: float | None) -> None:
    # Full head, lag on both sides of the clip, sampler != old. Per sampled action a:
    #   g_a = -A_a (w_a s_a - sum_v (mu_v - old_v) w_v s_v),   w_v = ppo_weight(q_v / old_v, A_a),
    # the clip judged with the sampled token's advantage for every v. q / old ~ [0.53, 1.59, 1.01, 0.65,
    # 1.94], so an unclipped w inside the centring term, or one that ignores the dual clip c = 1.5 on the
    # negative-advantage rows 1 and 4, gives other rows.
    old = LOGITS - LAG_WIDE
    sampler = old + MILD
    cfg = CorrectionConfig(name="dlc", dual_clip=dual_clip)
    rows = per_action_grads(cfg, LOGITS, sampler, ADV, k=5, old_logits=old)
    p, q_old, mu, s_ = LOGITS.softmax(0), old.softmax(0), sampler.softmax(0), score(LOGITS)
    r = p / q_old
    c = dual_clip or math.inf
    for a in range(5):
        active = (r <= 1.2) if ADV[a] > 0 else (r >= 0.8) & (r <= c)
        w = torch.where(active, r, 0.0)
        expected = -ADV[a] * (w[a] * s_[a] - ((mu - q_old) * w) @ s_)
        assert torch.allclose(rows[a], expected, atol=TOL), a
        _, metrics = policy_loss(action_batch(LOGITS, sampler, a, ADV, 5, old), cfg)
        assert metrics["ratio/lag/clip_frac"].item() == float(not active[a])

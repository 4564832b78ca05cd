"""Score centering: hand-worked coefficients, the tail model, and exact centering over the full vocabulary."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from rlfw.algos import CorrectionConfig, LossInputs, policy_loss

from ._categorical import ADV, LOGITS, WIDE, action_batch, per_action_grads, score

F64 = torch.float64


def _one_token(
    p: list[float], mu: list[float], a: int, adv: float, head: list[int]
) -> tuple[LossInputs, torch.Tensor]:
    """A single-token batch with trainer probs p, sampler probs mu, action a and head ids `head`."""
    logp, logmu = torch.log(torch.tensor(p, dtype=F64)), torch.log(torch.tensor(mu, dtype=F64))
    trainer_head = logp[head].reshape(1, 1, -1).clone().requires_grad_()
    q = logp[a].reshape(1, 1).clone().requires_grad_()
    inputs = LossInputs(
        trainer_logp=q,
        sampler_logp=logmu[a].reshape(1, 1),
        decode_logp=logp[a].reshape(1, 1),
        prefill_logp=logp[a].reshape(1, 1),
        advantages=torch.tensor([[adv]], dtype=F64),
        mask=torch.ones(1, 1),
        num_tokens=1,
        sampler_topk_ids=torch.tensor(head).reshape(1, 1, -1),
        sampler_topk_logp=logmu[head].reshape(1, 1, -1),
        trainer_topk_logp=trainer_head,
        reference_topk_logp=logp[head].reshape(1, 1, -1),  # no lag: the reference is the trainer
    )
    return inputs, trainer_head


@pytest.mark.parametrize(
    ("name", "combine", "cap", "loss", "head_grad"),
    [
        # p = [0.6, 0.4], mu = [0.5, 0.5], a = 0, A = 1, full head, unit weights:
        # loss = -[log 0.6 - 0.5 log 0.6 - 0.5 log 0.4] = 0.5 log(0.4 / 0.6)
        # d/d log p_v = +A mu_v = [0.5, 0.5]
        ("centering", "none", 2.0, 0.5 * math.log(0.4 / 0.6), [0.5, 0.5]),
        # dlc with no lag (old = p): head coefficients mu_v - old_v = [-0.1, 0.1], so
        # loss = -[log 0.6 + 0.1 log 0.6 - 0.1 log 0.4]. In the logits this is centering's gradient, as
        # sum_v p_v grad log p_v = 0 (test_unbiasedness checks it action by action).
        ("dlc", "none", 2.0, -(1.1 * math.log(0.6) - 0.1 * math.log(0.4)), [-0.1, 0.1]),
        # TIS with C = 1: r = p / mu = [1.2, 0.8] -> phi = [1, 0.8]; coef = mu phi = [0.5, 0.4]; w_a = 1
        # loss = -[log 0.6 - 0.5 log 0.6 - 0.4 log 0.4]
        ("centering", "tis", 1.0, -(0.5 * math.log(0.6) - 0.4 * math.log(0.4)), [0.5, 0.4]),
    ],
)
def test_centering_closed_form_two_tokens(
    name: str, combine: str, cap: float, loss: float, head_grad: list[float]
) -> None:
    inputs, trainer_head = _one_token([0.6, 0.4], [0.5, 0.5], a=0, adv=1.0, head=[0, 1])
    value, metrics = policy_loss(inputs, CorrectionConfig(name=name, combine_with=combine, tis_cap=cap))
    value.backward()
    assert value.item() == pytest.approx(loss, abs=1e-12)
    assert inputs.trainer_logp.grad.item() == pytest.approx(-1.0)  # -A w_a
    assert torch.allclose(trainer_head.grad.flatten(), torch.tensor(head_grad, dtype=F64), atol=1e-12)
    assert metrics["centering/sampler_head_mass"].item() == pytest.approx(1.0)


def test_tail_model_closed_form() -> None:
    # p = [0.5, 0.3, 0.2], mu = [0.6, 0.25, 0.15], head = {0}, sampled a = 1 (outside the head), A = 2.
    # Q_H = 0.6, P_H = 0.5 -> alpha = 0.4 / 0.5 = 0.8
    # unit weights: coef_0 = mu_0 - alpha p_0 = 0.6 - 0.4 = 0.2
    # loss = -2 [log 0.3 - 0.2 log 0.5]; d/d log p_0 = +2 * 0.2 = 0.4
    inputs, trainer_head = _one_token([0.5, 0.3, 0.2], [0.6, 0.25, 0.15], a=1, adv=2.0, head=[0])
    value, metrics = policy_loss(inputs, CorrectionConfig(name="centering"))
    value.backward()
    assert value.item() == pytest.approx(-2 * (math.log(0.3) - 0.2 * math.log(0.5)), abs=1e-12)
    assert trainer_head.grad.item() == pytest.approx(0.4, abs=1e-12)
    assert metrics["centering/trainer_head_mass"].item() == pytest.approx(0.5)


def _exact_centred_rows(phi_name: str, logits: torch.Tensor, sampler_logits: torch.Tensor) -> torch.Tensor:
    """[V, V] exact per-action loss gradients -A_a (phi(rho_a) s_a - sum_v mu_v phi(rho_v) s_v)."""
    p, mu = logits.softmax(0), sampler_logits.softmax(0)
    rho = p / mu
    phi = {
        "none": torch.ones_like(rho),
        "tis": rho.clamp(max=1.5),
        "mis": torch.where((rho >= 0.5) & (rho <= 2.0), rho, 0.0),
    }[phi_name]
    s = score(logits)
    centre = (mu * phi) @ s
    return -ADV.unsqueeze(-1) * (phi.unsqueeze(-1) * s - centre)


@pytest.mark.parametrize("combine", ["none", "tis", "mis"])
def test_full_vocabulary_head_is_exact_centering(combine: str) -> None:
    cfg = CorrectionConfig(name="centering", combine_with=combine, tis_cap=1.5)
    rows = per_action_grads(cfg, LOGITS, LOGITS + WIDE, ADV, k=5)
    assert torch.allclose(rows, _exact_centred_rows(combine, LOGITS, LOGITS + WIDE), atol=1e-12)


@pytest.mark.parametrize("dual_clip", [None, 2.0])
def test_ppo_combination_is_exact_centering_per_advantage_sign(dual_clip: float | None) -> None:
    # rho ~ [0.46, 3.0, 1.4, 0.92, 6.1]; with the dual clip c = 2, negative-advantage rows also lose v = 1, 4
    cfg = CorrectionConfig(name="centering", combine_with="ppo", clip_eps=0.2, dual_clip=dual_clip)
    rows = per_action_grads(cfg, LOGITS, LOGITS + WIDE, ADV, k=5)
    p, mu = LOGITS.softmax(0), (LOGITS + WIDE).softmax(0)
    rho, s = p / mu, score(LOGITS)
    for a in range(5):  # the PPO weight depends on the sign of the token's advantage
        active = (rho <= 1.2) if ADV[a] > 0 else (rho >= 0.8) & (rho <= (dual_clip or math.inf))
        phi = torch.where(active, rho, 0.0)
        expected = -ADV[a] * (phi[a] * s[a] - (mu * phi) @ s)
        assert torch.allclose(rows[a], expected, atol=1e-12)


def test_tail_model_is_exact_when_the_sampler_tail_is_proportional() -> None:
    # Build mu whose tail (outside its top-2) is exactly alpha * p: top-2 centering is then exact.
    p = LOGITS.softmax(0)
    head = torch.tensor([2, 0])  # p's two largest
    mu = p * 0.5
    mu[head] = torch.tensor([0.45, 0.30], dtype=F64)
    mu = mu / mu.sum()
    assert set(mu.topk(2).indices.tolist()) == set(head.tolist())
    sampler_logits = torch.log(mu)
    rows = per_action_grads(CorrectionConfig(name="centering"), LOGITS, sampler_logits, ADV, k=2)
    assert torch.allclose(rows, _exact_centred_rows("none", LOGITS, sampler_logits), atol=1e-12)
    # ... and a wrong tail (non-proportional) is only approximately centred: the check above can fail.
    rows_wrong = per_action_grads(CorrectionConfig(name="centering"), LOGITS, LOGITS + WIDE, ADV, k=2)
    assert not torch.allclose(rows_wrong, _exact_centred_rows("none", LOGITS, LOGITS + WIDE), atol=1e-6)


def test_gradient_reaches_only_trainer_streams() -> None:
    inputs, trainer_head = _one_token([0.5, 0.3, 0.2], [0.6, 0.25, 0.15], a=1, adv=2.0, head=[0, 1])
    sampler_head = inputs.sampler_topk_logp.clone().requires_grad_()
    sampler = inputs.sampler_logp.clone().requires_grad_()
    inputs.sampler_topk_logp, inputs.sampler_logp = sampler_head, sampler
    for name in ("centering", "dlc"):
        loss, _ = policy_loss(inputs, CorrectionConfig(name=name))
        loss.backward()
    assert trainer_head.grad is not None and trainer_head.grad.abs().sum() > 0
    assert inputs.trainer_logp.grad is not None
    assert sampler_head.grad is None and sampler.grad is None


def test_transform_removed_head_entries_contribute_nothing() -> None:
    # A replayed top-2 transform gives the third head entry -inf in both streams: no NaN, same loss as top-2.
    inputs, _ = _one_token([0.6, 0.4, 0.0], [0.5, 0.5, 0.0], a=0, adv=1.0, head=[0, 1, 2])
    value, _ = policy_loss(inputs, CorrectionConfig(name="centering"))
    value.backward()
    assert value.item() == pytest.approx(0.5 * math.log(0.4 / 0.6), abs=1e-12)
    assert torch.isfinite(inputs.trainer_topk_logp.grad).all()


@pytest.mark.parametrize("k", [32, 64])
def test_float32_centering_over_a_realistic_head_matches_float64(k: int) -> None:
    # V = 64, a sampler close to the trainer (a numerical discrepancy), three positions with sampled tokens.
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 64, generator=g, dtype=F64) * 2
    zs = z + 0.05 * torch.randn(3, 64, generator=g, dtype=F64)
    actions = torch.tensor([0, 5, 63])
    grads = {}
    for dtype in (torch.float32, F64):
        logits = z.to(dtype).requires_grad_()
        logp, logmu = logits.log_softmax(-1), zs.to(dtype).log_softmax(-1)
        ids = logmu.topk(k, dim=-1).indices
        token = logp.gather(-1, actions[:, None]).T
        inputs = LossInputs(
            trainer_logp=token,
            sampler_logp=logmu.gather(-1, actions[:, None]).T,
            decode_logp=token.detach(),
            prefill_logp=token.detach(),
            advantages=torch.tensor([[1.0, -0.5, 2.0]], dtype=dtype),
            mask=torch.ones(1, 3),
            num_tokens=3,
            sampler_topk_ids=ids[None],
            sampler_topk_logp=logmu.gather(-1, ids)[None],
            trainer_topk_logp=logp.gather(-1, ids)[None],
        )
        loss, _ = policy_loss(inputs, CorrectionConfig(name="centering", combine_with="tis"))
        (grads[dtype],) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(grads[torch.float32]).all()
    assert torch.allclose(grads[torch.float32].double(), grads[F64], atol=1e-5)


def test_sequence_level_mis_inside_centering_drops_whole_sequences() -> None:
    # Sequence-level MIS keeps importance weights inside a kept sequence (phi(r) = r), so the centering
    # coefficients vanish and each one-token sequence gets exactly the plain sequence-level MIS gradient.
    window = {"mis_level": "sequence", "mis_bounds": (0.5, 2.0)}
    centred = per_action_grads(
        CorrectionConfig(name="centering", combine_with="mis", **window), LOGITS, LOGITS + WIDE, ADV, k=3
    )
    plain = per_action_grads(CorrectionConfig(name="mis", **window), LOGITS, LOGITS + WIDE, ADV)
    assert torch.allclose(centred, plain, atol=1e-12)
    assert (plain.abs().sum(-1) == 0).sum() == 3  # rho = 0.46, 3.0, 6.1 leave [0.5, 2]: dropped


@pytest.mark.parametrize(
    ("combine", "key", "flagged"),
    [
        ("tis", "ratio/total/clip_frac", lambda rho, adv: rho > 1.5),
        ("mis", "ratio/total/mask_frac", lambda rho, adv: (rho < 0.5) | (rho > 2.0)),
        # the PPO clip has taken over: A > 0 above 1 + eps, A < 0 below 1 - eps or above the dual clip c = 2
        (
            "ppo",
            "ratio/total/clip_frac",
            lambda rho, adv: rho > 1.2 if adv > 0 else (rho < 0.8) | (rho > 2.0),
        ),
    ],
)
def test_combined_rule_reports_where_it_acted(
    combine: str, key: str, flagged: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> None:
    # One single-token batch per action a; the metric is 1 exactly where the rule changed the token's weight.
    cfg = CorrectionConfig(name="centering", combine_with=combine, tis_cap=1.5, dual_clip=2.0)
    rho = LOGITS.softmax(0) / (LOGITS + WIDE).softmax(0)  # ~ [0.46, 3.0, 1.4, 0.92, 6.1]
    got = []
    for a in range(5):
        _, metrics = policy_loss(action_batch(LOGITS, LOGITS + WIDE, a, ADV, 5, None), cfg)
        got.append(metrics[key].item())
    expected = [float(flagged(rho[a], ADV[a])) for a in range(5)]
    assert got == expected and 0 < sum(expected) < 5


def _two_tokens(mask: list[int]) -> LossInputs:
    """Two positions with their own trainer, sampler and reference distributions over 3 ids, top-2 heads:
    position 0: p = [0.6, 0.3, 0.1], mu = [0.5, 0.3, 0.2], old = [0.55, 0.35, 0.1], head {0, 1}, a = 0, A = 1;
    position 1: p = [0.2, 0.5, 0.3], mu = [0.25, 0.45, 0.3], old = p, head {1, 2}, a = 1, A = -2."""
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]], dtype=F64).log()
    mu = torch.tensor([[0.5, 0.3, 0.2], [0.25, 0.45, 0.3]], dtype=F64).log()
    old = torch.tensor([[0.55, 0.35, 0.1], [0.2, 0.5, 0.3]], dtype=F64).log()
    ids, a = torch.tensor([[0, 1], [1, 2]]), torch.tensor([[0], [1]])

    def pick(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        return x.gather(-1, at).reshape(1, 2, -1)

    q = pick(p, a).reshape(1, 2).requires_grad_()
    return LossInputs(
        trainer_logp=q,
        sampler_logp=pick(mu, a).reshape(1, 2),
        decode_logp=q.detach(),
        prefill_logp=q.detach(),
        old_logp=pick(old, a).reshape(1, 2),
        advantages=torch.tensor([[1.0, -2.0]], dtype=F64),
        mask=torch.tensor([mask]),
        num_tokens=2,
        sampler_topk_ids=ids.reshape(1, 2, 2),
        sampler_topk_logp=pick(mu, ids),
        trainer_topk_logp=pick(p, ids).requires_grad_(),
        reference_topk_logp=pick(old, ids),
    )


@pytest.mark.parametrize("name", ["centering", "dlc"])
def test_each_position_is_centred_on_its_own_head(name: str) -> None:
    # Micro-batches holding one position each add up to the batch of both: a position's centring term
    # is built from its own head only.
    cfg = CorrectionConfig(name=name)
    full = _two_tokens([1, 1])
    whole, metrics = policy_loss(full, cfg)
    whole.backward()
    parts = [_two_tokens([1, 0]), _two_tokens([0, 1])]
    total = 0.0
    for part in parts:
        value, _ = policy_loss(part, cfg)
        value.backward()
        total += value.item()
    assert whole.item() == pytest.approx(total, abs=1e-15)
    for field in ("trainer_logp", "trainer_topk_logp"):
        summed = getattr(parts[0], field).grad + getattr(parts[1], field).grad
        assert torch.allclose(getattr(full, field).grad, summed, atol=1e-15)
    # head masses averaged over positions: sampler (0.8 + 0.75) / 2, trainer (0.9 + 0.8) / 2
    assert metrics["centering/sampler_head_mass"].item() == pytest.approx(0.775)
    assert metrics["centering/trainer_head_mass"].item() == pytest.approx(0.85)

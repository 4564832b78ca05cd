"""Group-relative advantages and GAE against hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from rlfw.algos import gae, group_advantages, to_tokens

from ._builders import t


@pytest.mark.parametrize(
    ("baseline", "scale_by_std", "expected"),
    [
        # mean 0.5; centred = [0.5, -0.5, -0.5, 0.5]
        ("mean", False, [0.5, -0.5, -0.5, 0.5]),
        # unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3); 0.5 / sqrt(1/3) = 0.8660254
        ("mean", True, [0.8660254, -0.8660254, -0.8660254, 0.8660254]),
        # leave-one-out: 1 - (0 + 0 + 1) / 3 = 2/3 and 0 - (1 + 0 + 1) / 3 = -2/3
        ("leave_one_out", False, [2 / 3, -2 / 3, -2 / 3, 2 / 3]),
        # (2/3) / sqrt(1/3) = 1.1547005
        ("leave_one_out", True, [1.1547005, -1.1547005, -1.1547005, 1.1547005]),
    ],
)
def test_group_advantages_closed_form(baseline: str, scale_by_std: bool, expected: list[float]) -> None:
    adv = group_advantages(t([[1.0, 0.0, 0.0, 1.0]]), baseline=baseline, scale_by_std=scale_by_std, eps=0.0)
    assert torch.allclose(adv, t([expected]), atol=1e-7)


def test_group_advantages_defaults_are_grpo() -> None:
    # baseline mean, divided by (unbiased std + 1e-6): 0.5 / (sqrt(1/3) + 1e-6)
    adv = group_advantages(t([[1.0, 0.0, 0.0, 1.0]]))
    scale = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert torch.allclose(adv, t([[scale, -scale, -scale, scale]]), rtol=1e-12, atol=0)


def test_group_advantages_eps_is_added_to_the_std() -> None:
    # 0.5 / (sqrt(1/3) + 1) = 0.3169873; a large eps pins where it enters
    adv = group_advantages(t([[1.0, 0.0, 0.0, 1.0]]), eps=1.0)
    assert torch.allclose(adv, t([[1.0, -1.0, -1.0, 1.0]]) * 0.5 / (math.sqrt(1 / 3) + 1), atol=1e-12)


def test_group_advantages_per_group_and_flat_group() -> None:
    rewards = t([[3.0, 1.0], [2.0, 2.0]])
    adv = group_advantages(rewards, scale_by_std=True, eps=1e-6)
    # group 0: centred [1, -1], std sqrt(2): 1 / (sqrt 2 + 1e-6); group 1: all equal -> exactly 0, no NaN
    assert torch.allclose(adv[0], t([1.0, -1.0]) / (math.sqrt(2.0) + 1e-6))
    assert torch.equal(adv[1], t([0.0, 0.0]))


def test_group_advantages_leave_one_out_matches_definition() -> None:
    rewards = torch.rand(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    adv = group_advantages(rewards, baseline="leave_one_out", scale_by_std=False)
    others = (rewards.sum(-1, keepdim=True) - rewards) / 4
    assert torch.allclose(adv, rewards - others, atol=1e-12)


@pytest.mark.parametrize(("baseline", "scale"), [("mean", True), ("leave_one_out", False)])
def test_group_of_one_is_refused(baseline: str, scale: bool) -> None:
    with pytest.raises(ValueError, match="G=1"):
        group_advantages(t([[1.0], [0.0]]), baseline=baseline, scale_by_std=scale)


def test_unknown_baseline_is_refused() -> None:
    with pytest.raises(ValueError, match="baseline='median'.*mean \\| leave_one_out"):
        group_advantages(t([[1.0, 0.0]]), baseline="median")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_to_tokens_broadcasts_inside_the_mask(dtype: torch.dtype) -> None:
    out = to_tokens(torch.tensor([2, -1], dtype=dtype), torch.tensor([[1, 1, 0], [0, 1, 1]]))
    assert out.dtype == dtype  # a broadcast: integer values (e.g. versions) stay integers
    assert torch.equal(out, torch.tensor([[2, 2, 0], [0, -1, -1]], dtype=dtype))


@pytest.mark.parametrize(
    ("gamma", "lam", "adv", "ret"),
    [
        # delta_2 = 1 - 0.7 = 0.3; delta_1 = 0.7 - 0.6 = 0.1; delta_0 = 0.6 - 0.5 = 0.1
        # A = [0.1 + 0.1 + 0.3, 0.1 + 0.3, 0.3] = [0.5, 0.4, 0.3]; R = A + V = [1, 1, 1]
        (1.0, 1.0, [0.5, 0.4, 0.3], [1.0, 1.0, 1.0]),
        # delta_2 = 0.3; delta_1 = 0.9 * 0.7 - 0.6 = 0.03; delta_0 = 0.9 * 0.6 - 0.5 = 0.04; gamma lam = 0.45
        # A_2 = 0.3; A_1 = 0.03 + 0.45 * 0.3 = 0.165; A_0 = 0.04 + 0.45 * 0.165 = 0.11425
        (0.9, 0.5, [0.11425, 0.165, 0.3], [0.61425, 0.765, 1.0]),
        # lam = 0: one-step TD errors
        (0.9, 0.0, [0.04, 0.03, 0.3], [0.54, 0.63, 1.0]),
    ],
)
def test_gae_closed_form(gamma: float, lam: float, adv: list[float], ret: list[float]) -> None:
    a, r = gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma, lam)
    assert torch.allclose(a, t([adv]), atol=1e-12)
    assert torch.allclose(r, t([ret]), atol=1e-12)


def test_gae_of_single_token_responses() -> None:
    # T = 1: the only token is terminal, A = r - V = [1 - 0.4, 0 - 0.5], R = A + V = r
    a, r = gae(t([[1.0], [0.0]]), t([[0.4], [0.5]]), torch.ones(2, 1), 0.9, 0.5)
    assert torch.allclose(a, t([[0.6], [-0.5]]), atol=1e-12)
    assert torch.allclose(r, t([[1.0], [0.0]]), atol=1e-12)


def test_gae_ignores_padding_and_skips_interior_masked_tokens() -> None:
    # Response tokens at positions 0, 2, 3; position 1 is a tool output, 4-5 are padding. Garbage there
    # (rewards 5, values 9) must not leak. Expected: the compressed sequence [0, 2, 3] on its own.
    rewards = t([[0.0, 5.0, 0.0, 1.0, 5.0, 5.0]])
    values = t([[0.5, 9.0, 0.6, 0.7, 9.0, 9.0]])
    mask = torch.tensor([[1, 0, 1, 1, 0, 0]])
    a, r = gae(rewards, values, mask, 0.9, 0.5)
    assert torch.allclose(a, t([[0.11425, 0.0, 0.165, 0.3, 0.0, 0.0]]), atol=1e-12)
    assert torch.allclose(r, t([[0.61425, 0.0, 0.765, 1.0, 0.0, 0.0]]), atol=1e-12)


def test_gae_rows_are_independent() -> None:
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = t([[0.5, 0.6, 0.7], [1.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    a, _ = gae(rewards, values, mask, 1.0, 1.0)
    # row 1 ends at t=1: A_1 = 2 - 1 = 1; A_0 = (0 + 1 - 1) + 1 = 1
    assert torch.allclose(a, t([[0.5, 0.4, 0.3], [1.0, 1.0, 0.0]]), atol=1e-12)

"""Clipped value loss against a hand-worked value."""

from __future__ import annotations

import pytest
import torch

from rlfw.algos import value_loss

from ._builders import t


def test_clipped_value_loss_closed_form() -> None:
    values = t([[1.0, 2.0, 7.0]], grad=True)
    old = t([[0.5, 1.0, 0.0]])
    returns = t([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = value_loss(values, old, returns, mask, num_tokens=2, clip_eps=0.2)
    # token 0: (1 - 2)^2 = 1; V_clip = 0.5 + 0.2 = 0.7, (0.7 - 2)^2 = 1.69 -> max 1.69 (clipped: no grad)
    # token 1: (2 - 1)^2 = 1; V_clip = 1 + 0.2 = 1.2, (1.2 - 1)^2 = 0.04 -> max 1 (unclipped)
    # token 2: masked out. loss = 0.5 * (1.69 + 1) / 2 = 0.6725
    assert loss.item() == pytest.approx(0.6725)
    assert metrics["value/clip_frac"].item() == 0.5
    loss.backward()
    # d/dV 0.5 (V - R)^2 / 2 = (2 - 1) / 2 = 0.5 on token 1 only
    assert torch.allclose(values.grad, t([[0.0, 0.5, 0.0]]))


def test_unclipped_value_loss_is_half_mse() -> None:
    loss, metrics = value_loss(t([[1.0, 3.0]]), t([[0.0, 0.0]]), t([[0.0, 0.0]]), torch.ones(1, 2), 2, None)
    assert loss.item() == pytest.approx(0.5 * (1 + 9) / 2)
    assert metrics["value/clip_frac"].item() == 0.0


def test_value_clip_acts_below_the_old_value_too() -> None:
    # Default clip_eps = 0.2. Token 0 fell below old by 1: V_clip = 1 - 0.2 = 0.8;
    # (0 - (-0.5))^2 = 0.25 < (0.8 + 0.5)^2 = 1.69 -> the clip binds (no gradient).
    # Token 1 moved 0.1, inside the region: V_clip = V, both errors (1.1 - 2)^2 = 0.81: not clipped.
    # loss = 0.5 * (1.69 + 0.81) / 2 = 0.625; d/dV on token 1 = (1.1 - 2) / 2 = -0.45
    values = t([[0.0, 1.1]], grad=True)
    loss, metrics = value_loss(values, t([[1.0, 1.0]]), t([[-0.5, 2.0]]), torch.ones(1, 2), num_tokens=2)
    assert loss.item() == pytest.approx(0.625)
    assert metrics["loss/value"].item() == pytest.approx(0.625)
    assert metrics["value/clip_frac"].item() == 0.5
    loss.backward()
    assert torch.allclose(values.grad, t([[0.0, -0.45]]))
    # One masked token, clipped: the fraction is over masked tokens, 1 of 1.
    _, one = value_loss(t([[0.0, 1.1]]), t([[1.0, 1.0]]), t([[-0.5, 2.0]]), torch.tensor([[1, 0]]), 1)
    assert one["value/clip_frac"].item() == 1.0

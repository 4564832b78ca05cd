"""Ratio decomposition, ESS and the per-factor ratio metrics against closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from rlfw.algos import decompose, ess, ess_from_log, ratio_metrics

from ._builders import F64, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_decompose_identity_is_exact(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    q, s_p, s_d, mu = (-(torch.rand(4, 33, generator=g) * 8).to(dtype) for _ in range(4))
    f = decompose(q, s_p, s_d, mu)
    bits = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}[dtype]
    # total is *defined* as the sum of the three factors, so the identity holds bit for bit.
    assert torch.equal(f["total"].view(bits), (f["trainer"] + f["decode"] + f["sampler"]).view(bits))
    # ... and it equals q - mu up to the rounding of three subtractions and two additions.
    tol = 5 * 8 * torch.finfo(dtype).eps  # five roundings at magnitude <= 8
    assert torch.allclose(f["total"].double(), (q - mu).double(), atol=tol, rtol=0)


def test_decompose_factors_name_each_gap() -> None:
    f = decompose(t([-1.0]), t([-1.5]), t([-1.25]), t([-2.0]))
    assert f["trainer"].item() == 0.5  # q - s^P = -1 + 1.5
    assert f["decode"].item() == -0.25  # s^P - s^D = -1.5 + 1.25
    assert f["sampler"].item() == 0.75  # s^D - mu = -1.25 + 2
    assert f["total"].item() == 1.0  # = q - mu


def test_decompose_passes_gradient_through_trainer_only() -> None:
    q, s_p = t([-1.0, -2.0], grad=True), t([-1.5, -2.5], grad=True)
    f = decompose(q, s_p, t([-1.0, -1.0]), t([-1.0, -1.0]))
    (f["total"].sum() + f["trainer"].sum()).backward()
    assert torch.equal(q.grad, t([2.0, 2.0]))
    # s^P enters trainer (-1) and decode (+1): its gradient through total cancels, leaving -1 from trainer.
    assert torch.equal(s_p.grad, t([-1.0, -1.0]))


@pytest.mark.parametrize(
    ("w", "mask", "expected"),
    [
        ([1.0, 1.0, 1.0, 1.0], None, 1.0),  # equal weights: ESS = N
        ([4.0, 0.0, 0.0, 0.0], None, 0.25),  # one weight carries everything: ESS = 1 of 4
        ([1.0, 2.0, 3.0], None, 36 / 42),  # (1+2+3)^2 / (3 * (1+4+9)) = 36/42
        ([1.0, 2.0, 3.0, 100.0], [1, 1, 1, 0], 36 / 42),  # the masked 100 is ignored, N = 3
        ([2.0, 2.0, 8.0, 5.0], [True, True, True, False], 144 / 216),  # (12)^2 / (3 * 72)
    ],
)
def test_ess_closed_form(w: list[float], mask: list[float] | None, expected: float) -> None:
    m = None if mask is None else torch.tensor(mask)
    assert ess(t(w), m).item() == pytest.approx(expected, rel=1e-12)
    assert ess_from_log(torch.log(t(w)), m).item() == pytest.approx(expected, rel=1e-12)


def test_ess_from_log_survives_huge_log_weights() -> None:
    logw = t([1000.0, 1000.0 + math.log(2.0), 1000.0 + math.log(3.0)])
    assert torch.isnan(ess(torch.exp(logw)))  # inf / inf: why the log form exists
    assert ess_from_log(logw).item() == pytest.approx(36 / 42, rel=1e-12)


def test_ess_of_nothing_is_nan() -> None:
    nothing = ess_from_log(t([0.5, 0.1]), torch.tensor([False, False]))
    assert torch.isnan(nothing)
    assert nothing.dtype == F64  # the dtype of a defined ESS, so a step's metrics stack and reduce together
    assert torch.isnan(ess(t([0.5, 0.1]), torch.tensor([False, False])))


# For log w ~ N(0, sigma^2): E[w]^2 / E[w^2] = exp(sigma^2) / exp(2 sigma^2) = exp(-sigma^2).
# With N = 10^6 the estimator's standard deviation is at most ~0.002 (sigma = 0.83: w^2 has relative variance
# exp(4 sigma^2) - 1 ~ 15, so sd ~ 0.5 * sqrt(15 / 1e6)); the tolerance 0.01 is five of those.
@pytest.mark.parametrize(("sigma", "expected"), [(0.05, 0.998), (0.1, 0.990), (0.3, 0.914), (0.83, 0.501)])
def test_ess_calibration_on_lognormal_weights(sigma: float, expected: float) -> None:
    g = torch.Generator().manual_seed(1234)
    logw = sigma * torch.randn(1_000_000, generator=g, dtype=F64) + 300.0  # offset: exp would overflow
    assert math.exp(-(sigma**2)) == pytest.approx(expected, abs=1.5e-3)
    assert ess_from_log(logw).item() == pytest.approx(math.exp(-(sigma**2)), abs=0.01)


def test_ratio_metrics_closed_form() -> None:
    # log ratios of r = [3, 0.8, 0.2], and a fourth token outside the mask that must not count.
    lr = torch.log(t([[3.0, 0.8, 0.2, 50.0]]))
    m = ratio_metrics("total", lr, torch.tensor([[1, 1, 1, 0]]))
    assert m["ratio/total/mean"].item() == pytest.approx(4.0 / 3.0)  # (3 + 0.8 + 0.2) / 3
    assert m["ratio/total/max_abs_log"].item() == pytest.approx(math.log(5.0))  # |log 0.2| > log 3
    # k3 = mean(r - 1 - log r) = ((2 - log 3) + (-0.2 - log 0.8) + (-0.8 - log 0.2)) / 3 = 0.5779897
    k3 = ((2 - math.log(3)) + (-0.2 - math.log(0.8)) + (-0.8 - math.log(0.2))) / 3
    assert m["ratio/total/k3_kl"].item() == pytest.approx(k3)
    assert torch.allclose(m["ratio/total/hist"], torch.log(t([3.0, 0.8, 0.2])))


def test_ratio_metrics_of_an_exact_ratio() -> None:
    m = ratio_metrics("decode", torch.zeros(2, 5), torch.ones(2, 5))
    assert m["ratio/decode/mean"].item() == 1.0
    assert m["ratio/decode/max_abs_log"].item() == 0.0
    assert m["ratio/decode/k3_kl"].item() == 0.0


def test_ratio_metrics_of_no_token_are_nan() -> None:
    # a micro-batch whose tokens are all masked (or dropped as non-finite): NaN, not an error, and float64
    # like the metrics of a float64 ratio with tokens
    m = ratio_metrics("lag", t([[0.3, -0.2]]), torch.zeros(1, 2))
    for stat in ("mean", "max_abs_log", "k3_kl"):
        assert m[f"ratio/lag/{stat}"].shape == () and torch.isnan(m[f"ratio/lag/{stat}"])
        assert m[f"ratio/lag/{stat}"].dtype == F64
    assert m["ratio/lag/hist"].numel() == 0


def test_ratio_metrics_of_one_token() -> None:
    m = ratio_metrics("lag", t([[math.log(2.0), 5.0]]), torch.tensor([[1, 0]]))
    assert m["ratio/lag/mean"].item() == pytest.approx(2.0)
    assert m["ratio/lag/max_abs_log"].item() == pytest.approx(math.log(2.0))
    assert m["ratio/lag/k3_kl"].item() == pytest.approx(1.0 - math.log(2.0))  # (2 - 1) - log 2


def test_ratio_metrics_of_bfloat16_ratios_are_computed_in_float32() -> None:
    # 4096 bf16 log ratios: the mean of exp(lr) accumulated in bf16 would be off in the second digit
    lr = (torch.linspace(-0.5, 0.5, 4096, dtype=F64) ** 3).to(torch.bfloat16).reshape(1, -1)
    m = ratio_metrics("sampler", lr, torch.ones_like(lr))
    exact = torch.exp(lr.double()).mean()
    assert m["ratio/sampler/mean"].dtype == torch.float32
    assert m["ratio/sampler/mean"].item() == pytest.approx(exact.item(), rel=1e-6)
    assert m["ratio/sampler/k3_kl"].item() == pytest.approx(
        (torch.expm1(lr.double()) - lr.double()).mean().item(), rel=1e-4
    )

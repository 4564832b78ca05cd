"""Edges of the weight rules and of the non-finite filter: closed windows, exact boundaries, empty rows,
non-finite top-k heads. Each case is one a mutation of rlfw/algos survived before it was written (see
bench/RESULTS.md, "Mutation testing of rlfw/algos")."""

from __future__ import annotations

import math

import pytest
import torch

from rlfw.algos import CorrectionConfig, LossInputs, policy_loss
from rlfw.algos.batch import prepare
from rlfw.algos.weights import in_window, ppo_active, ppo_weight, sequence_in_window

from ._builders import F64, t


def test_windows_are_closed() -> None:
    # MIS and IcePop keep lo <= ratio <= hi: both ends are kept, the next float outside is not
    ratio = t([0.5, 2.0, math.nextafter(0.5, 0.0), math.nextafter(2.0, 3.0)])
    assert in_window(ratio, 0.5, 2.0).tolist() == [True, True, False, False]


@pytest.mark.parametrize(
    ("ratio", "adv", "active"),
    [
        # The clip flattens the surrogate strictly beyond 1 + eps_high (A > 0), 1 - eps_low (A < 0) and the
        # dual clip c (A < 0): at each of those points the token still has its gradient.
        (1.2, 1.0, True),
        (math.nextafter(1.2, 2.0), 1.0, False),
        (0.8, -1.0, True),
        (math.nextafter(0.8, 0.0), -1.0, False),
        (3.0, -1.0, True),
        (math.nextafter(3.0, 4.0), -1.0, False),
        (100.0, 0.0, True),  # A = 0: nothing to clip
    ],
)
def test_ppo_clip_boundaries(ratio: float, adv: float, active: bool) -> None:
    r, a = t([ratio]), t([adv])
    assert ppo_active(r, a, 0.2, 0.2, 3.0).item() is active
    assert ppo_weight(r, a, 0.2, 0.2, 3.0).item() == (ratio if active else 0.0)


def test_sequence_window_per_row_and_empty_rows_kept() -> None:
    # Row 0: log ratios [log 1.6, log 1.8] -> geometric mean sqrt(2.88) = 1.697, in [1.5, 2]: kept.
    # Row 1: one token of ratio 1 (and a masked 50): out of the window. Row 2: no masked token: kept.
    log_ratio = torch.log(t([[1.6, 1.8], [1.0, 50.0], [50.0, 50.0]]))
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])
    keep = sequence_in_window(log_ratio, mask, 1.5, 2.0)
    assert keep.tolist() == [[True, True], [False, False], [True, True]]


@pytest.mark.parametrize("name", ["tis", "centering"])
def test_a_ratio_at_the_cap_is_not_counted_as_truncated(name: str) -> None:
    # On-policy tokens (every stream equal): ratio exactly 1, and C = 1 truncates nothing.
    q = t([[-1.0, -2.0]], grad=True)
    head = torch.log(t([[[0.3, 0.2], [0.1, 0.05]]]))
    inputs = LossInputs(
        trainer_logp=q,
        sampler_logp=q.detach(),
        decode_logp=q.detach(),
        prefill_logp=q.detach(),
        advantages=t([[1.0, -1.0]]),
        mask=torch.ones(1, 2),
        num_tokens=2,
        sampler_topk_logp=head,
        trainer_topk_logp=head.clone().requires_grad_(),
    )
    _, metrics = policy_loss(inputs, CorrectionConfig(name=name, combine_with="tis", tis_cap=1.0))
    assert metrics["ratio/total/clip_frac"].item() == 0.0


def _centering_batch(**bad: tuple[tuple[int, ...], float]) -> LossInputs:
    """Two tokens with top-2 heads; `bad` puts one value at one index of the named stream."""
    q = t([[-1.0, -0.7]])
    fields: dict[str, torch.Tensor] = {
        "sampler_logp": q - 0.1,
        "decode_logp": q.clone(),
        "prefill_logp": q.clone(),
        "sampler_topk_logp": torch.log(t([[[0.4, 0.3], [0.5, 0.2]]])),
        "trainer_topk_logp": torch.log(t([[[0.35, 0.3], [0.5, 0.25]]])),
    }
    for name, (index, value) in bad.items():
        fields[name][index] = value
    return LossInputs(
        trainer_logp=q.requires_grad_(),
        advantages=t([[1.0, -2.0]]),
        mask=torch.ones(1, 2),
        num_tokens=2,
        trainer_topk_logp=fields.pop("trainer_topk_logp").requires_grad_(),
        **fields,
    )


@pytest.mark.parametrize(
    ("stream", "index", "value"),
    [
        (
            "sampler_logp",
            (0, 1),
            math.nan,
        ),  # a non-finite stream drops the token even when the heads are fine
        ("sampler_topk_logp", (0, 1, 0), math.inf),  # +inf in a head is not a legitimate -inf
        ("sampler_topk_logp", (0, 1, 1), math.nan),
        ("trainer_topk_logp", (0, 1, 0), math.nan),
    ],
)
def test_a_non_finite_head_drops_its_token_only(stream: str, index: tuple[int, ...], value: float) -> None:
    cfg = CorrectionConfig(name="centering")
    clean = _centering_batch()
    clean.mask = torch.tensor([[1, 0]])
    expected, _ = policy_loss(clean, cfg)
    dirty = _centering_batch(**{stream: (index, value)})
    loss, metrics = policy_loss(dirty, cfg)
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-15) and expected.item() != 0.0
    assert metrics["loss/nonfinite_tokens"].item() == 1
    assert (
        torch.isfinite(dirty.trainer_logp.grad).all() and torch.isfinite(dirty.trainer_topk_logp.grad).all()
    )
    # The dropped token's streams are 0 and its heads -inf (no mass), as CorrectionBatch documents.
    batch = prepare(dirty)
    assert batch.valid.tolist() == [[True, False]]
    assert batch.logp[0, 1].item() == 0.0
    for head in (batch.trainer_head, batch.sampler_head):
        assert head is not None and torch.equal(head[0, 1], torch.full((2,), -math.inf, dtype=F64))

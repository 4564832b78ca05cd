"""policy_loss per correction against hand-worked values on one three-token sequence (see _builders):

    token           0      1      2
    q              -1     -2    -0.5
    A               1     -2     0.5
    trainer ratio  1.5    1.0    0.5     (= lag ratio q / old, old defaulting to prefill)
    numerical      2.0    0.8    0.4     (decode x sampler)
    total          3.0    0.8    0.2
    num_tokens = 4 (global count: another micro-batch holds one more token)

If a change breaks one of these, it changes the gradient a training run receives.
"""

from __future__ import annotations

import re

import pytest
import torch

from rlfw.algos import CorrectionConfig, LossInputs, policy_loss, ratio_report
from rlfw.algos.ppo import ppo_surrogate
from rlfw.algos.weights import ppo_weight

from ._builders import ADV, NUM_TOKENS, R_DECODE, R_SAMPLER, R_TRAINER, Q, streams, t, three_tokens

CASES = [
    # none: loss = -sum(A q) / 4 = -(1*-1 + -2*-2 + 0.5*-0.5) / 4 = -(2.75) / 4; grad = -A / 4
    ("none", {}, -0.6875, [-0.25, 0.5, -0.125], {}),
    # tis C=2 on total: w = [2, 0.8, 0.2]; loss = -(2*-1 + 0.8*4 + 0.2*-0.25) / 4 = -1.15 / 4; grad = -w A / 4
    ("tis", {}, -0.2875, [-0.5, 0.4, -0.025], {"ratio/total/clip_frac": 1 / 3}),
    # tis on the sampler factor only: w = [2, 1, 0.4]; loss = -(-2 + 4 - 0.1) / 4 = -0.475
    ("tis", {"factors": ("sampler",)}, -0.475, [-0.5, 0.5, -0.05], {"ratio/sampler/clip_frac": 0.0}),
    # tis on trainer x sampler: w = [min(3, 2), 1, 0.2]; loss = -(-2 + 4 - 0.05) / 4 = -0.4875
    (
        "tis",
        {"factors": ("sampler", "trainer")},
        -0.4875,
        [-0.5, 0.5, -0.025],
        {"ratio/trainer+sampler/clip_frac": 1 / 3},
    ),
    # mis token [0.5, 2] on total: keep token 1 only, w = [0, 0.8, 0]; loss = -(0.8 * 4) / 4 = -0.8
    ("mis", {}, -0.8, [0.0, 0.4, 0.0], {"ratio/total/mask_frac": 2 / 3}),
    # mis sequence, default window (0.999, 1.001): geometric mean (3 * 0.8 * 0.2)^(1/3) = 0.783 -> all dropped
    ("mis", {"mis_level": "sequence"}, 0.0, [0.0, 0.0, 0.0], {"ratio/total/mask_frac": 1.0}),
    # mis sequence, window (0.5, 2): 0.783 kept; tokens keep their own ratio w = [3, 0.8, 0.2]
    # loss = -(3*-1 + 0.8*4 + 0.2*-0.25) / 4 = -0.15 / 4
    ("mis", {"mis_level": "sequence", "mis_bounds": (0.5, 2.0)}, -0.0375, [-0.75, 0.4, -0.025], {}),
    # icepop [0.5, 5] on numerical [2, 0.8, 0.4]: token 2 dropped; PPO on lag r = [1.5, 1, 0.5], eps 0.2:
    # token 0: A > 0, r > 1.2 -> clipped value -1.2 (no grad); token 1: -A r = 2, grad -A r = 2.
    # loss = (2 * -1.2 + 0.8 * 2) / 4 = -0.2; grad = [0, 0.8 * 2 / 4, 0]
    ("icepop", {}, -0.2, [0.0, 0.4, 0.0], {"ratio/numerical/mask_frac": 1 / 3, "ratio/lag/clip_frac": 1 / 3}),
    # icepop with `factors` set masks that product, not the numerical ratio: sampler factor [2, 1, 0.4],
    # token 2 dropped; same PPO on the lag. loss = (2 * -1.2 + 1 * 2) / 4 = -0.1; grad = [0, 1 * 2 / 4, 0]
    (
        "icepop",
        {"factors": ("sampler",)},
        -0.1,
        [0.0, 0.5, 0.0],
        {"ratio/sampler/mask_frac": 1 / 3, "ratio/lag/clip_frac": 1 / 3},
    ),
    # ppo_sampler, eps 0.2: token 0 clipped -1.2; token 1: 2; token 2: A > 0, r = 0.5 below the window is not
    # clipped for a positive advantage: max(-0.25, -0.4) = -0.25. loss = (-1.2 + 2 - 0.25) / 4 = 0.1375
    # grad = -A r / 4 on unclipped tokens = [0, 2/4, -0.25/4]
    ("ppo_sampler", {}, 0.1375, [0.0, 0.5, -0.0625], {"ratio/lag/clip_frac": 1 / 3}),
    # asymmetric: clip_eps_high 0.6 lets token 0 (r = 1.5 <= 1.6) through: (-1.5 + 2 - 0.25) / 4 = 0.0625
    ("ppo_sampler", {"clip_eps_high": 0.6}, 0.0625, [-0.375, 0.5, -0.0625], {"ratio/lag/clip_frac": 0.0}),
]


@pytest.mark.parametrize(("name", "overrides", "loss", "grad", "fracs"), CASES)
def test_policy_loss_closed_form(
    name: str, overrides: dict[str, object], loss: float, grad: list[float], fracs: dict[str, float]
) -> None:
    inputs = three_tokens()
    value, metrics = policy_loss(inputs, CorrectionConfig(name=name, **overrides))
    assert value.item() == pytest.approx(loss, abs=1e-12)
    value.backward()
    assert torch.allclose(inputs.trainer_logp.grad, t([grad]), atol=1e-12)
    for key, frac in fracs.items():
        assert metrics[key].item() == pytest.approx(frac)
    assert metrics["loss/policy"].item() == pytest.approx(loss, abs=1e-12)


@pytest.mark.parametrize(
    ("ratio", "adv", "dual_clip", "loss", "grad"),
    [
        (1.1, 1.0, None, -1.1, -1.1),  # inside the window: -A r, d/dlog r = -A r
        (1.5, 1.0, None, -1.2, 0.0),  # A > 0 above 1 + eps: flat at -1.2
        (0.5, 1.0, None, -0.5, -0.5),  # A > 0 below 1 - eps: min(rA, clip A) = rA, still has gradient
        (1.2, 1.0, None, -1.2, -1.2),  # A > 0 at exactly 1 + eps: the clip has not taken over yet
        (0.8, -1.0, None, 0.8, 0.8),  # A < 0 at exactly 1 - eps: likewise
        (0.5, -1.0, None, 0.8, 0.0),  # A < 0 below 1 - eps: flat at -clip(r) A = 0.8
        (4.0, -1.0, None, 4.0, 4.0),  # A < 0 far above: unbounded without dual clip
        (4.0, -1.0, 3.0, 3.0, 0.0),  # dual clip c = 3 caps it at -c A = 3
        (2.0, -1.0, 3.0, 2.0, 2.0),  # below c the dual clip does nothing
    ],
)
def test_ppo_surrogate_and_its_score_weight(
    ratio: float, adv: float, dual_clip: float | None, loss: float, grad: float
) -> None:
    log_ratio = torch.log(t([ratio])).requires_grad_()
    value, clipped = ppo_surrogate(log_ratio, t([adv]), 0.2, 0.2, dual_clip)
    value.sum().backward()
    assert value.item() == pytest.approx(loss)
    assert log_ratio.grad.item() == pytest.approx(grad)
    assert clipped.item() == (grad == 0.0)
    # The score-function form used by centering and dlc has the same gradient: -sg(w) A d log q.
    w = ppo_weight(t([ratio]), t([adv]), 0.2, 0.2, dual_clip)
    assert (-w * adv).item() == pytest.approx(grad)


@pytest.mark.parametrize("name", ["none", "tis", "mis", "icepop", "ppo_sampler"])
def test_gradient_reaches_only_the_trainer_stream(name: str) -> None:
    base = three_tokens()
    streams = ("trainer_logp", "sampler_logp", "decode_logp", "prefill_logp")
    leaves = {k: getattr(base, k).detach().clone().requires_grad_() for k in streams}
    leaves["advantages"] = t([[1.0, -2.0, 0.5]], grad=True)
    old = (leaves["prefill_logp"].detach() + 0.1).requires_grad_()
    inputs = LossInputs(**leaves, old_logp=old, mask=torch.ones(1, 3), num_tokens=NUM_TOKENS)
    loss, _ = policy_loss(inputs, CorrectionConfig(name=name, mis_bounds=(0.1, 10.0)))
    loss.backward()
    assert leaves["trainer_logp"].grad is not None and leaves["trainer_logp"].grad.abs().sum() > 0
    for key in ("sampler_logp", "decode_logp", "prefill_logp", "advantages"):
        assert leaves[key].grad is None, key
    assert old.grad is None


def test_old_logp_is_the_ppo_reference() -> None:
    # old = q - log 1.1 for every token: r = 1.1 inside the window everywhere.
    q = t([[-1.0, -2.0, -0.5]])
    inputs, cfg = three_tokens(old_logp=q - torch.log(t(1.1))), CorrectionConfig(name="ppo_sampler")
    loss, _ = policy_loss(inputs, cfg)
    # loss = -sum(A r) / 4 = -1.1 * (1 - 2 + 0.5) / 4 = 0.1375
    assert loss.item() == pytest.approx(0.1375)
    metrics = ratio_report(inputs, cfg)
    assert metrics["ratio/lag/mean"].item() == pytest.approx(1.1)
    assert metrics["ratio/trainer/mean"].item() == pytest.approx(1.0)  # (1.5 + 1 + 0.5) / 3: prefill, not old


def test_metrics_closed_form() -> None:
    m = ratio_report(three_tokens(), CorrectionConfig(name="none"))
    for f in ("trainer", "decode", "sampler", "total", "lag"):
        for stat in ("mean", "max_abs_log", "k3_kl", "hist"):
            assert f"ratio/{f}/{stat}" in m
    assert m["ratio/total/mean"].item() == pytest.approx(4.0 / 3.0)  # (3 + 0.8 + 0.2) / 3
    assert m["ratio/decode/mean"].item() == pytest.approx(2.8 / 3.0)  # (1 + 0.8 + 1) / 3
    assert torch.allclose(m["ratio/sampler/hist"], torch.log(t([2.0, 1.0, 0.4])))
    # ESS/N of the total: (3 + 0.8 + 0.2)^2 / (3 * (9 + 0.64 + 0.04)) = 16 / 29.04
    assert m["ess/total"].item() == pytest.approx(16 / 29.04)
    # ESS/N of the lag [1.5, 1, 0.5]: 9 / (3 * 3.5)
    assert m["ess/lag"].item() == pytest.approx(9 / 10.5)
    assert all(not v.requires_grad for v in m.values())


@pytest.mark.parametrize(
    ("reference", "numerical", "mask_frac"),
    [
        # window [0.9, 2.5]. Against the prefill stream (async default) the numerical ratio is
        # decode x sampler = [2, 0.8, 0.4]: tokens 1 and 2 dropped.
        ("prefill", [2.0, 0.8, 0.4], 2 / 3),
        # Against the decode stream (in-flight updates) the decode factor belongs to the lag, so the
        # numerical ratio is the sampler factor [2, 1, 0.4]: only token 2 dropped.
        ("decode", [2.0, 1.0, 0.4], 1 / 3),
        # Against the trainer's scoring pass (no bitwise contract) it is the total [3, 0.8, 0.2]: all dropped.
        ("score", [3.0, 0.8, 0.2], 1.0),
    ],
)
def test_icepop_masks_reference_over_sampler(
    reference: str, numerical: list[float], mask_frac: float
) -> None:
    base = three_tokens()
    old = {"prefill": base.prefill_logp, "decode": base.decode_logp, "score": base.trainer_logp.detach()}
    inputs = three_tokens(old_logp=old[reference].clone())
    cfg = CorrectionConfig(name="icepop", icepop_bounds=(0.9, 2.5))
    loss, metrics = policy_loss(inputs, cfg)
    assert metrics["ratio/numerical/mask_frac"].item() == pytest.approx(mask_frac)
    assert torch.allclose(ratio_report(inputs, cfg)["ratio/numerical/hist"], torch.log(t(numerical)))
    # The loss is the kept numerical weight times the PPO surrogate on the lag q / old.
    ratio = t(numerical)
    keep = (ratio >= 0.9) & (ratio <= 2.5)
    surrogate, _ = ppo_surrogate(inputs.trainer_logp.detach() - inputs.old_logp, t(ADV), 0.2, 0.2, None)
    expected = (torch.where(keep, ratio, torch.zeros_like(ratio)) * surrogate).sum() / NUM_TOKENS
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)


def test_metrics_cover_the_ratio_a_correction_acts_on() -> None:
    m = ratio_report(three_tokens(), CorrectionConfig(name="icepop"))
    assert m["ratio/numerical/mean"].item() == pytest.approx(3.2 / 3)  # (2 + 0.8 + 0.4) / 3
    # a product of factors that is neither one factor nor the total gets its own name:
    # trainer x sampler = [3, 1, 0.2], mean 4.2 / 3
    m = ratio_report(three_tokens(), CorrectionConfig(name="tis", factors=("sampler", "trainer")))
    assert m["ratio/trainer+sampler/mean"].item() == pytest.approx(4.2 / 3)
    assert torch.allclose(m["ratio/trainer+sampler/hist"], torch.log(t([3.0, 1.0, 0.2])))


def test_ess_counts_only_valid_tokens() -> None:
    # token 2 masked. ESS/N of the lag [1.5, 1]: 2.5^2 / (2 * 3.25);
    # of the total [3, 0.8]: 3.8^2 / (2 * 9.64)
    m = ratio_report(three_tokens(mask=torch.tensor([[1, 1, 0]])), CorrectionConfig())
    assert m["ess/lag"].item() == pytest.approx(6.25 / 6.5)
    assert m["ess/total"].item() == pytest.approx(3.8**2 / 19.28)


# Lag ratios with a negative-advantage token far above the clip: q / old = [1.1, 4, 0.5], A = [1, -2, 0.5];
# the numerical ratio (decode x sampler) stays [2, 0.8, 0.4].
R_LAG = [[1.1, 4.0, 0.5]]


@pytest.mark.parametrize(
    ("name", "loss", "grad"),
    [
        # token 0: -1.1, grad -1.1; token 1: min(-A r = 8, -c A = 6) = 6, no grad; token 2: max(-0.25, -0.4)
        # loss = (-1.1 + 6 - 0.25) / 4 = 1.1625; grad = [-1.1, 0, -0.25] / 4
        ("ppo_sampler", 1.1625, [-0.275, 0.0, -0.0625]),
        # numerical [2, 0.8, 0.4] in [0.5, 5]: token 2 dropped; loss = (2 * -1.1 + 0.8 * 6) / 4 = 0.65
        ("icepop", 0.65, [-0.55, 0.0, 0.0]),
    ],
)
def test_dual_clip_bounds_negative_advantage_losses(name: str, loss: float, grad: list[float]) -> None:
    inputs = three_tokens(**streams(t(Q), R_LAG, R_DECODE, R_SAMPLER))
    value, metrics = policy_loss(inputs, CorrectionConfig(name=name, dual_clip=3.0))
    value.backward()
    assert value.item() == pytest.approx(loss, abs=1e-12)
    assert torch.allclose(inputs.trainer_logp.grad, t([grad]), atol=1e-12)
    assert metrics["ratio/lag/clip_frac"].item() == pytest.approx(1 / 3)  # token 1


def test_sequence_level_mis_judges_each_sequence_by_its_masked_geometric_mean() -> None:
    # Row 0: the three tokens, total ratios [3, 0.8, 0.2]: geometric mean 0.48^(1/3) = 0.783 (the arithmetic
    # mean, 1.33, would leave the window). Row 1: two tokens of ratio 0.4 and a padding position with ratio
    # 50: geometric mean 0.4 over its masked tokens, dropped (over all three positions it would be
    # 0.16^(1/3) = 0.54, kept). Window [0.5, 1.2].
    q = t([Q[0], [-1.0, -1.5, -0.3]], grad=True)
    fields = streams(q, [R_TRAINER[0], [0.4, 0.4, 50.0]], [R_DECODE[0], [1.0] * 3], [R_SAMPLER[0], [1.0] * 3])
    inputs = LossInputs(
        trainer_logp=q,
        advantages=t([ADV[0], [2.0, -1.0, 7.0]]),
        mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
        num_tokens=5,
        **fields,
    )
    cfg = CorrectionConfig(name="mis", mis_level="sequence", mis_bounds=(0.5, 1.2))
    loss, metrics = policy_loss(inputs, cfg)
    loss.backward()
    # row 0 kept with its token ratios: -(3 * 1 * -1 + 0.8 * -2 * -2 + 0.2 * 0.5 * -0.5) / 5 = 0.15 / 5
    assert loss.item() == pytest.approx(-0.03, abs=1e-12)
    assert torch.allclose(q.grad, t([[-0.6, 0.32, -0.02], [0.0, 0.0, 0.0]]), atol=1e-12)
    assert metrics["ratio/total/mask_frac"].item() == pytest.approx(2 / 5)


def test_seq_mean_aggregation() -> None:
    # Two sequences: [q = -1, -2, -0.5 | A = 1, -2, 0.5] and [q = -3 (one token) | A = 2]; none: loss -A q.
    q = t([[-1.0, -2.0, -0.5], [-3.0, 0.0, 0.0]], grad=True)
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = t([[1.0, -2.0, 0.5], [2.0, 0.0, 0.0]])
    fields = {"sampler_logp": q.detach(), "decode_logp": q.detach(), "prefill_logp": q.detach() + zeros}
    inputs = LossInputs(trainer_logp=q, advantages=adv, mask=mask, num_tokens=4, num_sequences=4, **fields)
    loss, _ = policy_loss(inputs, CorrectionConfig(aggregation="seq_mean"))
    # per-sequence means: -(2.75) / 3 and -(-6) / 1 = 6; summed over the 4 global sequences: (6 - 0.91667) / 4
    assert loss.item() == pytest.approx((6 - 2.75 / 3) / 4)
    token_loss, _ = policy_loss(inputs, CorrectionConfig(aggregation="token_mean"))
    assert token_loss.item() == pytest.approx((6 - 2.75) / 4)  # sum -A q over 4 tokens / 4


def test_seq_mean_needs_num_sequences() -> None:
    with pytest.raises(ValueError, match="^correction.aggregation=seq_mean needs LossInputs.num_sequences"):
        policy_loss(three_tokens(), CorrectionConfig(aggregation="seq_mean"))


def test_micro_batches_add_up_to_the_full_batch() -> None:
    # The token count is passed in, not taken from the micro-batch: two halves sum to the whole.
    cfg = CorrectionConfig(name="tis")
    full = three_tokens()
    whole, _ = policy_loss(full, cfg)
    whole.backward()
    parts = []
    for keep in ([1, 1, 0], [0, 0, 1]):
        part = three_tokens(mask=torch.tensor([keep]))
        value, _ = policy_loss(part, cfg)
        value.backward()
        parts.append((value, part.trainer_logp.grad))
    assert (parts[0][0] + parts[1][0]).item() == pytest.approx(whole.item(), abs=1e-15)
    assert torch.allclose(parts[0][1] + parts[1][1], full.trainer_logp.grad, atol=1e-15)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_tokens_are_dropped_counted_and_keep_gradients_finite(bad: float) -> None:
    clean = three_tokens(mask=torch.tensor([[1, 0, 1]]))
    expected, _ = policy_loss(clean, CorrectionConfig(name="tis"))
    sampler = three_tokens().sampler_logp.clone()
    sampler[0, 1] = bad
    dirty = three_tokens(sampler_logp=sampler)
    loss, metrics = policy_loss(dirty, CorrectionConfig(name="tis"))
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-15)
    assert metrics["loss/nonfinite_tokens"].item() == 1
    assert torch.isfinite(dirty.trainer_logp.grad).all() and dirty.trainer_logp.grad[0, 1] == 0
    assert torch.isfinite(ratio_report(dirty, CorrectionConfig(name="tis"))["ratio/total/mean"])


def test_mask_accepts_float_zero_one() -> None:
    a, _ = policy_loss(three_tokens(mask=torch.tensor([[1.0, 0.0, 1.0]])), CorrectionConfig(name="tis"))
    b, _ = policy_loss(three_tokens(mask=torch.tensor([[True, False, True]])), CorrectionConfig(name="tis"))
    assert a.item() == b.item() != 0.0


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("advantages", torch.zeros(1, 4), "LossInputs.advantages has shape"),
        ("trainer_topk_logp", torch.zeros(1, 3, 2), "top-k tensors must all be"),
        ("num_tokens", 0, "num_tokens must be > 0"),
        ("num_sequences", 0, "num_sequences must be > 0"),
        ("trainer_logp", t([-1.0, -2.0, -0.5]), "trainer_logp must be \\[B, T\\], got shape \\(3,\\)"),
    ],
)
def test_loss_inputs_validation(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        three_tokens(**{field: value, "sampler_topk_logp": torch.zeros(1, 3, 3)})


@pytest.mark.parametrize("shape", [(1, 3), (1, 4, 2), (2, 3, 2)])
def test_a_top_k_tensor_not_shaped_b_t_k_is_refused_alone(shape: tuple[int, ...]) -> None:
    # the message names the expected [B, T, k] and what was found
    found = re.escape(str([shape]))
    with pytest.raises(ValueError, match=rf"top-k tensors must all be \[1, 3, k\], got {found}"):
        three_tokens(sampler_topk_logp=torch.zeros(shape))


@pytest.mark.parametrize("name", ["centering", "dlc"])
@pytest.mark.parametrize("given", [(), ("sampler_topk_logp",), ("trainer_topk_logp",)])
def test_head_corrections_without_top_k_name_the_missing_inputs(name: str, given: tuple[str, ...]) -> None:
    heads = {key: torch.zeros(1, 3, 2) for key in given}
    expected = f"correction.name={name} needs LossInputs.trainer_topk_logp and LossInputs.sampler_topk_logp"
    with pytest.raises(ValueError, match=re.escape(expected)):
        policy_loss(three_tokens(**heads), CorrectionConfig(name=name))


def test_dlc_without_the_reference_head_names_it() -> None:
    heads = {"sampler_topk_logp": torch.zeros(1, 3, 2), "trainer_topk_logp": torch.zeros(1, 3, 2)}
    with pytest.raises(ValueError, match="^correction.name=dlc needs LossInputs.reference_topk_logp"):
        policy_loss(three_tokens(**heads), CorrectionConfig(name="dlc"))


def test_sequence_ess_sees_a_spread_that_token_ess_hides() -> None:
    # 64 sequences of 256 tokens, per-token log lag ratios ~ N(0, 0.1^2): by token the weights look
    # almost uniform, by sequence (product of token ratios, log-variance 2.56) most of the batch is lost.
    g = torch.Generator().manual_seed(0)
    q = t([[0.0] * 256] * 64, grad=True)
    old = torch.randn(64, 256, generator=g, dtype=torch.float64) * 0.1
    fields = {name: q.detach() for name in ("sampler_logp", "decode_logp", "prefill_logp")}
    inputs = LossInputs(
        trainer_logp=q,
        old_logp=old,
        advantages=torch.ones(64, 256, dtype=torch.float64),
        mask=torch.ones(64, 256, dtype=torch.bool),
        num_tokens=64 * 256,
        **fields,
    )
    m = ratio_report(inputs, CorrectionConfig())
    assert m["ess/lag"].item() > 0.98
    assert m["ess/lag_seq"].item() < 0.3
    # a sequence's weight is the product of its token ratios: ESS over exp(sum of log ratios)
    w = torch.exp(-old.sum(-1))
    assert m["ess/lag_seq"].item() == pytest.approx((w.sum() ** 2 / (64 * (w * w).sum())).item())


def test_sequence_ess_counts_only_sequences_with_tokens() -> None:
    inputs = three_tokens(mask=torch.tensor([[True, True, False]]))
    m = ratio_report(inputs, CorrectionConfig())
    assert m["ess/lag_seq"].item() == pytest.approx(1.0)  # one sequence: ESS/N is 1
    assert m["ess/total_seq"].item() == pytest.approx(1.0)
    # ... and a padding row (no masked token) is not a sequence of weight 1: still one sequence, ESS/N 1
    q = t([Q[0], [-1.0, -1.0, -1.0]], grad=True)
    two_rows = streams(q, [R_TRAINER[0], [1.0] * 3], [R_DECODE[0], [1.0] * 3], [R_SAMPLER[0], [1.0] * 3])
    padded = LossInputs(
        trainer_logp=q,
        advantages=t([ADV[0], [0.0] * 3]),
        mask=torch.tensor([[1, 1, 1], [0, 0, 0]]),
        num_tokens=3,
        **two_rows,
    )
    m = ratio_report(padded, CorrectionConfig())
    assert m["ess/lag_seq"].item() == pytest.approx(1.0)
    assert m["ess/total_seq"].item() == pytest.approx(1.0)

"""The metric keys of design §6: what every step must carry, and nothing else is named."""

from __future__ import annotations

import pytest

from rlfw.logging import metrics as m


@pytest.mark.parametrize("moe", [False, True])
def test_required_keys_cover_every_ratio_statistic(moe: bool) -> None:
    keys = m.required_keys(moe)
    assert len(keys) == len(set(keys))
    for ratio in ("trainer", "decode", "sampler", "total", "lag"):
        for stat in ("mean", "max_abs_log", "k3_kl", "hist"):
            assert f"ratio/{ratio}/{stat}" in keys
    for key in ("ess/lag", "ess/total", "sync/resyncs", "sync/staleness_mean", "sync/version_gap_max"):
        assert key in keys
    for key in ("reward/mean", "loss/policy", "grad_norm", "throughput/tokens_per_s", "time/step"):
        assert key in keys
    assert ("router/replay_mismatch_frac" in keys) == moe


def test_correction_fractions_are_known_but_optional() -> None:
    required, known = set(m.required_keys(moe=True)), set(m.known_keys())
    assert required < known
    assert {"ratio/lag/clip_frac", "ratio/total/mask_frac"} <= known - required


def test_hist_keys_are_exactly_the_ratio_histograms() -> None:
    hist = [k for k in m.known_keys() if m.is_hist_key(k)]
    assert hist == [f"ratio/{r}/hist" for r in m.RATIOS]


@pytest.mark.parametrize(("ratio", "stat"), [("prefill", "mean"), ("lag", "median")])
def test_ratio_key_refuses_unknown_names(ratio: str, stat: str) -> None:
    with pytest.raises(ValueError, match="allowed"):
        m.ratio_key(ratio, stat)

"""CorrectionConfig: defaults, validation messages that name the key, and Hydra round trip."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from rlfw.algos import CORRECTIONS, CorrectionConfig
from rlfw.algos.config import CORRECTION_NAMES
from rlfw.validation import ConfigError


def test_registry_covers_every_name() -> None:
    assert tuple(CORRECTIONS) == CORRECTION_NAMES


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (
            {"name": "grpo"},
            "correction.name='grpo'",
            "none, tis, mis, icepop, centering, ppo_sampler, dlc",
        ),
        ({"factors": ("trainer", "kv")}, "correction.factors", "subset of trainer, decode, sampler"),
        ({"factors": ()}, "correction.factors", "non-empty"),
        ({"factors": ("decode", "decode")}, "correction.factors", "without repeats"),
        ({"name": "centering", "factors": ("sampler",)}, "correction.factors", "for correction centering"),
        ({"name": "dlc", "factors": ("trainer",)}, "correction.factors", "for correction dlc"),
        ({"mis_level": "batch"}, "correction.mis_level='batch'", "token, sequence"),
        ({"mis_bounds": (2.0, 0.5)}, "correction.mis_bounds", "0 <= lo < hi"),
        ({"icepop_bounds": (-1.0, 5.0)}, "correction.icepop_bounds", "0 <= lo < hi"),
        ({"combine_with": "icepop"}, "correction.combine_with='icepop'", "none, tis, mis, ppo"),
        ({"aggregation": "sum"}, "correction.aggregation='sum'", "token_mean, seq_mean"),
        ({"tis_cap": 0.0}, "correction.tis_cap=0.0", "> 0"),
        ({"clip_eps": 1.5}, "correction.clip_eps=1.5", "(0, 1)"),
        ({"clip_eps_high": -0.1}, "correction.clip_eps_high=-0.1", "> 0"),
        ({"dual_clip": 1.0}, "correction.dual_clip=1.0", "> 1"),
    ],
)
def test_validation_names_the_key_and_the_allowed_values(
    overrides: dict[str, object], key: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as err:
        CorrectionConfig(**overrides)
    assert key in str(err.value) and allowed in str(err.value)


def test_defaults_follow_the_design() -> None:
    cfg = CorrectionConfig()
    assert (cfg.tis_cap, cfg.clip_eps, cfg.clip_high) == (2.0, 0.2, 0.2)
    assert cfg.mis_window == (0.5, 2.0) and cfg.icepop_bounds == (0.5, 5.0)
    assert CorrectionConfig(mis_level="sequence").mis_window == (0.999, 1.001)
    assert CorrectionConfig(clip_eps_high=0.28).clip_high == 0.28
    assert cfg.selected_factors == ("trainer", "decode", "sampler")
    assert CorrectionConfig(name="icepop").on_numerical  # reference / sampler, whatever the reference
    assert not CorrectionConfig(name="icepop", factors=("decode", "sampler")).on_numerical
    assert CorrectionConfig(factors=("sampler", "trainer")).selected_factors == ("trainer", "sampler")


def test_hydra_round_trip_keeps_tuples() -> None:
    node = OmegaConf.merge(OmegaConf.structured(CorrectionConfig), {"name": "tis", "factors": ["sampler"]})
    cfg = OmegaConf.to_object(node)
    assert isinstance(cfg, CorrectionConfig)
    assert cfg.factors == ("sampler",) and cfg.icepop_bounds == (0.5, 5.0)
    with pytest.raises(ValueError, match="correction.name='bogus'"):
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(CorrectionConfig), {"name": "bogus"}))

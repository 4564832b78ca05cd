"""CorrectionConfig: defaults, validation messages that name the key, and Hydra round trip."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from rlfw.algos import CORRECTIONS, CorrectionConfig
from rlfw.algos.config import CORRECTION_NAMES
from rlfw.validation import ConfigError


def test_registry_covers_every_name() -> None:
    assert tuple(CORRECTIONS) == CORRECTION_NAMES


# `allowed` is the whole of what the message offers after "allowed: " / "choose one of: ": the user fixes
# the config from that one line (rlfw.validation), so it is checked in full, not as a fragment.
@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (
            {"name": "grpo"},
            "correction.name='grpo'",
            "none, tis, mis, icepop, centering, ppo_sampler, dlc",
        ),
        (
            {"factors": ("trainer", "kv")},
            "correction.factors=('trainer', 'kv')",
            "a non-empty subset of trainer, decode, sampler without repeats",
        ),
        (
            {"factors": ()},
            "correction.factors=()",
            "a non-empty subset of trainer, decode, sampler without repeats",
        ),
        (
            {"factors": ("decode", "decode")},
            "correction.factors=('decode', 'decode')",
            "a non-empty subset of trainer, decode, sampler without repeats",
        ),
        (
            {"name": "centering", "factors": ("sampler",)},
            "correction.factors=('sampler',)",
            "None or all of trainer, decode, sampler for correction centering",
        ),
        (
            {"name": "dlc", "factors": ("trainer",)},
            "correction.factors=('trainer',)",
            "None or all of trainer, decode, sampler for correction dlc",
        ),
        ({"mis_level": "batch"}, "correction.mis_level='batch'", "token, sequence"),
        ({"mis_bounds": (2.0, 0.5)}, "correction.mis_bounds=(2.0, 0.5)", "a pair (lo, hi) with 0 <= lo < hi"),
        ({"mis_bounds": (1.0, 1.0)}, "correction.mis_bounds=(1.0, 1.0)", "a pair (lo, hi) with 0 <= lo < hi"),
        (
            {"icepop_bounds": (-1.0, 5.0)},
            "correction.icepop_bounds=(-1.0, 5.0)",
            "a pair (lo, hi) with 0 <= lo < hi",
        ),
        ({"combine_with": "icepop"}, "correction.combine_with='icepop'", "none, tis, mis, ppo"),
        ({"aggregation": "sum"}, "correction.aggregation='sum'", "token_mean, seq_mean"),
        ({"tis_cap": 0.0}, "correction.tis_cap=0.0", "a number > 0 (inf for untruncated IS)"),
        ({"clip_eps": 1.5}, "correction.clip_eps=1.5", "a number in (0, 1)"),
        ({"clip_eps": 1.0}, "correction.clip_eps=1.0", "a number in (0, 1)"),
        ({"clip_eps": 0.0}, "correction.clip_eps=0.0", "a number in (0, 1)"),
        ({"clip_eps_high": -0.1}, "correction.clip_eps_high=-0.1", "None or a number > 0"),
        ({"clip_eps_high": 0.0}, "correction.clip_eps_high=0.0", "None or a number > 0"),
        ({"dual_clip": 1.0}, "correction.dual_clip=1.0", "None or a number > 1"),
    ],
)
def test_validation_names_the_key_and_the_allowed_values(
    overrides: dict[str, object], key: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as err:
        CorrectionConfig(**overrides)
    message = str(err.value)
    assert message.startswith(key) and message.endswith(allowed), message


@pytest.mark.parametrize(
    "overrides",
    [
        {"icepop_bounds": (0.0, 5.0)},  # lo = 0: no lower bound
        {"mis_bounds": (0.0, 2.0)},
        {"factors": ("trainer", "decode", "sampler")},  # all three, spelled out
        {"name": "centering", "factors": ("sampler", "decode", "trainer")},
        {"name": "dlc", "factors": ("trainer", "decode", "sampler")},
        {"dual_clip": 1.5},  # any c > 1, not only c >= 2
        {"clip_eps": 0.999, "clip_eps_high": 5.0},
    ],
)
def test_the_edges_of_each_allowed_range_are_accepted(overrides: dict[str, object]) -> None:
    CorrectionConfig(**overrides)


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

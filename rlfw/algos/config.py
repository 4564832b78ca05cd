"""The correction's config (`correction` group): which correction acts on which ratio factors, and its knobs.

Validation lives here so that a bad value fails when the config is built, with the key and the allowed
values in the message (:class:`~rlfw.validation.ConfigError`, as for every config class), not deep inside a
training step. Each field's trailing comment is its documentation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlfw.validation import ConfigError, bad_value, check_choice

FACTORS: tuple[str, ...] = ("trainer", "decode", "sampler")
CORRECTION_NAMES: tuple[str, ...] = ("none", "tis", "mis", "icepop", "centering", "ppo_sampler", "dlc")
MIS_LEVELS: tuple[str, ...] = ("token", "sequence")
COMBINE_WITH: tuple[str, ...] = ("none", "tis", "mis", "ppo")
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean")

# Defaults follow the strongest public settings: token-level bounds act on one token's ratio, sequence-level
# bounds on the geometric mean over a sequence, which concentrates near 1, hence the much tighter window.
MIS_DEFAULT_BOUNDS: dict[str, tuple[float, float]] = {"token": (0.5, 2.0), "sequence": (0.999, 1.001)}

# Corrections whose ratio, when `factors` is left unset, is the numerical ratio reference / sampler (the
# total minus the lag) rather than a product of factors: IcePop masks the numerical discrepancy and leaves
# policy lag to its PPO clip, whichever stream the PPO reference is.
NUMERICAL_BY_DEFAULT: tuple[str, ...] = ("icepop",)

# Corrections whose ratio split is part of their definition: centering compares trainer and sampler
# probabilities over the sampler's top-k (the total ratio); dlc centres decode+sampler and clips the lag.
FIXED_FACTORS: dict[str, tuple[str, ...]] = {"centering": FACTORS, "dlc": FACTORS}


def _bad(key: str, value: Any, allowed: str) -> ConfigError:
    return bad_value(f"correction.{key}", value, allowed)


def _check_bounds(key: str, value: tuple[float, float] | None) -> None:
    if value is None:
        return
    if len(value) != 2 or not 0.0 <= value[0] < value[1]:
        raise _bad(key, value, "a pair (lo, hi) with 0 <= lo < hi")


@dataclass
class CorrectionConfig:
    """How the policy loss corrects for the gap between the sampler's and the trainer's distributions."""

    name: str = "none"  # none | tis | mis | icepop | centering | ppo_sampler | dlc
    factors: tuple[str, ...] | None = None  # factors the ratio covers (of trainer, decode, sampler); None=all
    tis_cap: float = 2.0  # TIS truncation C: the weight is min(ratio, C); inf gives untruncated IS
    mis_level: str = "token"  # MIS granularity: token (mask tokens) | sequence (by the geometric-mean ratio)
    mis_bounds: tuple[float, float] | None = None  # MIS window; None: (0.5, 2) token, (0.999, 1.001) seq
    icepop_bounds: tuple[float, float] = (0.5, 5.0)  # IcePop keep window [alpha, beta] on reference/sampler
    combine_with: str = "none"  # weight inside score centering: none (unit weights) | tis | mis | ppo
    clip_eps: float = 0.2  # PPO clip epsilon (lower side, and upper side unless clip_eps_high is set)
    clip_eps_high: float | None = None  # PPO upper clip epsilon for asymmetric clipping; None: clip_eps
    dual_clip: float | None = None  # dual-clip constant c > 1 bounding negative-advantage losses; None: off
    aggregation: str = "token_mean"  # token_mean (sum / global tokens) | seq_mean (sequence means)

    def __post_init__(self) -> None:
        # Hydra hands sequences over as lists; keep tuples so the config stays hashable and comparable.
        if self.factors is not None:
            self.factors = tuple(self.factors)
        if self.mis_bounds is not None:
            self.mis_bounds = (float(self.mis_bounds[0]), float(self.mis_bounds[1]))
        self.icepop_bounds = (float(self.icepop_bounds[0]), float(self.icepop_bounds[1]))
        check_choice("correction.name", self.name, CORRECTION_NAMES)
        check_choice("correction.mis_level", self.mis_level, MIS_LEVELS)
        check_choice("correction.combine_with", self.combine_with, COMBINE_WITH)
        check_choice("correction.aggregation", self.aggregation, AGGREGATIONS)
        self._check_factors()
        _check_bounds("mis_bounds", self.mis_bounds)
        _check_bounds("icepop_bounds", self.icepop_bounds)
        self._check_numbers()

    def _check_factors(self) -> None:
        if self.factors is None:
            return
        if (
            not self.factors
            or len(set(self.factors)) != len(self.factors)
            or not set(self.factors) <= set(FACTORS)
        ):
            raise _bad("factors", self.factors, f"a non-empty subset of {', '.join(FACTORS)} without repeats")
        fixed = FIXED_FACTORS.get(self.name)
        if fixed is not None and set(self.factors) != set(fixed):
            raise _bad(
                "factors", self.factors, f"None or all of {', '.join(fixed)} for correction {self.name}"
            )

    def _check_numbers(self) -> None:
        if not self.tis_cap > 0:
            raise _bad("tis_cap", self.tis_cap, "a number > 0 (inf for untruncated IS)")
        if not 0 < self.clip_eps < 1:
            raise _bad("clip_eps", self.clip_eps, "a number in (0, 1)")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            raise _bad("clip_eps_high", self.clip_eps_high, "None or a number > 0")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise _bad("dual_clip", self.dual_clip, "None or a number > 1")

    @property
    def selected_factors(self) -> tuple[str, ...]:
        """The factors this correction's ratio covers, in canonical order (trainer, decode, sampler)."""
        chosen = self.factors or FACTORS
        return tuple(f for f in FACTORS if f in chosen)

    @property
    def on_numerical(self) -> bool:
        """Whether the correction's ratio is the numerical one, reference / sampler (IcePop by default)."""
        return self.factors is None and self.name in NUMERICAL_BY_DEFAULT

    @property
    def mis_window(self) -> tuple[float, float]:
        """The MIS keep window, with the level's default filled in."""
        return self.mis_bounds if self.mis_bounds is not None else MIS_DEFAULT_BOUNDS[self.mis_level]

    @property
    def clip_high(self) -> float:
        """The PPO upper clip epsilon."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

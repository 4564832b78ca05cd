"""The one error type a bad config value raises, and the checks every config class uses.

Each message names the full key (``engine.max_slots``), the value given and what is allowed, so the user
can fix it from the one line ``rlfw`` prints. Imports nothing of rlfw, so every config class (the run's and
the correction's, below it in ``rlfw.algos``) can use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A config value or key rlfw cannot run with; the message names the key and what is allowed."""


def bad_value(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} is not allowed; allowed: {allowed}")


def check_choice(key: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def check_range(key: str, value: float, lo: float | None = None, hi: float | None = None) -> None:
    """``lo <= value <= hi`` (either bound may be open-ended); NaN is always out of range."""
    if value != value or (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise ConfigError(f"{key}={value!r} is out of range; allowed: {bounds}")

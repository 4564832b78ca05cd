"""The resync rule as a truth table."""

from __future__ import annotations

import math

import pytest

from rlfw.algos import should_resync

NAN = math.nan

# (policy, step_since_sync, lag_ess, interval, staleness, max_staleness) -> resync?; ess_threshold = 0.5
TABLE = [
    ("every_step", 0, 1.0, 4, 0, None, True),
    ("every_step", 3, 0.9, 4, 1, 8, True),
    ("interval", 1, 0.1, 4, 1, None, False),  # low ESS is not this policy's business
    ("interval", 3, 1.0, 4, 3, None, False),
    ("interval", 4, 1.0, 4, 4, None, True),  # reached the interval
    ("interval", 5, 1.0, 4, 5, None, True),
    ("interval", 1, 1.0, 1, 1, None, True),  # interval 1 is allowed: sync after every step
    ("ess", 10, 0.6, 4, 10, None, False),  # ESS healthy: keep going however long
    ("ess", 1, 0.5, 4, 1, None, False),  # at the threshold is not below it
    ("ess", 1, 0.49, 4, 1, None, True),
    ("ess", 1, NAN, 4, 1, None, True),  # undefined ESS resyncs
    ("ess", 2, 0.9, 4, 2, 3, False),  # below the hard bound
    ("ess", 3, 0.9, 4, 3, 3, True),  # the hard bound wins over a healthy ESS
    ("interval", 2, 1.0, 4, 2, 2, True),  # ... and over the interval
    ("interval", 0, 1.0, 4, 0, 0, True),  # max_staleness 0: synchronous whatever the policy
]


@pytest.mark.parametrize(
    ("policy", "since", "lag_ess", "interval", "staleness", "max_staleness", "expected"), TABLE
)
def test_resync_truth_table(
    policy: str,
    since: int,
    lag_ess: float,
    interval: int,
    staleness: int,
    max_staleness: int | None,
    expected: bool,
) -> None:
    assert should_resync(policy, since, lag_ess, interval, 0.5, staleness, max_staleness) is expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "adaptive"}, "sync.policy='adaptive'.*every_step \\| interval \\| ess"),
        ({"interval": 0}, "sync.interval=0"),
        ({"max_staleness": -1}, "sync.max_staleness=-1"),
    ],
)
def test_resync_validation(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "policy": "interval",
        "step_since_sync": 1,
        "lag_ess": 1.0,
        "interval": 2,
        "ess_threshold": 0.5,
        "staleness": 1,
        "max_staleness": None,
    }
    with pytest.raises(ValueError, match=match):
        should_resync(**{**args, **kwargs})

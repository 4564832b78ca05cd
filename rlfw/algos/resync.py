"""When to push the trainer's weights to the rollout engines (`sync.policy`, design §3)."""

from __future__ import annotations

import math

RESYNC_POLICIES: tuple[str, ...] = ("every_step", "interval", "ess")


def should_resync(
    policy: str,
    step_since_sync: int,
    lag_ess: float,
    interval: int,
    ess_threshold: float,
    staleness: int,
    max_staleness: int | None,
) -> bool:
    """Whether to sync weights now, checked after each optimizer step.

    - `every_step`: always (synchronous, on-policy);
    - `interval`: when `step_since_sync` (optimizer steps since the last sync) has reached `interval`;
    - `ess`: when `lag_ess`, the ESS/N of the lag ratio on the last batch, is below `ess_threshold`; a NaN
      ESS (no valid token, or degenerate weights) also resyncs, as the lag cannot be vouched for.
    Whatever the policy, `max_staleness` is a hard bound: when the engine's weights are `staleness`
    versions behind the trainer and that has reached `max_staleness`, sync now, so the engine never runs
    more than `max_staleness` versions behind (0 makes every policy synchronous). None = unbounded.
    """
    if policy not in RESYNC_POLICIES:
        raise ValueError(f"sync.policy={policy!r} is not valid; allowed: {' | '.join(RESYNC_POLICIES)}")
    if interval < 1:
        raise ValueError(f"sync.interval={interval!r} is not valid; allowed: an integer >= 1")
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(
            f"sync.max_staleness={max_staleness!r} is not valid; allowed: None or an integer >= 0"
        )
    if max_staleness is not None and staleness >= max_staleness:
        return True
    if policy == "every_step":
        return True
    if policy == "interval":
        return step_since_sync >= interval
    return math.isnan(lag_ess) or lag_ess < ess_threshold

"""Scoring a batch of responses without letting one failing reward call end the run."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from rlfw.tasks.base import Problem, Task

log = logging.getLogger(__name__)


@dataclass
class RewardResult:
    """Rewards per response; ``None`` marks a sample whose reward call failed (to be dropped)."""

    rewards: list[float | None]
    errors: list[str] = field(default_factory=list)
    parts: dict[str, list[float]] = field(default_factory=dict)  # each named reward, over the scored

    @property
    def num_failed(self) -> int:
        return sum(r is None for r in self.rewards)

    def part_means(self) -> dict[str, float]:
        """``reward/<name>``: the mean of each named reward over the samples it scored."""
        return {f"reward/{name}": sum(v) / len(v) for name, v in self.parts.items() if v}


def score(task: Task, problems: list[Problem], responses: list[str]) -> RewardResult:
    """Call the task's reward on each response; exceptions and non-finite values are counted, not raised.

    A task with several named rewards (``task=dataset``) scores the batch itself (``reward_batch``,
    maybe in worker processes) and gives each call's values by name, summed here with their weights."""
    batch = getattr(task, "reward_batch", None)
    if batch is not None:
        outcomes: list[float | dict[str, float] | str] = list(batch(problems, responses))
    else:
        outcomes = [_call(task, p, r) for p, r in zip(problems, responses, strict=True)]
    weights = {r.name: r.weight for r in getattr(task, "rewards", [])}
    rewards: list[float | None] = []
    errors: list[str] = []
    parts: dict[str, list[float]] = {}
    for problem, outcome in zip(problems, outcomes, strict=True):
        if isinstance(outcome, str):
            rewards.append(None)
            errors.append(f"problem {problem.uid}: {outcome}")
        elif isinstance(outcome, dict):
            rewards.append(sum(weights[k] * v for k, v in outcome.items()))
            for name, v in outcome.items():
                parts.setdefault(name, []).append(v)
        else:
            rewards.append(outcome)
    if errors:
        log.warning("%d reward call(s) failed; their samples are dropped. First: %s", len(errors), errors[0])
    return RewardResult(rewards, errors, parts)


def _call(task: Task, problem: Problem, response: str) -> float | str:
    """One reward call: its finite value, or why it failed."""
    try:
        value = float(task.reward(problem, response))
        if not math.isfinite(value):
            raise ValueError(f"reward returned {value}")
        return value
    except Exception as err:  # noqa: BLE001 - a user reward function may raise anything
        return f"{type(err).__name__}: {err}"

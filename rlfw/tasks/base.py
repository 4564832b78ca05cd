"""What a task is: a source of problems and a reward for a decoded response."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Problem:
    """One prompt with what the reward needs to check a response."""

    uid: int  # stable id of the problem within its task
    prompt: str  # the text the policy continues
    answer: str  # the reference answer the reward checks against


class Task(Protocol):
    """A verifiable task: problems to prompt with, and a reward in [0, 1] for a response."""

    name: str

    def sample(self, n: int, rng: random.Random) -> list[Problem]:
        """``n`` problems drawn with ``rng`` (reproducible for a seeded ``rng``)."""
        ...

    def reward(self, problem: Problem, response: str) -> float:
        """Reward of a decoded ``response`` (text up to, not including, the stop token)."""
        ...

    def demonstrations(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        """``(prompt, ideal response)`` pairs for a supervised warm start."""
        ...

    def eval_problems(self, n: int) -> list[Problem]:
        """The same ``n`` problems at every evaluation (a held-out split where the task has one)."""
        ...


EVAL_SEED = "eval"


def fixed_eval_problems(task: Task, n: int) -> list[Problem]:
    """For tasks without a split (generated problems, one file): ``n`` problems drawn with a fixed seed
    of their own, the same at every evaluation (they may also occur in training)."""
    return task.sample(n, random.Random(EVAL_SEED))

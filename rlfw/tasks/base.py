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

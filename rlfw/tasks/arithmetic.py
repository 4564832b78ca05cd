"""Addition of two small integers: learnable by the tiny model on one CPU within minutes.

Prompts look like ``"12+7="``, the ideal response is ``"19"`` followed by the stop token. The reward is
1 for the exact answer and 0 otherwise; a response that is not a number earns 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlfw.tasks.base import Problem, fixed_eval_problems


@dataclass
class Arithmetic:
    max_operand: int = 20
    name: str = "arithmetic"

    def _problem(self, rng: random.Random) -> Problem:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return Problem(uid=a * (self.max_operand + 1) + b, prompt=f"{a}+{b}=", answer=str(a + b))

    def sample(self, n: int, rng: random.Random) -> list[Problem]:
        return [self._problem(rng) for _ in range(n)]

    def reward(self, problem: Problem, response: str) -> float:
        return 1.0 if response.strip() == problem.answer else 0.0

    def demonstrations(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        return [(p.prompt, p.answer) for p in self.sample(n, rng)]

    def eval_problems(self, n: int) -> list[Problem]:
        return fixed_eval_problems(self, n)

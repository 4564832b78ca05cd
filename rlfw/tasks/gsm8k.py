"""GSM8K-style math word problems from a local JSONL file, checked on the final number.

Each line is ``{"question": ..., "answer": "... #### 42"}`` (the GSM8K release format). The reward reads
the last number in the response (``#### 42``, ``\\boxed{42}`` or the last number written) and compares
it numerically with the reference.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from rlfw.tasks.base import Problem, fixed_eval_problems

PROMPT = "Question: {question}\nAnswer step by step, then give the final number after '####'.\nAnswer:"
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file, the line and the fix."""


def parse_number(text: str) -> float | None:
    """The answer a response commits to: after ``####``, inside ``\\boxed{}``, else the last number."""
    for pattern in (rf"####\s*({_NUMBER})", rf"\\boxed\{{\s*({_NUMBER})\s*\}}"):
        found = re.findall(pattern, text)
        if found:
            return float(found[-1].replace(",", ""))
    numbers = re.findall(_NUMBER, text)
    return float(numbers[-1].replace(",", "")) if numbers else None


def load_problems(path: str | Path) -> list[Problem]:
    file = Path(path)
    if not file.is_file():
        raise DatasetError(
            f"task.data_path={str(file)!r} does not exist; point it at a local GSM8K JSONL file"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DatasetError(f"{file} is not UTF-8 text ({err}); convert it to UTF-8 JSONL") from err
    problems = []
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise TypeError(f"the line is a JSON {type(row).__name__}, not an object")
            reference = parse_number(row["answer"].split("####")[-1])
            question = row["question"]
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as err:
            raise DatasetError(
                f"{file}:{i}: expected {{'question': ..., 'answer': '... #### N'}}: "
                f"{type(err).__name__}: {err}"
            ) from err
        if reference is None:
            raise DatasetError(f"{file}:{i}: the answer has no final number after '####'")
        problems.append(Problem(uid=i, prompt=PROMPT.format(question=question), answer=repr(reference)))
    if not problems:
        raise DatasetError(f"{file} holds no problems")
    return problems


@dataclass
class GSM8K:
    data_path: str
    name: str = "gsm8k"
    problems: list[Problem] = field(init=False)

    def __post_init__(self) -> None:
        self.problems = load_problems(self.data_path)

    def sample(self, n: int, rng: random.Random) -> list[Problem]:
        return [rng.choice(self.problems) for _ in range(n)]

    def reward(self, problem: Problem, response: str) -> float:
        got = parse_number(response)
        return 1.0 if got is not None and abs(got - float(problem.answer)) < 1e-6 else 0.0

    def demonstrations(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        return [(p.prompt, f" #### {float(p.answer):g}") for p in self.sample(n, rng)]

    def eval_problems(self, n: int) -> list[Problem]:
        return fixed_eval_problems(self, n)

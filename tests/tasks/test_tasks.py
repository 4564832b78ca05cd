"""Tasks and rewards: exact checking, GSM8K parsing, and failing reward functions counted, not fatal."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from rlfw.tasks.arithmetic import Arithmetic
from rlfw.tasks.base import Problem
from rlfw.tasks.gsm8k import GSM8K, DatasetError, parse_number
from rlfw.tasks.rewards import score
from rlfw.train.collate import grpo_advantages
from rlfw.types import Sample


def test_arithmetic_rewards_only_the_exact_sum() -> None:
    task = Arithmetic(max_operand=9)
    p = task.sample(1, random.Random(3))[0]
    a, b = (int(x) for x in p.prompt.rstrip("=").split("+"))
    assert task.reward(p, str(a + b)) == 1.0
    assert task.reward(p, f" {a + b} ") == 1.0
    assert task.reward(p, str(a + b + 1)) == 0.0 and task.reward(p, "x") == 0.0
    assert all(int(x) <= 9 for q in task.sample(200, random.Random(0)) for x in q.prompt[:-1].split("+"))


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("so #### 1,234", 1234.0),
        ("\\boxed{-7}", -7.0),
        ("3 apples then 5", 5.0),
        ("none", None),
        ("#### 2.5", 2.5),
    ],
)
def test_gsm8k_answer_parsing(text: str, value: float | None) -> None:
    assert parse_number(text) == value


def test_gsm8k_file_loads_and_bad_lines_are_named(tmp_path: Path) -> None:
    good = tmp_path / "g.jsonl"
    good.write_text(json.dumps({"question": "2+2?", "answer": "2 and 2 make 4 #### 4"}) + "\n")
    task = GSM8K(str(good))
    p = task.problems[0]
    assert task.reward(p, "It is #### 4") == 1.0 and task.reward(p, "#### 5") == 0.0
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "4"}) + "\n" + "{not json\n")
    with pytest.raises(DatasetError, match=r"b\.jsonl:2"):
        GSM8K(str(bad))
    with pytest.raises(DatasetError, match="does not exist"):
        GSM8K(str(tmp_path / "missing.jsonl"))


class Flaky:
    """A reward function that raises on some inputs and returns NaN on others."""

    name = "flaky"

    def reward(self, problem: Problem, response: str) -> float:
        if response == "boom":
            raise RuntimeError("grader crashed")
        return float("nan") if response == "nan" else 1.0


def test_failing_reward_calls_are_counted_and_marked_not_raised() -> None:
    problems = [Problem(i, "p", "a") for i in range(4)]
    result = score(Flaky(), problems, ["ok", "boom", "nan", "ok"])  # type: ignore[arg-type]
    assert result.rewards == [1.0, None, None, 1.0]
    assert result.num_failed == 2 and "grader crashed" in result.errors[0]


def _sample(prompt_id: int, index: int, reward: float | None) -> Sample:
    t = torch.zeros(2)
    return Sample(
        prompt_id,
        index,
        torch.tensor([5]),
        torch.tensor([6, 7]),
        t,
        t,
        t,
        t.long(),
        t.long(),
        torch.zeros(2, 1, dtype=torch.long),
        torch.zeros(2, 1),
        "length",
        0,
        reward=reward,
    )


def test_samples_with_failed_rewards_are_dropped_and_groups_renormalised() -> None:
    samples = [
        _sample(0, 0, 1.0),
        _sample(0, 1, None),
        _sample(0, 2, 0.0),
        _sample(1, 0, 1.0),
        _sample(1, 1, None),
    ]
    kept, adv = grpo_advantages(samples, std_scaling=False, leave_one_out=False)
    # group 0 keeps rewards [1, 0]: advantages [0.5, -0.5]; group 1 has one sample left: no baseline, dropped
    assert [(s.prompt_id, s.sample_index) for s in kept] == [(0, 0), (0, 2)]
    assert adv == [0.5, -0.5]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"answer": "#### 4"}\n', r"b\.jsonl:1: .*KeyError: 'question'"),
        (b'["q", "a"]\n', r"b\.jsonl:1: .*the line is a JSON list, not an object"),
        (b"\xff\xfe not utf-8\n", r"b\.jsonl is not UTF-8 text"),
    ],
)
def test_gsm8k_bad_rows_and_encodings_are_named(tmp_path: Path, content: bytes, message: str) -> None:
    bad = tmp_path / "b.jsonl"
    bad.write_bytes(content)
    with pytest.raises(DatasetError, match=message):
        GSM8K(str(bad))


def test_pass_at_k_is_the_unbiased_estimator_and_eval_steps_include_the_last() -> None:
    from math import comb

    from rlfw.train.evaluate import eval_due, pass_at_k

    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(5, 2, 2) == 1 - comb(3, 2) / comb(5, 2)
    assert pass_at_k(4, 1, 4) == 1.0  # any pass among 4 of 4 samples
    assert [s for s in range(10) if eval_due(4, 10, s)] == [3, 7, 9]
    assert not any(eval_due(0, 10, s) for s in range(10))


def test_generated_tasks_evaluate_on_the_same_fixed_problems() -> None:
    from rlfw.tasks import build_task

    task = build_task("arithmetic", max_operand=9)
    assert task.eval_problems(8) == task.eval_problems(8) and len(task.eval_problems(8)) == 8

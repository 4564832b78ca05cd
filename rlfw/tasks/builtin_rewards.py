"""Reward functions that ship with rlfw, usable by reference:
``task.reward=rlfw.tasks.builtin_rewards:NAME``.

* ``exact_match``: 1 when the response, stripped, equals the row's ``answer`` field, stripped.
* ``math_equal``: 1 when the response's final answer is mathematically equal to ``answer`` (GSM8K- or
  MATH-style: numbers, fractions, LaTeX), through ``math-verify``; the text after a ``####`` marker is
  taken as the final answer when there is one.
"""

from __future__ import annotations

from typing import Any


def exact_match(response: str, answer: Any) -> float:
    return float(response.strip() == str(answer).strip())


def math_equal(response: str, answer: Any) -> float:
    from math_verify import parse, verify

    def final(text: str) -> str:
        return text.split("####")[-1].strip()

    gold, guess = parse(final(str(answer))), parse(final(response))
    return float(bool(gold) and bool(guess) and verify(gold, guess))

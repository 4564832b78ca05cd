"""Build the task a config names."""

from __future__ import annotations

from rlfw.tasks.arithmetic import Arithmetic
from rlfw.tasks.base import Task
from rlfw.tasks.gsm8k import GSM8K


def build_task(name: str, data_path: str | None = None, max_operand: int = 20) -> Task:
    if name == "arithmetic":
        return Arithmetic(max_operand=max_operand)
    if name == "gsm8k":
        if data_path is None:
            raise ValueError("task=gsm8k reads a local JSONL file: pass task.data_path=/path/to/gsm8k.jsonl")
        return GSM8K(data_path)
    raise ValueError(f"task.name={name!r} is not a task; choose one of: arithmetic, gsm8k")

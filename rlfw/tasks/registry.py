"""Build the task a config names."""

from __future__ import annotations

from typing import Any

from rlfw.tasks.arithmetic import Arithmetic
from rlfw.tasks.base import Task
from rlfw.tasks.dataset import DatasetTask, chat_renderer, read_rows
from rlfw.tasks.gsm8k import GSM8K
from rlfw.tasks.reward_ref import load_rewards

TASKS = ("arithmetic", "gsm8k", "dataset")


def build_task(
    name: str,
    data_path: str | None = None,
    max_operand: int = 20,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    reward: str | None = None,
    rewards: list[Any] | None = None,
    chat_template: bool = False,
    system_prompt: str | None = None,
    tokenizer: Any = None,
) -> Task:
    """The task ``task.*`` describes; ``tokenizer`` renders chat templates (``task.chat_template``)."""
    if name == "arithmetic":
        return Arithmetic(max_operand=max_operand)
    if name == "gsm8k":
        if data_path is None:
            raise ValueError("task=gsm8k reads a local JSONL file: pass task.data_path=/path/to/gsm8k.jsonl")
        return GSM8K(data_path)
    if name == "dataset":
        if data_path is None:
            raise ValueError("task=dataset reads local files: pass task.data_path=FILE, FOLDER or GLOB")
        fns = load_rewards(reward, list(rewards or []))
        render = chat_renderer(tokenizer, system_prompt) if chat_template else None
        return DatasetTask(read_rows(data_path), fns, prompt_key, answer_key, data_path, render)
    raise ValueError(f"task.name={name!r} is not a task; choose one of: {', '.join(TASKS)}")

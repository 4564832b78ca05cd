"""Build the task a config names."""

from __future__ import annotations

from typing import Any

from rlfw.tasks.arithmetic import Arithmetic
from rlfw.tasks.base import Task
from rlfw.tasks.dataset import DatasetTask, chat_renderer, read_rows
from rlfw.tasks.gsm8k import GSM8K
from rlfw.tasks.reward_pool import RewardPool
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
    reward_workers: int = 0,
    reward_timeout_s: float = 60.0,
    eval_path: str | None = None,
    eval_fraction: float = 0.0,
) -> Task:
    """The task ``task.*`` describes; ``tokenizer`` renders chat templates (``task.chat_template``);
    ``reward_workers > 0`` runs the reward calls in that many processes, each call within
    ``reward_timeout_s``."""
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
        specs = [(f.ref, f.weight, f.name) for f in fns]
        pool = RewardPool(specs, reward_workers, reward_timeout_s) if reward_workers > 0 else None
        eval_rows = read_rows(eval_path) if eval_path else None
        return DatasetTask(
            read_rows(data_path),
            fns,
            prompt_key,
            answer_key,
            data_path,
            render,
            pool,
            eval_rows=eval_rows,
            eval_fraction=eval_fraction,
        )
    raise ValueError(f"task.name={name!r} is not a task; choose one of: {', '.join(TASKS)}")

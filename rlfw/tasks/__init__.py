"""Prompts, datasets and reward functions."""

from rlfw.tasks.base import Problem, Task
from rlfw.tasks.registry import build_task

__all__ = ["Problem", "Task", "build_task"]

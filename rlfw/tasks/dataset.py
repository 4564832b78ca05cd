"""``task=dataset``: your own prompts from local files, scored by your own reward functions.

``task.data_path`` is a file, a folder or a glob of JSONL, JSON, Parquet or CSV files, read through HF
``datasets`` (``load_dataset(<format>, data_files=...)``; nothing is downloaded). ``task.prompt_key``
names the prompt field; every other field of the row travels with the problem to the reward functions
(:mod:`rlfw.tasks.reward_ref`). A row may also give its prompt as a list of chat messages
(``[{"role": ..., "content": ...}]``); with ``task.chat_template=true`` every prompt is rendered by the
tokenizer's own chat template (an optional ``task.system_prompt`` first). Rows whose
``task.answer_key`` field is a string also serve as demonstrations for the supervised warm start.
"""

from __future__ import annotations

import glob
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfw.tasks.base import Problem
from rlfw.tasks.gsm8k import DatasetError
from rlfw.tasks.reward_pool import RewardPool
from rlfw.tasks.reward_ref import RewardFn

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def data_files(data_path: str) -> tuple[str, list[str]]:
    """The ``datasets`` builder and the files ``data_path`` names (a file, a folder or a glob)."""
    path = Path(data_path).expanduser()
    if path.is_dir():
        files = sorted(str(p) for p in path.iterdir() if p.suffix in FORMATS)
    elif path.is_file():
        files = [str(path)]
    else:
        files = sorted(glob.glob(str(path)))
    if not files:
        raise DatasetError(
            f"task.data_path={data_path!r} names no file; give a file, a folder or a glob of "
            f"{', '.join(FORMATS)} files"
        )
    kinds = {FORMATS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise DatasetError(
            f"task.data_path={data_path!r} gives {sorted(Path(f).suffix for f in files)}: use files of one "
            f"format among {', '.join(FORMATS)}"
        )
    return kinds.pop() or "json", files


def read_rows(data_path: str) -> list[dict[str, Any]]:
    """Every row of the files ``data_path`` names, in file order."""
    import datasets

    builder, files = data_files(data_path)
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as err:  # noqa: BLE001 - pyarrow and datasets raise many types for a bad file
        raise DatasetError(
            f"task.data_path={data_path!r}: reading {builder} failed: {type(err).__name__}: {err}"
        ) from err
    return [dict(row) for row in table]


@dataclass
class DatasetTask:
    """Prompts from rows of local files; the reward is the weighted sum of the configured functions."""

    rows: list[dict[str, Any]]
    rewards: list[RewardFn]
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    source: str = "dataset"
    render: Any = None  # prompt -> text (the chat template); None: the prompt field as it is
    pool: RewardPool | None = None  # reward calls in worker processes with a timeout; None: in this one
    name: str = "dataset"
    eval_rows: list[dict[str, Any]] | None = None  # a held-out split (task.eval_path)
    eval_fraction: float = 0.0  # or hold out this share of `rows` (a fixed, seeded choice)
    problems: list[Problem] = field(init=False)  # what training samples from
    held_out: list[Problem] = field(init=False)  # what evaluation prompts with
    fields: list[dict[str, Any]] = field(init=False)  # every row's other fields, by problem uid

    def __post_init__(self) -> None:
        if not self.rewards:
            raise DatasetError("task=dataset needs a reward: set task.reward=module:function or task.rewards")
        self.fields = []
        self.problems = [self._problem(row, i) for i, row in enumerate(self.rows)]
        if not self.problems:
            raise DatasetError(f"{self.source} holds no rows")
        if self.eval_rows is not None:
            start = len(self.problems)
            self.held_out = [self._problem(row, start + i) for i, row in enumerate(self.eval_rows)]
        elif self.eval_fraction > 0:
            count = round(self.eval_fraction * len(self.problems))
            if not 0 < count < len(self.problems):
                raise DatasetError(
                    f"task.eval_fraction={self.eval_fraction} of {len(self.problems)} rows leaves "
                    f"{count} for evaluation and {len(self.problems) - count} for training; both need rows"
                )
            chosen = set(random.Random(0).sample(range(len(self.problems)), count))
            self.held_out = [p for p in self.problems if p.uid in chosen]
            self.problems = [p for p in self.problems if p.uid not in chosen]
        else:
            self.held_out = []

    def _problem(self, row: dict[str, Any], uid: int) -> Problem:
        if self.prompt_key not in row:
            raise DatasetError(
                f"{self.source}: row {uid} has no field {self.prompt_key!r} (fields: {sorted(row)}); "
                "set task.prompt_key to the prompt's field"
            )
        prompt = self._text(row[self.prompt_key], uid)
        answer = row.get(self.answer_key)
        self.fields.append({k: v for k, v in row.items() if k != self.prompt_key})
        return Problem(uid=uid, prompt=prompt, answer="" if answer is None else str(answer))

    def eval_problems(self, n: int) -> list[Problem]:
        """The first ``n`` held-out problems (task.eval_path or task.eval_fraction)."""
        if not self.held_out:
            raise DatasetError(
                "eval.every > 0 with task=dataset needs a held-out split: task.eval_path=FILE or "
                "task.eval_fraction=0.1"
            )
        return self.held_out[:n]

    def _text(self, prompt: Any, i: int) -> str:
        if self.render is not None:
            return str(self.render(prompt))
        if isinstance(prompt, str):
            return prompt
        raise DatasetError(
            f"{self.source}: row {i}'s prompt is a {type(prompt).__name__}; chat messages need "
            "task.chat_template=true, anything else must be a string"
        )

    def drop_long_prompts(self, count_tokens: Callable[[str], int], max_tokens: int) -> int:
        """Drop the problems whose prompt has more than ``max_tokens`` tokens (the engine could not give
        them a response); returns how many were dropped. Nothing is truncated."""
        kept = [p for p in self.problems if count_tokens(p.prompt) <= max_tokens]
        held_out = [p for p in self.held_out if count_tokens(p.prompt) <= max_tokens]
        dropped = len(self.problems) + len(self.held_out) - len(kept) - len(held_out)
        if not kept:
            raise DatasetError(
                f"{self.source}: every prompt is longer than {max_tokens} tokens; raise engine.max_model_len"
            )
        self.problems, self.held_out = kept, held_out
        return dropped

    def sample(self, n: int, rng: random.Random) -> list[Problem]:
        return [self.problems[rng.randrange(len(self.problems))] for _ in range(n)]

    def reward_parts(self, problem: Problem, response: str) -> dict[str, float]:
        """Each configured function's value for ``response`` (unweighted), by name."""
        row = self.fields[problem.uid]
        return {r.name: r(problem.prompt, response, row) for r in self.rewards}

    def reward_batch(self, problems: list[Problem], responses: list[str]) -> list[dict[str, float] | str]:
        """Every call's named values, or why it failed (raised, not finite, timed out)."""
        if self.pool is not None:
            calls = [(p.prompt, r, self.fields[p.uid]) for p, r in zip(problems, responses, strict=True)]
            return self.pool.score(calls)
        out: list[dict[str, float] | str] = []
        for p, r in zip(problems, responses, strict=True):
            try:
                out.append(self.reward_parts(p, r))
            except Exception as err:  # noqa: BLE001 - the user's function may raise anything
                out.append(f"{type(err).__name__}: {err}")
        return out

    def close(self) -> None:
        """Stop the reward workers (the run calls it at the end)."""
        if self.pool is not None:
            self.pool.close()

    def reward(self, problem: Problem, response: str) -> float:
        parts = self.reward_parts(problem, response)
        return sum(r.weight * parts[r.name] for r in self.rewards)

    def demonstrations(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        usable = [p for p in self.problems if p.answer]
        if not usable:
            raise DatasetError(
                f"task.warm_start_steps > 0 needs demonstrations: rows with a {self.answer_key!r} field "
                "(task.answer_key); set task.warm_start_steps=0 or add the field"
            )
        return [(p.prompt, p.answer) for p in (usable[rng.randrange(len(usable))] for _ in range(n))]


def chat_renderer(tokenizer: Any, system_prompt: str | None) -> Any:
    """A prompt (text or messages) rendered by the tokenizer's chat template, generation prompt added."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DatasetError("task.chat_template=true but the tokenizer has no chat template")

    def render(prompt: str | Sequence[Mapping[str, str]]) -> str:
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        )
        if system_prompt:
            messages = [{"role": "system", "content": system_prompt}, *messages]
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    return render

"""The phases one training step is made of, shared by the synchronous loop (:mod:`rlfw.train`) and the
asynchronous one (:mod:`rlfw.train_async`): prompts, rewards, the batch, checkpoints, and the handles a
loop drives."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlfw.config import RunConfig
from rlfw.distributed.groups import RolloutGroup, TrainerGroup
from rlfw.distributed.weight_sync import WeightSync
from rlfw.logging.logger import RunLogger
from rlfw.run_state import RunState, write_state
from rlfw.tasks.base import Problem
from rlfw.tasks.rewards import score
from rlfw.train_setup import Setup
from rlfw.trainer.advantages import grpo_advantages
from rlfw.trainer.batch import collate
from rlfw.types import GenerationRequest, Sample, TrainBatch

CHECKPOINTS = "checkpoints"

log = logging.getLogger("rlfw.train")


@dataclass
class Driver:
    """What a step loop drives. ``state`` is where the run stands after its last completed step; the loop
    updates it after every step, so an interrupt checkpoints exactly what was completed."""

    run: RunConfig
    setup: Setup
    rollout: RolloutGroup
    trainer: TrainerGroup
    sync: WeightSync
    logger: RunLogger
    run_dir: Path
    state: RunState
    # Called with the checkpoint's tag folder before the run state points at it (async: engine weights).
    on_checkpoint: Callable[[Path, RunState], None] | None = None


def request_for(problems: list[Problem], setup: Setup, run: RunConfig, step: int) -> GenerationRequest:
    """Prompts for one step; the seed depends only on (run seed, step), so a resumed step draws the same."""
    prompts = [torch.tensor(setup.tokenizer(p.prompt, add_special_tokens=False).input_ids) for p in problems]
    seed = (run.seed * 1_000_003 + step) % 2**31
    return GenerationRequest(
        list(range(len(problems))), prompts, run.algo.group_size, run.engine.max_new_tokens, seed
    )


def make_batch(samples: list[Sample], run: RunConfig) -> TrainBatch:
    """GRPO normalises rewards within each prompt's group; PPO hands the rewards to the trainer's critic."""
    if run.algo.name == "ppo":
        kept = [s for s in samples if s.reward is not None]
        return collate(kept, [0.0] * len(kept), token_rewards=True)
    kept, advantages = grpo_advantages(samples, run.algo.std_scaling, run.algo.leave_one_out)
    return collate(kept, advantages)


def trainable(batch: TrainBatch, run: RunConfig, step: int, failed: int, generated: int) -> bool:
    """Whether a step has enough samples left to train (every rank needs a row); says why when not."""
    if len(batch) >= run.trainer.num_ranks:
        return True
    log.warning(
        "step %d: %d of %d rewards failed or were dropped; too few samples left, step skipped",
        step,
        failed,
        generated,
    )
    return False


def reward(setup: Setup, problems: list[Problem], samples: list[Sample]) -> int:
    """Decode each response and score it; failed reward calls leave ``reward=None`` (dropped later)."""
    texts = [decode_response(setup, s) for s in samples]
    result = score(setup.task, [problems[s.prompt_id] for s in samples], texts)
    for s, r in zip(samples, result.rewards, strict=True):
        s.reward = r
    return result.num_failed


def decode_response(setup: Setup, sample: Sample) -> str:
    ids = sample.response_T.tolist()
    if sample.finish_reason == "stop" and ids and ids[-1] in setup.stop_ids:
        ids = ids[:-1]
    return str(setup.tokenizer.decode(ids, skip_special_tokens=True))


def checkpoint(d: Driver) -> None:
    """Trainer state first (DeepSpeed writes a tag folder), then what else the loop saves with it, then
    the run state that points at it: a crash before the last write leaves the previous run state, and
    the previous checkpoint, in force."""
    state = d.state
    tag = f"step{state.step:06d}"
    d.trainer.save(str(d.run_dir / CHECKPOINTS), tag)
    if d.on_checkpoint is not None:
        d.on_checkpoint(d.run_dir / CHECKPOINTS / tag, state)
    state.tag = tag
    write_state(d.run_dir, state)


def checkpoint_due(run: RunConfig, step: int) -> bool:
    return (step + 1) % run.trainer.checkpoint_every == 0 or step + 1 == run.trainer.steps

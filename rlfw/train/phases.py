"""The phases of one training step, shared by the synchronous loop (:mod:`rlfw.train.sync_loop`) and the
asynchronous one (:mod:`rlfw.train.async_loop`): the step's prompts, and the step body that scores the
samples, drops the too-stale, builds the batch and trains on it."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlfw.config import RunConfig
from rlfw.distributed.groups import RolloutGroup, TrainerGroup
from rlfw.logging.logger import RunLogger
from rlfw.tasks.base import Problem
from rlfw.tasks.rewards import score
from rlfw.train.checkpoint import EngineWeights, checkpoint_due, save_checkpoint
from rlfw.train.collate import make_batch
from rlfw.train.schedule import split_stale
from rlfw.train.setup import Setup
from rlfw.train.state import RunState
from rlfw.types import GenerationRequest, Sample, TrainBatch, TrainResult

log = logging.getLogger("rlfw.train")


@dataclass
class Driver:
    """What a step loop drives. ``state`` is where the run stands after its last completed step; the loop
    updates it after every step, so an interrupt checkpoints exactly what was completed."""

    run: RunConfig
    setup: Setup
    rollout: RolloutGroup
    trainer: TrainerGroup
    weights: EngineWeights
    logger: RunLogger
    run_dir: Path
    state: RunState
    skipped_in_a_row: int = 0  # consecutive steps with too few usable samples to train on
    nonfinite_in_a_row: int = 0  # consecutive steps whose update was dropped for non-finite gradients

    def checkpoint(self) -> None:
        save_checkpoint(self.run_dir, self.trainer, self.weights, self.state)

    def memory(self) -> dict[str, float]:
        """Peak resident memory of the largest engine actor and trainer rank so far (MiB)."""
        return {
            "memory/rollout_peak_rss_mb": self.rollout.peak_rss_mb(),
            "memory/trainer_peak_rss_mb": self.trainer.peak_rss_mb(),
        }

    def checkpoint_if_due(self, step: int) -> None:
        if checkpoint_due(self.run.trainer.checkpoint_every, self.run.trainer.steps, step):
            self.checkpoint()


def step_prompts(d: Driver, step: int) -> tuple[list[Problem], GenerationRequest]:
    """Step ``step``'s problems and their generation request. Both depend only on (run seed, step), so a
    resumed or resubmitted step draws the same prompts and the same samples."""
    run, setup = d.run, d.setup
    problems = setup.task.sample(run.algo.prompts_per_step, random.Random(f"{run.seed}:{step}"))
    prompts = [torch.tensor(setup.tokenizer(p.prompt, add_special_tokens=False).input_ids) for p in problems]
    seed = (run.seed * 1_000_003 + step) % 2**31
    request = GenerationRequest(
        list(range(len(problems))), prompts, run.algo.group_size, run.engine.max_new_tokens, seed
    )
    return problems, request


@dataclass
class Scored:
    """A step's samples scored and the batch built from them, before the trainer takes it."""

    samples: list[Sample]
    batch: TrainBatch
    failed_rewards: int
    dropped_stale: int
    reward_s: float  # scoring and batch building
    reward_parts: dict[str, float] = field(default_factory=dict)  # reward/<name> when there are several


@dataclass
class Trained:
    """What one step's body produced: the scored samples and batch, and the trainer's result on it."""

    scored: Scored
    result: TrainResult
    train_s: float


def score_step(
    d: Driver, step: int, problems: list[Problem], samples: list[Sample], trainer_version: int
) -> Scored | None:
    """Score the samples, drop those drawn more than ``sync.max_staleness`` versions before
    ``trainer_version`` (none in sync mode, where every token is at the trainer's version) and build the
    batch. ``None`` when too few samples are left to train (said in the log). Nothing here changes the
    run's state, so a stop may land during it."""
    run = d.run
    t0 = time.perf_counter()
    failed, parts = reward(d.setup, problems, samples)
    kept, dropped = split_stale(samples, trainer_version, run.sync.max_staleness)
    batch = make_batch(kept, run.algo.name, run.algo.std_scaling, run.algo.leave_one_out)
    if len(batch) < run.trainer.num_ranks:  # every rank needs a row
        skip_step(d, step, len(samples), failed, len(dropped))
        return None
    d.skipped_in_a_row = 0
    return Scored(samples, batch, failed, len(dropped), time.perf_counter() - t0, parts)


def train_on(d: Driver, step: int, scored: Scored) -> Trained:
    """One optimizer step on the scored batch (the update a checkpoint must record with its step)."""
    t0 = time.perf_counter()
    result = d.trainer.train(scored.batch)
    t1 = time.perf_counter()
    check_finite(d, step, result.scalars)
    return Trained(scored, result, t1 - t0)


class StalledRun(RuntimeError):
    """Too many steps in a row had nothing to train on, or diverged; the message says why."""


def check_finite(d: Driver, step: int, scalars: dict[str, float]) -> None:
    """Warn about a step whose update was dropped for a non-finite loss or grad norm (the metrics row
    says ``train/skipped_nonfinite``), and stop the run after ``trainer.max_skipped_steps`` in a row: a
    diverged run must not go on logging nothing but NaN."""
    if not scalars.get("train/skipped_nonfinite"):
        d.nonfinite_in_a_row = 0
        return
    d.nonfinite_in_a_row += 1
    losses = ", ".join(f"{k}={v:.4g}" for k, v in scalars.items() if k.startswith("loss/"))
    why = f"grad_norm={scalars.get('grad_norm', float('nan')):.4g} ({losses})"
    log.warning("step %d: update skipped, the gradients were not finite: %s", step, why)
    if d.nonfinite_in_a_row >= d.run.trainer.max_skipped_steps:
        # The step's full report is never built: its row says what the trainer reported, then the run stops.
        kept = {k: v for k, v in scalars.items() if k.startswith("loss/") or k == "grad_norm"}
        d.logger.log(step, {"train/skipped_nonfinite": 1.0, **kept})
        raise StalledRun(
            f"{d.nonfinite_in_a_row} steps in a row had non-finite gradients (last: {why}); the run "
            "diverged: lower trainer.lr or trainer.grad_clip, or check the reward's scale"
        )


def skip_step(d: Driver, step: int, total: int, failed: int, dropped: int) -> None:
    """Log a skipped step (a metrics row that says so, and why, in counts) and stop the run after
    ``trainer.max_skipped_steps`` in a row: a run whose every step is skipped must not exit 0."""
    why = f"{failed} of {total} rewards failed or were not finite, {dropped} samples were too stale"
    log.warning("step %d skipped: %s; too few samples left to train on", step, why)
    d.logger.log(
        step,
        {"train/skipped": 1.0, "reward/failed": float(failed), "sync/dropped_stale": float(dropped)},
    )
    d.skipped_in_a_row += 1
    if d.skipped_in_a_row >= d.run.trainer.max_skipped_steps:
        raise StalledRun(
            f"{d.skipped_in_a_row} steps in a row skipped (last: {why}); check the reward function "
            "(task.*) and the log-probs, or raise trainer.max_skipped_steps"
        )


def reward(setup: Setup, problems: list[Problem], samples: list[Sample]) -> tuple[int, dict[str, float]]:
    """Decode each response and score it; failed reward calls leave ``reward=None`` (dropped later).
    Returns the number that failed and the mean of each named reward (``reward/<name>``)."""
    texts = [decode_response(setup, s) for s in samples]
    result = score(setup.task, [problems[s.prompt_id] for s in samples], texts)
    for s, r in zip(samples, result.rewards, strict=True):
        s.reward = r
    return result.num_failed, result.part_means()


def decode_response(setup: Setup, sample: Sample) -> str:
    ids = sample.response_T.tolist()
    if sample.finish_reason == "stop" and ids and ids[-1] in setup.stop_ids:
        ids = ids[:-1]
    return str(setup.tokenizer.decode(ids, skip_special_tokens=True))

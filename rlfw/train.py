"""``rlfw train``: the synchronous RL loop. Generate with version v, score, train, publish v + 1.

Each line of :func:`train` is one phase of the algorithm; the details live one level down.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict
from pathlib import Path

import ray
import torch

from rlfw.compose import to_yaml
from rlfw.config import RunConfig
from rlfw.distributed.cluster import ROLLOUT, TRAINER, init_ray, make_pool
from rlfw.distributed.groups import RolloutGroup, TrainerGroup
from rlfw.distributed.weight_sync import make_sync
from rlfw.logging.logger import RunLogger
from rlfw.logging.progress import progress
from rlfw.run_state import RunState, make_run_dir, read_state, write_state
from rlfw.tasks.base import Problem
from rlfw.tasks.rewards import score
from rlfw.train_report import StepTimes, step_report
from rlfw.train_setup import Setup, optim_config, prepare, step_spec
from rlfw.trainer.advantages import grpo_advantages
from rlfw.trainer.batch import collate
from rlfw.types import GenerationRequest, Sample, TrainBatch

log = logging.getLogger("rlfw.train")
CHECKPOINTS = "checkpoints"


def train(run: RunConfig) -> int:
    """Run ``run`` to its last step; returns the exit code (130 after Ctrl-C, with a checkpoint saved)."""
    if run.sync.mode != "sync":
        raise NotImplementedError(f"sync.mode={run.sync.mode}: this version trains sync.mode=sync")
    if run.engine.name != "native":
        raise NotImplementedError(f"engine={run.engine.name}: this version generates with engine=native")
    run_dir = make_run_dir(run.logger.run_root, run.logger.run_name, run.resume)
    (run_dir / "config.yaml").write_text(to_yaml(run))
    setup = prepare(run, run_dir)
    init_ray(run.engine.num_actors, run.trainer.num_ranks, run.ray_address)
    rollout = RolloutGroup(
        make_pool(ROLLOUT, run.engine.num_actors),
        setup.model,
        run.engine,
        setup.stop_ids,
        setup.contract.hash,
    )
    trainer = TrainerGroup(
        make_pool(TRAINER, run.trainer.num_ranks), setup.model, optim_config(run), step_spec(run, setup)
    )
    sync = make_sync(run.sync.transport)
    state = RunState(step=-1, version=0, tag="", resyncs=0)
    if run.resume:
        state = read_state(run_dir)
        trainer.load(str(run_dir / CHECKPOINTS), state.tag)
        sync.publish(trainer, rollout, state.version, setup.contract.hash)
    logger = RunLogger(
        run_dir,
        run.logger.wandb,
        run.logger.wandb_mode,
        run.logger.project,
        run_dir.name,
        {"run": asdict(run)},
        resume_from_step=state.step + 1 if run.resume else None,
    )
    code = 0
    try:
        for step in progress(range(state.step + 1, run.trainer.steps), desc="rl steps"):
            t0 = time.perf_counter()
            problems = setup.task.sample(run.algo.prompts_per_step, random.Random(f"{run.seed}:{step}"))
            samples = rollout.generate(request_for(problems, setup, run, step))  # generate with version v
            t1 = time.perf_counter()
            failed = reward(setup, problems, samples)  # score
            batch = make_batch(samples, run)  # advantages (GRPO) or token rewards (PPO)
            if len(batch) < run.trainer.num_ranks:
                log.warning(
                    "step %d: %d of %d rewards failed; too few samples left to train, step skipped",
                    step,
                    failed,
                    len(samples),
                )
                continue
            t2 = time.perf_counter()
            result = trainer.train(batch)  # train
            t3 = time.perf_counter()
            sync.publish(trainer, rollout, state.version + 1, setup.contract.hash)  # publish v + 1
            t4 = time.perf_counter()
            times = StepTimes(t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)
            metrics = step_report(
                samples, batch, result, run.correction, state.version, state.resyncs + 1, failed, times
            )
            state = RunState(step, state.version + 1, state.tag, state.resyncs + 1)
            logger.log(step, metrics | {"sync/engine_restarts": float(rollout.restarts)})
            log.info("step %d reward %.3f time %.2fs", step, metrics["reward/mean"], times.total)
            if (step + 1) % run.trainer.checkpoint_every == 0 or step + 1 == run.trainer.steps:
                checkpoint(trainer, run_dir, state)
    except KeyboardInterrupt:
        log.warning("interrupted: saving a checkpoint at step %d before exiting", state.step)
        if state.step >= 0:
            checkpoint(trainer, run_dir, state)
        code = 130
    finally:
        logger.close()
        trainer.shutdown()
        ray.shutdown()
    return code


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


def checkpoint(trainer: TrainerGroup, run_dir: Path, state: RunState) -> None:
    """Trainer state first (DeepSpeed writes a tag folder), then the run state that points at it: a crash
    between the two leaves the previous run state, and the previous checkpoint, in force."""
    tag = f"step{state.step:06d}"
    trainer.save(str(run_dir / CHECKPOINTS), tag)
    state.tag = tag
    write_state(run_dir, state)

"""``rlfw train``: the synchronous RL loop. Generate with version v, score, train, publish v + 1.

Each line of :func:`sync_steps` is one phase of the algorithm; the details live one level down.
``sync.mode=async`` runs :func:`rlfw.train_async.async_steps` on the same pools instead.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict

import ray

from rlfw.compose import to_yaml
from rlfw.config import RunConfig
from rlfw.distributed.cluster import ROLLOUT, TRAINER, init_ray, make_pool
from rlfw.distributed.groups import RolloutGroup, TrainerGroup
from rlfw.distributed.weight_sync import make_sync
from rlfw.logging.logger import RunLogger
from rlfw.logging.progress import progress
from rlfw.run_state import RunState, make_run_dir, read_state
from rlfw.train_async import async_steps
from rlfw.train_phases import (
    CHECKPOINTS,
    Driver,
    checkpoint,
    checkpoint_due,
    make_batch,
    request_for,
    reward,
    trainable,
)
from rlfw.train_report import StepTimes, step_report
from rlfw.train_setup import optim_config, prepare, step_spec

log = logging.getLogger("rlfw.train")


def check_supported(run: RunConfig) -> None:
    """Refuse, before anything starts, what this version cannot run."""
    if run.sync.mode == "sync" and run.engine.in_flight:
        log.warning(
            "engine.in_flight=true has no effect with sync.mode=sync: weights move only between steps"
        )


def train(run: RunConfig) -> int:
    """Run ``run`` to its last step; returns the exit code (130 after Ctrl-C, with a checkpoint saved)."""
    check_supported(run)
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
        if state.pending_version is None:  # async runs put their engines back themselves
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
    driver = Driver(run, setup, rollout, trainer, sync, logger, run_dir, state)
    code = 0
    try:
        if run.sync.mode == "async":
            async_steps(driver)
        else:
            sync_steps(driver)
    except KeyboardInterrupt:
        log.warning("interrupted: saving a checkpoint at step %d before exiting", driver.state.step)
        if driver.state.step >= 0:
            checkpoint(driver)
        code = 130
    finally:
        logger.close()
        trainer.shutdown()
        ray.shutdown()
    return code


def sync_steps(d: Driver) -> None:
    """Generate with version v, score, train, publish v + 1: every step is on-policy."""
    run, setup, state = d.run, d.setup, d.state
    for step in progress(range(state.step + 1, run.trainer.steps), desc="rl steps"):
        t0 = time.perf_counter()
        problems = setup.task.sample(run.algo.prompts_per_step, random.Random(f"{run.seed}:{step}"))
        samples = d.rollout.generate(request_for(problems, setup, run, step))  # generate with version v
        t1 = time.perf_counter()
        failed = reward(setup, problems, samples)  # score
        batch = make_batch(samples, run)  # advantages (GRPO) or token rewards (PPO)
        if not trainable(batch, run, step, failed, len(samples)):
            continue
        t2 = time.perf_counter()
        result = d.trainer.train(batch)  # train
        t3 = time.perf_counter()
        d.sync.publish(d.trainer, d.rollout, state.version + 1, setup.contract.hash)  # publish v + 1
        t4 = time.perf_counter()
        times = StepTimes(t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)
        metrics = step_report(
            samples, batch, result, run.correction, state.version, state.resyncs + 1, failed, times
        )
        state = d.state = RunState(step, state.version + 1, state.tag, state.resyncs + 1)
        engine_version = max(s.final_version for s in samples)  # as the engines recorded it
        d.logger.log(
            step,
            metrics
            | {
                "sync/engine_restarts": float(d.rollout.restarts),
                "sync/engine_version": float(engine_version),
            },
        )
        log.info("step %d reward %.3f time %.2fs", step, metrics["reward/mean"], times.total)
        if checkpoint_due(run, step):
            checkpoint(d)

"""``sync.mode=async``: the rollout engines keep generating while the trainer trains.

One step of generation stays in flight: step s + 1's prompts go to the engines, at whatever version they
hold, before the trainer takes step s's batch, so generation overlaps training. Weights move to the engines
only when the resync rule says so (``sync.policy``, with ``sync.max_staleness`` as a hard bound), and a
sample with a token drawn more than ``max_staleness`` versions before the trainer's is dropped before
training and counted.

Where a pushed version lands depends on ``engine.in_flight``:

* ``false``: after the generation in flight. Every sequence is generated at one version, so its prefill
  stream is the log-prob under the weights that generated it: the PPO reference of the lag ratio (see
  :func:`rlfw.train_setup.prefill_is_old_policy`).
* ``true`` (PipelineRL style): inside it, between two decode steps; unfinished sequences continue at the
  new version (``kv_policy=keep`` on their stale KV cache, ``recompute`` on a re-prefilled one). Tokens of
  one sequence then carry different versions, and the decode stream, drawn at each token's version, is
  the reference (:func:`rlfw.train_setup.decode_is_old_policy`). ``sync/in_flight_samples`` counts the
  samples that span an update; the decode factor shows what a kept stale cache cost.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass

from rlfw.distributed.async_schedule import SyncClock, pipeline_depth, spans_versions, split_stale
from rlfw.distributed.groups import PendingGeneration
from rlfw.logging.progress import progress
from rlfw.run_state import RunState
from rlfw.tasks.base import Problem
from rlfw.train_phases import Driver, checkpoint, checkpoint_due, make_batch, request_for, reward, trainable
from rlfw.train_report import StepTimes, decode_kv_staleness, step_report, time_metrics, trainer_numerics

log = logging.getLogger("rlfw.train")


@dataclass
class InFlight:
    """One step's generation, submitted and not yet collected."""

    step: int
    problems: list[Problem]
    pending: PendingGeneration


def submit(d: Driver, step: int) -> InFlight:
    """Send step ``step``'s prompts to the engines without waiting; they run at the version held now."""
    problems = d.setup.task.sample(d.run.algo.prompts_per_step, random.Random(f"{d.run.seed}:{step}"))
    return InFlight(step, problems, d.rollout.submit(request_for(problems, d.setup, d.run, step)))


def resync(d: Driver, clock: SyncClock, lag_ess: float) -> bool:
    """Push the trainer's current version to the engines if the resync rule says so. The push lands after
    the generation in flight, or inside it with ``engine.in_flight=true``."""
    s = d.run.sync
    if not clock.due(s.policy, s.interval, s.ess_threshold, s.max_staleness, lag_ess):
        return False
    d.sync.publish(d.trainer, d.rollout, clock.trainer_version, d.setup.contract.hash)
    clock.pushed()
    return True


def async_steps(d: Driver) -> None:
    """Collect step s's samples, submit step s + 1, score, drop the too-stale, train, resync if due."""
    run = d.run
    clock = SyncClock(d.state.version, d.state.version, resyncs=d.state.resyncs)
    steps = range(d.state.step + 1, run.trainer.steps)
    depth = pipeline_depth(run.sync.max_staleness)
    queue = deque(submit(d, s) for s in steps[:depth])
    for step in progress(steps, desc="rl steps"):
        t0 = time.perf_counter()
        flight = queue.popleft() if queue else submit(d, step)
        samples = d.rollout.collect(flight.pending)  # drawn at the engines' version when submitted
        t1 = time.perf_counter()
        if depth and step + depth < run.trainer.steps:
            queue.append(submit(d, step + depth))  # the engines generate while the trainer trains
        failed = reward(d.setup, flight.problems, samples)
        kept, dropped = split_stale(samples, clock.trainer_version, run.sync.max_staleness)
        batch = make_batch(kept, run)
        if not trainable(batch, run, step, failed, len(samples)):
            continue
        t2 = time.perf_counter()
        result = d.trainer.train(batch)
        t3 = time.perf_counter()
        times = StepTimes(t1 - t0, t2 - t1, t3 - t2, 0.0, t3 - t0)
        metrics = step_report(
            samples, batch, result, run.correction, clock.trainer_version, clock.resyncs, failed, times
        )
        metrics |= trainer_numerics(batch, result.trainer_logp, clock.trainer_version)
        metrics |= decode_kv_staleness(samples)
        clock.trained()
        resynced = resync(d, clock, float(metrics["ess/lag"]))
        t4 = time.perf_counter()
        times = StepTimes(t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)
        tokens = sum(s.response_T.shape[0] for s in samples)
        metrics |= time_metrics(tokens, len(samples), times.total, times)
        metrics |= {
            "sync/resyncs": float(clock.resyncs),
            "sync/resynced": float(resynced),
            "sync/dropped_stale": float(len(dropped)),
            "sync/in_flight_samples": float(sum(spans_versions(s) for s in samples)),
            "sync/trained_samples": float(len(batch)),
            "sync/engine_version": float(clock.engine_version),
            "sync/engine_restarts": float(d.rollout.restarts),
        }
        d.state = RunState(step, clock.trainer_version, d.state.tag, clock.resyncs)
        d.logger.log(step, metrics)
        log.info("step %d reward %.3f time %.2fs", step, metrics["reward/mean"], times.total)
        if checkpoint_due(run, step):
            checkpoint(d.trainer, d.run_dir, d.state)

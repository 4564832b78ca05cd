"""``sync.mode=async``: the rollout engines keep generating while the trainer trains.

One step of generation stays in flight: step s + 1's prompts go to the engines, at whatever version they
hold, before the trainer takes step s's batch, so generation overlaps training. Weights move to the engines
only when the resync rule says so (``sync.policy``, with ``sync.max_staleness`` as a hard bound), and a
sample with a token drawn more than ``max_staleness`` versions before the trainer's is dropped before
training and counted.

Where a pushed version lands depends on ``engine.in_flight``:

* ``false``: after the generation in flight. Every sequence is generated at one version, so its prefill
  stream is the log-prob under the weights that generated it: the PPO reference of the lag ratio (see
  :func:`rlfw.algos.ppo_reference`).
* ``true`` (PipelineRL style): inside it, between two decode steps; unfinished sequences continue at the
  new version (``kv_policy=keep`` on their stale KV cache, ``recompute`` on a re-prefilled one). Tokens of
  one sequence then carry different versions, and the decode stream, drawn at each token's version, is
  the reference (:func:`rlfw.algos.ppo_reference`). ``sync/in_flight_samples`` counts the
  samples that span an update; the decode factor shows what a kept stale cache cost.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from rlfw.distributed.groups import PendingGeneration
from rlfw.logging.metrics import lag_ess_key
from rlfw.logging.progress import progress
from rlfw.tasks.base import Problem
from rlfw.train.checkpoint import checkpoint_folder
from rlfw.train.evaluate import eval_due, evaluate
from rlfw.train.phases import Driver, score_step, step_prompts, train_on
from rlfw.train.report import StepTimes, decode_kv_staleness, step_report, time_metrics, trainer_numerics
from rlfw.train.schedule import SyncClock, pipeline_depth, spans_versions
from rlfw.train.state import RunState
from rlfw.train.stopping import stop_deferred

log = logging.getLogger("rlfw.train")


@dataclass
class InFlight:
    """One step's generation, submitted and not yet collected."""

    step: int
    problems: list[Problem]
    pending: PendingGeneration
    version: int  # the version the engines held when it was submitted


def submit(d: Driver, step: int, clock: SyncClock) -> InFlight:
    """Send step ``step``'s prompts to the engines without waiting; they run at the version held now."""
    problems, request = step_prompts(d, step)
    return InFlight(step, problems, d.rollout.submit(request, hold=True), clock.engine_version)


def resync(d: Driver, clock: SyncClock, lag_ess: float) -> bool:
    """Push the trainer's current version to the engines if the resync rule says so. The push lands after
    the generation in flight, or inside it with ``engine.in_flight=true``."""
    s = d.run.sync
    if not clock.due(s.policy, s.interval, s.ess_threshold, s.max_staleness, lag_ess):
        return False
    d.weights.publish(clock.trainer_version)
    clock.pushed()
    return True


def start(d: Driver, steps: range, depth: int) -> tuple[SyncClock, deque[InFlight]]:
    """The clock and the first submitted generations, for a new run or a resumed one.

    Resumed (the run state has ``pending_version``): the engines go back to the version the next step
    was submitted at, that step is submitted again (its seed depends only on the step, so it draws the
    same samples), then the engines move to the version they held after the checkpointed step. The run
    then continues exactly as it would have (with ``engine.in_flight=false``; in-flight updates land
    where timing puts them, unless ``engine.in_flight_at_step`` fixes the step)."""
    st = d.state
    if st.pending_version is None or st.engine_version is None:
        clock = SyncClock(st.version, st.version, resyncs=st.resyncs)
        return clock, deque(submit(d, s, clock) for s in steps[:depth])
    folder = checkpoint_folder(d.run_dir, st)
    clock = SyncClock(st.version, st.pending_version, st.steps_since_sync, st.resyncs)
    d.weights.load(folder, st.pending_version, st.version)
    queue = deque(submit(d, s, clock) for s in steps[:depth])
    if st.engine_version != st.pending_version:
        d.weights.load(folder, st.engine_version, st.version)
    clock.engine_version = st.engine_version
    return clock, queue


def async_steps(d: Driver) -> None:
    """Collect step s's samples, submit step s + 1, score, drop the too-stale, train, resync if due."""
    run = d.run
    steps = range(d.state.step + 1, run.trainer.steps)
    depth = pipeline_depth(run.sync.max_staleness)
    clock, queue = start(d, steps, depth)
    bar = progress(steps, desc="rl steps")
    for step in bar:
        t0 = time.perf_counter()
        flight = queue.popleft() if queue else submit(d, step, clock)
        samples = d.rollout.collect(flight.pending)  # drawn at the engines' version when submitted
        t1 = time.perf_counter()
        if depth and step + depth < run.trainer.steps:
            queue.append(submit(d, step + depth, clock))  # the engines generate while the trainer trains
        scored = score_step(d, step, flight.problems, samples, clock.trainer_version)
        if scored is None:
            continue
        with stop_deferred():  # a stop lands after the update is in the state and its row is logged
            trained = train_on(d, step, scored)
            t3 = time.perf_counter()
            times = StepTimes(t1 - t0, trained.scored.reward_s, trained.train_s, 0.0, t3 - t0)
            metrics = step_report(trained, run.correction, clock.trainer_version, clock.resyncs, times)
            metrics |= trainer_numerics(
                trained.scored.batch, trained.result.trainer_logp, clock.trainer_version
            )
            metrics |= decode_kv_staleness(samples)
            clock.trained()
            resynced = resync(d, clock, float(metrics[lag_ess_key(run.sync.ess_level)]))
            t4 = time.perf_counter()
            times = StepTimes(t1 - t0, trained.scored.reward_s, trained.train_s, t4 - t3, t4 - t0)
            tokens = sum(s.response_T.shape[0] for s in samples)
            metrics |= time_metrics(tokens, len(samples), times.total, times)
            metrics |= d.memory()
            metrics |= {
                "sync/resyncs": float(clock.resyncs),
                "sync/resynced": float(resynced),
                "sync/dropped_stale": float(trained.scored.dropped_stale),
                "sync/in_flight_samples": float(sum(spans_versions(s) for s in samples)),
                "sync/trained_samples": float(len(trained.scored.batch)),
                "sync/engine_version": float(clock.engine_version),
                "sync/engine_restarts": float(d.rollout.restarts),
            }
            if eval_due(run.eval.every, run.trainer.steps, step):
                metrics |= evaluate(d)  # waits for the generation in flight; runs at the engines' version
            pending = queue[0].version if queue else clock.engine_version
            d.state = RunState(
                step,
                clock.trainer_version,
                d.state.tag,
                clock.resyncs,
                engine_version=clock.engine_version,
                pending_version=pending,
                steps_since_sync=clock.steps_since_sync,
            )
            d.weights.keep_only(d.state)
            d.logger.log(step, metrics)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", refresh=False)
        log.info("step %d reward %.3f time %.2fs", step, metrics["reward/mean"], times.total)
        d.checkpoint_if_due(step)

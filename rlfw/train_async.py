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
from pathlib import Path
from typing import Any

import ray
from safetensors.torch import load_file, save_file

from rlfw.distributed.async_schedule import SyncClock, pipeline_depth, spans_versions, split_stale
from rlfw.distributed.groups import PendingGeneration
from rlfw.logging.progress import progress
from rlfw.run_state import RunState
from rlfw.tasks.base import Problem
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
from rlfw.train_report import StepTimes, decode_kv_staleness, step_report, time_metrics, trainer_numerics
from rlfw.types import WeightUpdate

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
    problems = d.setup.task.sample(d.run.algo.prompts_per_step, random.Random(f"{d.run.seed}:{step}"))
    pending = d.rollout.submit(request_for(problems, d.setup, d.run, step))
    return InFlight(step, problems, pending, clock.engine_version)


class EngineWeights:
    """The pushed versions an async checkpoint may need again, by reference into the object store.

    A resumed run must generate its next step at the version that step was submitted at, which the
    trainer has moved past, and then hold the version the engines held: a checkpoint writes both next to
    the trainer state (``engine-vN.safetensors``; the trainer's own version and version 0, the initial
    checkpoint, need no copy). Both transports leave each pushed version in the object store.
    """

    def __init__(self, d: Driver) -> None:
        self.d = d
        self.refs: dict[int, Any] = {}

    def publish(self, version: int) -> None:
        """Push the trainer's current weights as ``version`` and keep the reference."""
        ref = self.d.sync.publish(self.d.trainer, self.d.rollout, version, self.d.setup.contract.hash)
        if ref is not None:
            self.refs[version] = ref

    def keep_only(self, versions: set[int]) -> None:
        self.refs = {v: r for v, r in self.refs.items() if v in versions}

    def save(self, folder: Path, state: RunState) -> None:
        for v in _engine_versions(state):
            if v not in (0, state.version):
                update: WeightUpdate = ray.get(self.refs[v])
                save_file(
                    {k: t.contiguous() for k, t in update.state_dict.items()},
                    str(folder / f"engine-v{v}.safetensors"),
                    metadata={"version": str(v), "contract_hash": update.contract_hash},
                )

    def load(self, folder: Path, version: int, trainer_version: int) -> None:
        """Put the engines on ``version``: the trainer's (pushed from it), 0 (what they start with) or a
        saved one."""
        if version == trainer_version:
            self.publish(version)
        elif version > 0:
            state = load_file(str(folder / f"engine-v{version}.safetensors"))
            ref = ray.put(WeightUpdate(version, self.d.setup.contract.hash, state))
            self.d.rollout.load(ref)
            self.refs[version] = ref


def _engine_versions(state: RunState) -> set[int]:
    return {v for v in (state.pending_version, state.engine_version) if v is not None}


def resync(d: Driver, clock: SyncClock, weights: EngineWeights, lag_ess: float) -> bool:
    """Push the trainer's current version to the engines if the resync rule says so. The push lands after
    the generation in flight, or inside it with ``engine.in_flight=true``."""
    s = d.run.sync
    if not clock.due(s.policy, s.interval, s.ess_threshold, s.max_staleness, lag_ess):
        return False
    weights.publish(clock.trainer_version)
    clock.pushed()
    return True


def start(d: Driver, weights: EngineWeights, steps: range, depth: int) -> tuple[SyncClock, deque[InFlight]]:
    """The clock and the first submitted generations, for a new run or a resumed one.

    Resumed (the run state has ``pending_version``): the engines go back to the version the next step
    was submitted at, that step is submitted again (its seed depends only on the step, so it draws the
    same samples), then the engines move to the version they held after the checkpointed step. The run
    then continues exactly as it would have (with ``engine.in_flight=false``; in-flight updates land
    where timing puts them)."""
    st = d.state
    if st.pending_version is None or st.engine_version is None:
        clock = SyncClock(st.version, st.version, resyncs=st.resyncs)
        return clock, deque(submit(d, s, clock) for s in steps[:depth])
    folder = d.run_dir / CHECKPOINTS / st.tag
    clock = SyncClock(st.version, st.pending_version, st.steps_since_sync, st.resyncs)
    weights.load(folder, st.pending_version, st.version)
    queue = deque(submit(d, s, clock) for s in steps[:depth])
    if st.engine_version != st.pending_version:
        weights.load(folder, st.engine_version, st.version)
    clock.engine_version = st.engine_version
    return clock, queue


def async_steps(d: Driver) -> None:
    """Collect step s's samples, submit step s + 1, score, drop the too-stale, train, resync if due."""
    run = d.run
    weights = EngineWeights(d)
    d.on_checkpoint = weights.save
    steps = range(d.state.step + 1, run.trainer.steps)
    depth = pipeline_depth(run.sync.max_staleness)
    clock, queue = start(d, weights, steps, depth)
    for step in progress(steps, desc="rl steps"):
        t0 = time.perf_counter()
        flight = queue.popleft() if queue else submit(d, step, clock)
        samples = d.rollout.collect(flight.pending)  # drawn at the engines' version when submitted
        t1 = time.perf_counter()
        if depth and step + depth < run.trainer.steps:
            queue.append(submit(d, step + depth, clock))  # the engines generate while the trainer trains
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
        resynced = resync(d, clock, weights, float(metrics["ess/lag"]))
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
        weights.keep_only(_engine_versions(d.state))
        d.logger.log(step, metrics)
        log.info("step %d reward %.3f time %.2fs", step, metrics["reward/mean"], times.total)
        if checkpoint_due(run, step):
            checkpoint(d)

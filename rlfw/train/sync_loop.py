"""``sync.mode=sync``: generate with version v, score, train, publish v + 1. Every step is on-policy."""

from __future__ import annotations

import logging
import time

from rlfw.logging.progress import progress
from rlfw.train.evaluate import eval_due, evaluate
from rlfw.train.phases import Driver, score_step, step_prompts, train_on
from rlfw.train.report import StepTimes, step_report
from rlfw.train.state import RunState
from rlfw.train.stopping import stop_deferred

log = logging.getLogger("rlfw.train")


def sync_steps(d: Driver) -> None:
    """Each line of the loop is one phase of the algorithm; the details live one level down."""
    run = d.run
    bar = progress(range(d.state.step + 1, run.trainer.steps), desc="rl steps")
    for step in bar:
        state = d.state
        t0 = time.perf_counter()
        problems, request = step_prompts(d, step)
        samples = d.rollout.generate(request)  # generate with version v
        t1 = time.perf_counter()
        scored = score_step(d, step, problems, samples, state.version)
        if scored is None:
            continue
        with stop_deferred():  # a stop lands after the update is in the state and its row is logged
            trained = train_on(d, step, scored)
            t3 = time.perf_counter()
            d.weights.publish(state.version + 1)  # publish v + 1
            t4 = time.perf_counter()
            times = StepTimes(t1 - t0, trained.scored.reward_s, trained.train_s, t4 - t3, t4 - t0)
            metrics = step_report(trained, run.correction, state.version, state.resyncs + 1, times)
            metrics |= d.memory()
            metrics |= {
                "sync/engine_restarts": float(d.rollout.restarts),
                # the version the engines recorded
                "sync/engine_version": float(max(s.final_version for s in samples)),
            }
            if eval_due(run.eval.every, run.trainer.steps, step):
                metrics |= evaluate(d)
            d.state = RunState(step, state.version + 1, state.tag, state.resyncs + 1)
            d.weights.keep_only(d.state)
            d.logger.log(step, metrics)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", refresh=False)
        log.info("step %d reward %.3f time %.2fs", step, metrics["reward/mean"], times.total)
        d.checkpoint_if_due(step)

"""``rlfw train``: place the two pools, build the rollout and trainer groups, then run the step loop.

The loops themselves are :func:`rlfw.train.sync_loop.sync_steps` (``sync.mode=sync``) and
:func:`rlfw.train.async_loop.async_steps` (``sync.mode=async``); both run on the same pools.
"""

from __future__ import annotations

import errno
import logging
import shlex
import shutil
import signal
import sys
from dataclasses import asdict
from pathlib import Path

import ray

from rlfw.compose import to_yaml
from rlfw.config import RunConfig
from rlfw.distributed.cluster import ROLLOUT, TRAINER, init_ray, make_pool, shutdown_ray
from rlfw.distributed.cores import LEDGER_FILE, create_ledger
from rlfw.distributed.groups import RolloutGroup, TrainerGroup, TrainerRankDied
from rlfw.distributed.weight_sync import BroadcastStuck, make_sync
from rlfw.logging.logger import RunLogger
from rlfw.train.async_loop import async_steps
from rlfw.train.checkpoint import CheckpointFailed, EngineWeights, checkpoint_folder, restore
from rlfw.train.phases import Driver, StalledRun
from rlfw.train.setup import CONTRACT_FILE, build_setup, optim_config, settle_environment, step_spec
from rlfw.train.state import STATE_FILE, RunState, make_run_dir, read_state
from rlfw.train.stopping import Terminated, handle_stop_signals
from rlfw.train.sync_loop import sync_steps
from rlfw.trainer.deepspeed_backend import saved_zero_stage

log = logging.getLogger("rlfw.train")

CONFIG_FILE = "config.yaml"  # the run's composed config, in its folder
RECORDS = (CONFIG_FILE, CONTRACT_FILE)  # what the checks write into the run folder


def train(run: RunConfig) -> int:
    """Run ``run`` to its last step; returns the exit code (130 after Ctrl-C, with a checkpoint saved)."""
    if run.sync.mode == "sync" and run.engine.in_flight:
        log.warning(
            "engine.in_flight=true has no effect with sync.mode=sync: weights move only between steps"
        )
    folder = make_run_dir(run.logger.run_root, run.logger.run_name, run.resume)
    run_dir = folder.path
    if run.resume and not folder.resuming:
        log.warning("%s holds no checkpoint: starting the run afresh there", run_dir)
    before = {} if folder.created else _records(run_dir)
    try:  # the checks: a run that fails them leaves no folder behind, and an existing folder as it was
        # first, before anything is written: a resumed run's checkpoint decides the ZeRO stage
        saved = saved_zero_stage(checkpoint_folder(run_dir, read_state(run_dir))) if folder.resuming else None
        optim = optim_config(run, saved)
        log.info("trainer: DeepSpeed ZeRO stage %d", optim.zero_stage)
        (run_dir / CONFIG_FILE).write_text(to_yaml(run))
        setup = build_setup(run, run_dir)
        init_ray(run.engine.num_actors, run.trainer.num_ranks, run.ray_address)
        rollout_pool = make_pool(ROLLOUT, run.engine.num_actors)
        trainer_pool = make_pool(TRAINER, run.trainer.num_ranks)
        ledger = None
        if run.lend_idle_cores:  # one machine: the pools lend each other the cores of a finished phase
            ledger = str(create_ledger(run_dir, run.engine.num_actors + run.trainer.num_ranks))
        # the actors report their fingerprints before anything is built in them
        rollout = RolloutGroup(rollout_pool, setup.model, run.engine, setup.stop_ids, ledger)
        seat = run.engine.num_actors  # the trainer ranks sit after the engines in the ledger
        trainer = TrainerGroup(trainer_pool, setup.model, optim, run.trainer.cpu_threads, ledger, seat)
        fingerprints = trainer.fingerprints(run.engine.name) | rollout.fingerprints()
        setup = settle_environment(run, setup, run_dir, fingerprints)
        engines = rollout.start(setup.contract.hash)
        trainer.start(step_spec(run, setup))
        ray.get(engines)
    except BaseException:
        if folder.created:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:  # the folder was there (a resume): put back the records the checks wrote over
            _put_back(run_dir, before)
            (run_dir / LEDGER_FILE).unlink(missing_ok=True)
        if ray.is_initialized():
            shutdown_ray()
        raise
    weights = EngineWeights(make_sync(run.sync.transport), trainer, rollout, setup.contract.hash)
    state = (
        restore(run_dir, trainer, weights)
        if folder.resuming
        else RunState(step=-1, version=0, tag="", resyncs=0)
    )
    logger = RunLogger(
        run_dir,
        run.logger.wandb,
        run.logger.wandb_mode,
        run.logger.project,
        run_dir.name,
        {"run": asdict(run)},
        # resuming: rewrite from the next step; starting afresh in a used folder: drop its old rows
        resume_from_step=state.step + 1 if folder.resuming else (0 if run.resume else None),
        group=run.logger.group,
    )
    driver = Driver(run, setup, rollout, trainer, weights, logger, run_dir, state)
    code = 0
    previous = handle_stop_signals()
    try:
        if run.sync.mode == "async":
            async_steps(driver)
        else:
            sync_steps(driver)
    except KeyboardInterrupt as stop:
        what = "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"
        log.warning("%s: saving a checkpoint at step %d before exiting", what, driver.state.step)
        code = 143 if isinstance(stop, Terminated) else 130
        if driver.state.step >= 0:
            try:
                driver.checkpoint()
            except CheckpointFailed as err:
                log.error("rlfw train: %s", err)
    except CheckpointFailed as err:
        log.error("rlfw train: stopped: %s", err)
        code = 1
    except StalledRun as err:
        log.error("rlfw train: stopped: %s", err)
        code = 1
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        log.error(
            "rlfw train: stopped: no space left on the disk holding %s; free some space, then continue "
            "from %s with: %s",
            err.filename or run_dir,
            last_saved(run_dir),
            resume_command(run_dir),
        )
        code = 1
    except (TrainerRankDied, BroadcastStuck) as err:
        log.error(
            "rlfw train: %s; continue the run from %s with: %s",
            err,
            last_saved(run_dir),
            resume_command(run_dir),
        )
        code = 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        logger.close()
        close_task = getattr(setup.task, "close", None)  # task=dataset's reward workers
        if close_task is not None:
            close_task()
        try:
            trainer.shutdown()
        finally:
            shutdown_ray()
            (run_dir / LEDGER_FILE).unlink(missing_ok=True)
    return code


def _records(run_dir: Path) -> dict[str, bytes]:
    return {name: (run_dir / name).read_bytes() for name in RECORDS if (run_dir / name).is_file()}


def _put_back(run_dir: Path, before: dict[str, bytes]) -> None:
    for name in RECORDS:
        if name in before:
            (run_dir / name).write_bytes(before[name])
        else:
            (run_dir / name).unlink(missing_ok=True)


def last_saved(run_dir: Path) -> str:
    """Where ``resume=true`` would continue from, in words."""
    if not (run_dir / STATE_FILE).is_file():
        return "step 0"
    return f"the checkpoint of step {read_state(run_dir).step}"


def resume_command(run_dir: Path) -> str:
    """The command that continues this run: this process's ``rlfw train`` arguments with the run's folder
    named and ``resume=true``."""
    args = sys.argv[2:] if len(sys.argv) > 1 and sys.argv[1] == "train" else []
    keep = [a for a in args if not a.startswith(("resume=", "logger.run_name=", "logger.run_root="))]
    where = [f"logger.run_root={run_dir.parent}", f"logger.run_name={run_dir.name}", "resume=true"]
    return shlex.join(["rlfw", "train", *keep, *where])

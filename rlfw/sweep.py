"""``rlfw train -m KEY=A,B KEY2=X,Y``: a sweep, one ``rlfw train`` run per combination.

Values are read with Hydra's override grammar (``a,b``, ``range(0,3)``, ``choice(...)``, quoted strings,
lists in brackets), and jobs are ordered as Hydra orders them (the last key varies fastest). Every job's
config is composed and validated before the first one starts, so a bad value stops the sweep before any
work is done.

Layout: ``<logger.run_root>/<sweep name>/`` holds ``sweep.json`` (the common overrides, the swept keys and
values, each job's overrides and exit code) and one run folder per job, named by its index and swept
values (``00-correction=none,seed=0``). The sweep name is ``logger.run_name`` when given (so
``logger.run_name=NAME resume=true`` resumes every job of a sweep), else ``sweep-<timestamp>``; it is
also each job's W&B group unless ``logger.group`` names another, so the sweep is one group in W&B.

Launchers (``launcher=...``): ``local`` runs the jobs on this machine, each in a fresh process, one after
another or ``launcher.parallel`` at a time; ``submitit_slurm`` / ``submitit_local`` submit them as one
submitit array job (SLURM, or local subprocesses) and wait for all of them.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfw.config import ConfigError, LauncherConfig, RunConfig

SWEEP_FILE = "sweep.json"
MULTIRUN_FLAGS = ("-m", "--multirun")
# Where a sweep puts its jobs: the user names the sweep with these; they are not swept.
PLACEMENT_KEYS = ("logger.run_root", "logger.run_name", "logger.group")


@dataclass
class Job:
    name: str
    overrides: list[str]  # the user's overrides for this job (common and swept), without the sweep's
    params: dict[str, str]  # swept key -> this job's value
    exit_code: int | None = None


@dataclass
class Sweep:
    folder: Path
    group: str  # the W&B group of every job
    common: list[str]
    swept: dict[str, list[str]]
    jobs: list[Job] = field(default_factory=list)

    def job_overrides(self, job: Job) -> list[str]:
        """What ``rlfw train`` runs for ``job``: its overrides, placed in the sweep folder and W&B group."""
        return [
            *job.overrides,
            f"logger.run_root={quote(str(self.folder))}",
            f"logger.run_name={quote(job.name)}",
            f"logger.group={quote(self.group)}",
        ]

    def save(self) -> None:
        record = {
            "name": self.folder.name,
            "group": self.group,
            "common": self.common,
            "swept": self.swept,
            "jobs": [vars(job) for job in self.jobs],
        }
        tmp = self.folder / f".{SWEEP_FILE}.tmp"
        tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, self.folder / SWEEP_FILE)


def quote(value: str) -> str:
    """``value`` as a quoted string of Hydra's override grammar (a job name holds ``=`` and ``,``)."""
    return "'" + value.replace("'", "\\'") + "'"


def is_multirun(args: list[str]) -> bool:
    return any(a in MULTIRUN_FLAGS for a in args)


def expand(overrides: list[str]) -> tuple[list[str], dict[str, list[str]], list[list[str]]]:
    """(common overrides, swept key -> values, each job's overrides) in Hydra's order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:
        raise ConfigError(f"sweep overrides: {str(err).splitlines()[0]}") from err
    common, axes, swept = [], [], {}
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            values = list(o.sweep_string_iterator())
            swept[key] = values
            axes.append([f"{key}={v}" for v in values])
        else:
            common.append(str(o.input_line))
    for o in parsed:
        if o.is_sweep_override() and o.key_or_group in PLACEMENT_KEYS:
            raise ConfigError(
                f"{o.key_or_group} places the whole sweep (its folder, its W&B group); it cannot be swept"
            )
    combos = [list(combo) for combo in itertools.product(*axes)] if axes else [[]]
    jobs = []
    for combo in combos:  # each job's overrides keep the order the user wrote them in
        chosen = dict(c.split("=", 1) for c in combo)
        jobs.append(
            [
                f"{o.get_key_element()}={chosen[o.get_key_element()]}"
                if o.is_sweep_override()
                else str(o.input_line)
                for o in parsed
            ]
        )
    return common, swept, jobs


def short_key(key: str) -> str:
    """A swept key as names show it: ``+experiment/lag`` -> ``lag``, ``engine.kv_policy`` as it is."""
    return key.lstrip("+~").split("/")[-1]


def job_name(index: int, params: dict[str, str]) -> str:
    """``03-correction=tis,seed=1``: index first (so folders sort in launch order), then the swept values."""
    values = ",".join(f"{short_key(k)}={v}" for k, v in params.items())
    safe = re.sub(r"[^A-Za-z0-9=,._+-]", "_", values)[:120]
    return f"{index:02d}-{safe}" if safe else f"{index:02d}"


def plan(overrides: list[str]) -> tuple[Sweep, RunConfig]:
    """Compose every job (refusing the sweep if one is invalid); returns the sweep and the first config."""
    from rlfw.compose import load_config, recipe_sweep, split_config_dirs

    args = [a for a in overrides if a not in MULTIRUN_FLAGS]
    config_dirs, args = split_config_dirs(args)
    dirs = [f"--config-dir={d}" for d in config_dirs]
    # The recipe's own sweep (hydra.sweeper.params) first; a key given on the command line replaces it.
    given = {a.split("=", 1)[0].lstrip("+~") for a in args}
    declared = [o for o in recipe_sweep([*dirs, *args]) if o.split("=", 1)[0].lstrip("+~") not in given]
    common, swept, job_args = expand([*declared, *args])
    configs = []
    for args_ in job_args:
        try:
            configs.append(load_config([*dirs, *args_]))
        except ConfigError as err:
            raise ConfigError(f"job {' '.join(args_) or '(no overrides)'}: {err}") from err
    first = configs[0]
    name = first.logger.run_name or time.strftime("sweep-%Y%m%d-%H%M%S")
    folder = Path(first.logger.run_root).resolve() / name
    sweep = Sweep(folder, first.logger.group or name, common, swept)
    for i, args_ in enumerate(job_args):
        params = {k: a.split("=", 1)[1] for a in args_ for k in swept if a.split("=", 1)[0] == k}
        user = [*dirs, *(a for a in args_ if not a.startswith(tuple(f"{k}=" for k in PLACEMENT_KEYS)))]
        sweep.jobs.append(Job(job_name(i, params), user, params))
    return sweep, first


def run_sweep(overrides: list[str]) -> int:
    """Plan, create the sweep folder, launch every job; 0 if every job succeeded, else 1."""
    sweep, first = plan(overrides)
    if sweep.folder.exists() and not first.resume:
        raise FileExistsError(
            f"sweep folder {sweep.folder} exists; pick another logger.run_name, or resume=true to continue it"
        )
    sweep.folder.mkdir(parents=True, exist_ok=True)
    sweep.save()
    print(f"rlfw sweep: {len(sweep.jobs)} jobs in {sweep.folder}", flush=True)
    try:
        launch(sweep, first)
    except KeyboardInterrupt:
        sweep.save()
        again = [a for a in overrides if not a.startswith(("logger.run_name=", "resume="))]
        again += [f"logger.run_name={sweep.folder.name}", "resume=true"]
        print(
            "rlfw sweep: stopped; the running jobs saved a checkpoint, the rest did not start. Continue: "
            + shlex.join(["rlfw", "train", *again]),
            flush=True,
        )
        return 130
    sweep.save()
    failed = [job.name for job in sweep.jobs if job.exit_code != 0]
    for job in sweep.jobs:
        print(f"  {job.name}: exit {job.exit_code}", flush=True)
    if failed:
        print(f"rlfw sweep: {len(failed)} of {len(sweep.jobs)} jobs failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


def launch(sweep: Sweep, run: RunConfig) -> None:
    """Run every job with the launcher the (first job's) config names."""
    if run.launcher.name == "submitit":
        launch_submitit(sweep, run.launcher)
    else:
        launch_local(sweep, run.launcher.parallel)


def train_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "rlfw", "train", *args]


def launch_local(sweep: Sweep, parallel: int = 1) -> None:
    """The jobs on this machine, ``parallel`` at a time in launch order, each a fresh process (its own
    Ray). With one at a time a job prints to this terminal; with more, each job's output goes to
    ``<sweep folder>/<job name>.log``. A failed job does not stop the others. Ctrl-C or SIGTERM stops the
    sweep: each running job gets the signal once (a job runs in its own session, so the terminal's Ctrl-C
    reaches it only through here), checkpoints and exits, the jobs not yet started are not started, and
    ``KeyboardInterrupt`` is raised once every running job has exited. A job that exits 130 or 143 (it
    was stopped by a signal of its own) stops the sweep the same way."""
    local = _LocalJobs(sweep, parallel)
    previous = {sig: signal.signal(sig, local.stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        local.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if local.stopped:
        raise KeyboardInterrupt


class _LocalJobs:
    """The state of a local sweep while it runs: the jobs not yet started, the running processes, and
    whether a stop was asked for. Threads wait on the processes; the main thread handles signals."""

    def __init__(self, sweep: Sweep, parallel: int) -> None:
        self.sweep = sweep
        self.parallel = parallel
        self.pending = list(sweep.jobs)
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped = False  # no job starts any more
        self.signalled = False  # this process got SIGINT or SIGTERM (and passed it on)
        self.lock = threading.Lock()  # over pending, running, stopped, signalled and the sweep record

    def run(self) -> None:
        with ThreadPoolExecutor(max_workers=self.parallel) as pool:
            for future in [pool.submit(self.run_next) for _ in self.sweep.jobs]:
                future.result()

    def run_next(self) -> None:
        """Start the next job (unless the sweep is stopping), wait for it, record its exit code."""
        with self.lock:
            if self.stopped or not self.pending:
                return
            job = self.pending.pop(0)
            log = None if self.parallel == 1 else self.sweep.folder / f"{job.name}.log"
            where = f" (output: {log})" if log else ""
            print(f"rlfw sweep: job {job.name}{where}", flush=True)
            out = None if log is None else log.open("ab")
            try:
                process = subprocess.Popen(
                    train_command(self.sweep.job_overrides(job)),
                    stdout=out,
                    stderr=None if out is None else subprocess.STDOUT,
                    start_new_session=True,
                )
            finally:
                if out is not None:
                    out.close()  # the job holds its own copy of the file
            self.running[job.name] = process
        code = process.wait()
        with self.lock:
            del self.running[job.name]
            job.exit_code = code
            self.sweep.save()
            if self.parallel > 1:
                done, total = sum(j.exit_code is not None for j in self.sweep.jobs), len(self.sweep.jobs)
                print(f"rlfw sweep: job {job.name}: exit {code} ({done} of {total} done)", flush=True)
            if code in (130, 143):  # the job was stopped by Ctrl-C / SIGTERM: stop the sweep too
                self.stopped = True

    def stop(self, signum: int, frame: object) -> None:
        """The signal handler (main thread): pass ``signum`` on to every running job once; start no more
        jobs. A second signal only says what is happening: the jobs are already checkpointing."""
        with self.lock:
            if self.signalled:
                print("rlfw sweep: stopping; the running jobs are saving their checkpoints", flush=True)
                return
            self.signalled = True
            self.stopped = True
            for process in self.running.values():
                process.send_signal(signum)


def launch_submitit(sweep: Sweep, cfg: LauncherConfig) -> None:
    """The jobs as one submitit array job; waits for every job and records its exit code."""
    try:
        import submitit
    except ImportError as err:
        raise ConfigError("launcher=submitit_* needs submitit: pip install submitit") from err
    executor = submitit.AutoExecutor(folder=sweep.folder / ".submitit", cluster=cfg.cluster)
    params: dict[str, Any] = {
        "timeout_min": cfg.timeout_min,
        "gpus_per_node": cfg.gpus_per_node,
        "cpus_per_task": cfg.cpus_per_task,
        "mem_gb": cfg.mem_gb,
    }
    if cfg.cluster == "slurm":
        params["slurm_array_parallelism"] = cfg.array_parallelism
        if cfg.partition:
            params["slurm_partition"] = cfg.partition
    executor.update_parameters(**params)
    with executor.batch():
        handles = [executor.submit(run_job, train_command(sweep.job_overrides(job))) for job in sweep.jobs]
    for job, handle in zip(sweep.jobs, handles, strict=True):
        print(f"rlfw sweep: job {job.name} submitted as {handle.job_id}", flush=True)
    for job, handle in zip(sweep.jobs, handles, strict=True):
        try:
            job.exit_code = int(handle.result())
        except Exception as err:  # noqa: BLE001 - a job that died: recorded, the others still count
            print(f"rlfw sweep: job {job.name} did not finish: {str(err).splitlines()[0]}", flush=True)
            job.exit_code = -1
        sweep.save()


def run_job(command: list[str]) -> int:
    """A submitit job's body: run ``rlfw train`` with the job's overrides and return its exit code."""
    return subprocess.call(command)

"""Submit a recipe to a running Ray cluster as a Ray job.

    python launch/submit.py --address http://HEAD:8265 --recipe default \\
        --env WANDB_MODE=offline -- trainer.steps=100 logger.run_root=/shared/runs

runs ``ray job submit ... -- VENV/bin/rlfw train recipe=NAME ray_address=auto OVERRIDES`` on the cluster. The
job's driver starts on the head node inside the cluster, where ``ray_address=auto`` joins that cluster
(the job server exports its address as ``RAY_ADDRESS``) instead of starting a local Ray.

What the job carries (the runtime env):

- ``working_dir``: a staged copy of exactly what a run reads from the checkout: ``rlfw/``, with ``kernels/``
  placed at ``rlfw/kernels`` (the layout ``pip install`` gives, see ``package-dir`` in pyproject.toml),
  ``configs/`` and ``recipes/``. Ray unpacks it on every node and puts it first on ``PYTHONPATH`` for the
  driver and every actor, so the code that runs is the code submitted, whichever way the nodes' venv
  installed rlfw. We stage rather than upload the checkout with ``excludes``: uploading the checkout would
  put its ``rlfw/`` first on the path without ``rlfw.kernels`` (that folder lives at the top of the
  repository), and the upload holds nothing else by construction (no ``.venv``, ``runs/``, ``wandb/``,
  ``.git``, caches), so it stays around a megabyte.
- ``env_vars``: what ``--env`` names, plus ``RAY_OVERRIDE_JOB_RUNTIME_ENV=1``: rlfw's ``ray.init`` passes its
  own ``env_vars`` to the actors (``rlfw.distributed.cluster.worker_env``), and Ray refuses to merge a job's
  and a driver's runtime env that name the same variable unless told the driver's values win (they are the
  same values: the driver reads them from its environment, which the job set).

What must already be on every node: the same venv, at the same path (``--venv``, default: the one running
this script), with rlfw's dependencies (torch, ray[default] of the same version as the head, deepspeed,
...). Only the venv's interpreter, libraries and ``bin/rlfw`` launcher are used; rlfw's own code comes
from the working dir.

Run folders: pass an absolute ``logger.run_root`` on storage the head node can write and you can read; a
relative one (the default ``runs``) resolves inside the job's working dir, which Ray deletes with the
session. ``--dry-run`` prints the command instead of running it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a run reads from the checkout, as (source, destination in the working dir).
STAGED = (("rlfw", "rlfw"), ("kernels", "rlfw/kernels"), ("configs", "configs"), ("recipes", "recipes"))
SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc")
# Set for every job; see the module docstring.
JOB_ENV = {"RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"}


def stage_working_dir(root: Path, dest: Path) -> Path:
    """Copy what a run reads from the checkout ``root`` into ``dest``, laid out as installed."""
    for src, dst in STAGED:
        shutil.copytree(root / src, dest / dst, ignore=SKIPPED)
    return dest


def parse_env(items: list[str], environ: dict[str, str]) -> dict[str, str]:
    """``KEY=VALUE`` sets a variable; a bare ``KEY`` forwards this shell's value (an error if unset)."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            if key not in environ:
                raise SystemExit(f"submit: --env {key}: not set in this shell; pass --env {key}=VALUE")
            value = environ[key]
        env[key] = value
    return env


def entrypoint(venv: Path, recipe: str, overrides: list[str]) -> list[str]:
    return [str(venv / "bin" / "rlfw"), "train", f"recipe={recipe}", "ray_address=auto", *overrides]


def write_runtime_env(runtime_env: Mapping[str, object], folder: Path) -> Path:
    """The runtime env as a file only this user can read: ``--env`` values (W&B keys, tokens) stay off
    the ``ray job submit`` command line, where ``ps`` and ``--dry-run`` would show them."""
    path = folder / "runtime_env.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(runtime_env, f)
    return path


def submit_command(
    ray: str,
    address: str | None,
    runtime_env_file: Path,
    job: list[str],
    submission_id: str | None,
    wait: bool,
) -> list[str]:
    """``ray job submit``; waiting, it streams the job's log and exits 1 if the job failed."""
    cmd = [ray, "job", "submit", "--runtime-env", str(runtime_env_file)]
    if address:
        cmd += ["--address", address]
    if submission_id:
        cmd += ["--submission-id", submission_id]
    if not wait:
        cmd.append("--no-wait")
    return [*cmd, "--", *job]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="launch/submit.py",
        description="Submit `rlfw train recipe=NAME ray_address=auto OVERRIDES` to a Ray cluster as a job.",
    )
    p.add_argument("--address", help="the job server, http://HEAD:8265 (default: $RAY_ADDRESS, else local)")
    p.add_argument("--recipe", default="default", help="a recipe in recipes/ (default: default)")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="an environment variable for the driver and every actor; repeat. A bare KEY forwards ours",
    )
    p.add_argument(
        "--venv",
        type=Path,
        default=Path(sys.prefix),
        help="the venv on the nodes, same path on each (default: %(default)s)",
    )
    p.add_argument("--submission-id", help="the job's id (default: one Ray picks)")
    p.add_argument("--no-wait", action="store_true", help="return once submitted; do not follow the log")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of submitting")
    p.add_argument("overrides", nargs="*", help="rlfw overrides, after `--` (key=value ...)")
    return p.parse_args(argv)


def warn_run_root(overrides: list[str]) -> None:
    roots = [o.removeprefix("logger.run_root=") for o in overrides if o.startswith("logger.run_root=")]
    if not roots or not os.path.isabs(roots[-1]):
        print(
            "submit: warning: logger.run_root is not an absolute path, so the run folder lands inside the "
            "job's working dir on the head node and is deleted with the Ray session; pass "
            "logger.run_root=/shared/path",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ours = Path(sys.prefix) / "bin" / "ray"  # the Ray CLI of the venv running this script, else PATH's
    ray = str(ours) if ours.exists() else shutil.which("ray") or "ray"
    env = JOB_ENV | parse_env(args.env, dict(os.environ))
    job = entrypoint(args.venv, args.recipe, args.overrides)
    warn_run_root(args.overrides)
    with tempfile.TemporaryDirectory(prefix="rlfw-job-") as tmp:
        working_dir = stage_working_dir(ROOT, Path(tmp) / "working_dir")
        runtime_env = {"working_dir": str(working_dir), "env_vars": env}
        env_file = write_runtime_env(runtime_env, Path(tmp))
        cmd = submit_command(ray, args.address, env_file, job, args.submission_id, not args.no_wait)
        if args.dry_run:
            print(shlex.join(cmd))
            print(
                f"# {env_file}: working_dir {working_dir}; "
                f"env_vars {', '.join(sorted(env))} (values not shown)"
            )
            return 0
        # `ray job submit` uploads the working dir before it returns or starts following the log, so the
        # staged copy can go when it exits.
        return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())

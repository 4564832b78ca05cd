"""``rlfw train | audit | report``: the one command-line entry point (also ``python -m rlfw``)."""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

from rlfw.config import ConfigError

USAGE = """rlfw VERB [overrides...]

verbs:
  train   [recipe=NAME] [key=value ...]   the main job; no recipe runs the embedded default
          ... --cfg job                    print the composed config and exit
  train   -m KEY=A,B [KEY2=X,Y ...]        a sweep: one run per combination, in one sweep folder
          [launcher=local|submitit_slurm|submitit_local]
  train   --config-dir DIR recipe=NAME     your own recipe (DIR/NAME.yaml) over rlfw's configs/
  audit   [model.path=DIR] [key=value ...] the validation ladder on one checkpoint, as JSON
  report  RUN_DIR                          render per-factor plots from a run's metrics.jsonl
  report  SWEEP_DIR | RUN_DIR RUN_DIR ...  one interactive page comparing runs, grouped by what
          [--out FILE]                     differs between them (seeds pooled, 95%% bands)
"""


def cmd_train(overrides: list[str]) -> int:
    import logging

    from rlfw.compose import load_config
    from rlfw.sweep import is_multirun, run_sweep
    from rlfw.train.run import train

    if is_multirun(overrides) and "--cfg" not in overrides:
        return run_sweep(overrides)
    if "--cfg" in overrides:  # Hydra's `--cfg job`: print the composed config, run nothing
        from rlfw.compose import to_yaml

        at = overrides.index("--cfg")
        what = overrides[at + 1] if at + 1 < len(overrides) else ""
        if what != "job":
            print(
                f"rlfw train: --cfg {what!r}: only `--cfg job` (the composed run config) is printed",
                file=sys.stderr,
            )
            return 2
        rest = overrides[:at] + overrides[at + 2 :]
        if is_multirun(rest):  # a sweep: every job's config, under a header naming the job
            from rlfw.sweep import plan

            sweep, _ = plan(rest)
            for job in sweep.jobs:
                print(f"# job {job.name}\n{to_yaml(load_config(sweep.job_overrides(job)))}", end="")
            return 0
        print(to_yaml(load_config(rest)), end="")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return train(load_config(overrides))


def cmd_audit(overrides: list[str]) -> int:
    import json

    from rlfw.audit.ladder import run_audit
    from rlfw.compose import load_config

    report, code = run_audit(load_config(overrides))
    print(json.dumps(report, indent=2))
    return code


def cmd_report(args: list[str]) -> int:
    from rlfw.logging.compare import SWEEP_FILE, render_compare
    from rlfw.logging.jsonl import MetricsFileError
    from rlfw.logging.report import render_report

    out = None
    if "--out" in args:
        at = args.index("--out")
        if at + 1 >= len(args):
            print("rlfw report: --out needs a file name", file=sys.stderr)
            return 2
        out, args = args[at + 1], args[:at] + args[at + 2 :]
    if not args:
        print("usage: rlfw report RUN_DIR | SWEEP_DIR | RUN_DIR RUN_DIR ... [--out FILE]", file=sys.stderr)
        return 2
    try:
        if len(args) == 1 and not (Path(args[0]) / SWEEP_FILE).is_file():
            page = render_report(args[0])
        else:
            page = render_compare(args, out)
    except MetricsFileError as err:
        print(f"rlfw report: {err}", file=sys.stderr)
        return 1
    print(page)
    return 0


VERBS = {"train": cmd_train, "audit": cmd_audit, "report": cmd_report}


def config_options() -> str:
    """The config groups and their options (``GROUP=OPTION``) and the shipped recipes, for ``--help``."""
    from rlfw.compose import available_recipes, project_root

    lines = ["config groups (GROUP=OPTION; every field: rlfw train --cfg job, documented in rlfw/config.py):"]
    for folder in sorted(p for p in (project_root() / "configs").iterdir() if p.is_dir()):
        options = sorted(f.stem for f in folder.glob("*.yaml"))
        if options:
            lines.append(f"  {folder.name:<11} {' | '.join(options)}")
    lines.append(f"recipes (recipe=NAME): {', '.join(available_recipes())}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rlfw",
        usage=USAGE,
        add_help=True,
        epilog=config_options(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("verb", choices=sorted(VERBS))
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    try:
        return VERBS[ns.verb](ns.rest)
    except ConfigError as err:
        print(f"rlfw {ns.verb}: config error: {err}", file=sys.stderr)
        return 2
    except input_errors() as err:
        print(f"rlfw {ns.verb}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


def input_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input (a checkpoint, dataset, run folder or unsupported setting), reported in
    one line rather than as a traceback."""
    from rlfw.contract import ContractMismatch
    from rlfw.model import CheckpointError, ModelConfigError
    from rlfw.rollout.vllm.checks import VllmCheckpointError, VllmUnavailableError
    from rlfw.tasks.gsm8k import DatasetError
    from rlfw.tokenizer import TokenizerError

    return (
        CheckpointError,
        ModelConfigError,
        TokenizerError,
        DatasetError,
        FileExistsError,
        FileNotFoundError,
        NotImplementedError,
        VllmUnavailableError,
        VllmCheckpointError,
        ContractMismatch,
    )


def entry() -> None:
    """The ``rlfw`` command: :func:`main`, then the exit. ``gc.freeze()`` first, so that the interpreter's
    shutdown does not walk every object torch and its peers created: 0.7 of the 2.7 s a bare ``import
    rlfw.train.run`` took from start to exit. Objects in reference cycles are then not collected at the
    exit, so their ``__del__`` does not run; ``atexit`` handlers (``weakref.finalize`` among them) still
    do, and every rlfw command closes its files, loggers, pools and Ray before :func:`main` returns. (Only
    here: in a process that goes on after :func:`main`, frozen objects would never be collected.)"""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()

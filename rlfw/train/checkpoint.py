"""What a checkpoint holds, in one place: the trainer's state, the engine weight versions an async run
still needs, and the run state that points at both.

Order of writes: trainer state first (DeepSpeed writes a tag folder), then the engine versions into the
same folder, then ``run_state.json`` (atomically). A crash before the last write leaves the previous run
state, and the previous checkpoint, in force. A write that fails (a full disk above all) removes the
partial tag folder and raises :class:`CheckpointFailed`, whose one line says what happened and that the
previous checkpoint is intact.

Engine versions: a resumed async run must generate its next step at the version that step was submitted
at, which the trainer has moved past, and then hold the version the engines held. Both are written next to
the trainer state (``engine-vN.safetensors``); the trainer's own version and version 0 (the initial
checkpoint) need no copy. A sync run's engines always hold the trainer's version, so it writes none.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
from safetensors.torch import load_file, save_file

from rlfw.distributed.groups import RolloutGroup, TrainerGroup
from rlfw.distributed.weight_sync import WeightSync
from rlfw.logging.progress import progress
from rlfw.train.state import STATE_FILE, RunState, read_state, write_state
from rlfw.types import WeightUpdate

CHECKPOINTS = "checkpoints"


class EngineWeights:
    """Pushes trainer weights to the engines and keeps, by reference into the object store, the pushed
    versions a checkpoint may need again (both transports leave each pushed version there)."""

    def __init__(
        self, sync: WeightSync, trainer: TrainerGroup, rollout: RolloutGroup, contract_hash: str
    ) -> None:
        self.sync, self.trainer, self.rollout, self.contract_hash = sync, trainer, rollout, contract_hash
        self.refs: dict[int, Any] = {}

    def publish(self, version: int) -> None:
        """Push the trainer's current weights as ``version``; returns once every engine holds it."""
        ref = self.sync.publish(self.trainer, self.rollout, version, self.contract_hash)
        if ref is not None:
            self.refs[version] = ref

    def keep_only(self, state: RunState) -> None:
        """Forget pushed versions that ``state``'s checkpoint would not need."""
        needed = engine_versions(state)
        self.refs = {v: r for v, r in self.refs.items() if v in needed}

    def save(self, folder: Path, state: RunState) -> None:
        for v in engine_versions(state):
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
            ref = ray.put(WeightUpdate(version, self.contract_hash, state))
            self.rollout.load(ref)
            self.refs[version] = ref


def engine_versions(state: RunState) -> set[int]:
    """The engine versions an async checkpoint keeps (none in sync runs)."""
    return {v for v in (state.pending_version, state.engine_version) if v is not None}


class CheckpointFailed(RuntimeError):
    """A checkpoint could not be written; the previous one is intact (the message says which)."""


def save_checkpoint(run_dir: Path, trainer: TrainerGroup, weights: EngineWeights, state: RunState) -> None:
    """Write a resumable checkpoint of ``state`` (the write order is in the module docstring)."""
    tag = f"step{state.step:06d}"
    previous = read_state(run_dir).tag if (run_dir / STATE_FILE).is_file() else ""
    if tag == previous:
        return  # this step's checkpoint is the one in force already
    folder = run_dir / CHECKPOINTS / tag
    try:
        with progress(total=3, desc=f"checkpoint {tag}") as bar:
            trainer.save(str(run_dir / CHECKPOINTS), tag)
            bar.update()
            weights.save(folder, state)
            bar.update()
            state.tag = tag
            write_state(run_dir, state)
            bar.update()
    except Exception as err:
        state.tag = previous
        shutil.rmtree(folder, ignore_errors=True)  # never pointed at: run_state.json still names `previous`
        raise CheckpointFailed(failure_message(err, run_dir, tag, previous)) from err


def failure_message(err: BaseException, run_dir: Path, tag: str, previous: str) -> str:
    """One line: what failed, ``no space left`` when the disk is (or was) full, and what is intact."""
    kept = f"the previous checkpoint ({previous}) is intact" if previous else "no earlier checkpoint exists"
    where = run_dir / CHECKPOINTS
    free = shutil.disk_usage(run_dir).free
    needed = folder_bytes(where / previous) if previous else 0
    if any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in causes(err)) or free <= needed:
        return (
            f"checkpoint {tag} could not be written: no space left on the disk holding {where} "
            f"({free / 2**20:.1f} MiB free, the last checkpoint takes {needed / 2**20:.1f} MiB); {kept}: "
            "free some space, then continue with resume=true"
        )
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"checkpoint {tag} could not be written ({type(err).__name__}: {first}); {kept}"


def causes(err: BaseException) -> Iterator[BaseException]:
    """``err``, what caused it, and what a Ray task error carries from the remote side."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def restore(run_dir: Path, trainer: TrainerGroup, weights: EngineWeights) -> RunState:
    """Load the last checkpoint's trainer state; a sync run's engines get the trainer's version. An async
    run's engines are put back by its loop, which interleaves them with resubmitting the pending step
    (:func:`rlfw.train.async_loop.start`)."""
    state = read_state(run_dir)
    trainer.load(str(run_dir / CHECKPOINTS), state.tag)
    if state.pending_version is None:
        weights.publish(state.version)
    return state


def checkpoint_folder(run_dir: Path, state: RunState) -> Path:
    return run_dir / CHECKPOINTS / state.tag


def checkpoint_due(every: int, steps: int, step: int) -> bool:
    """Every ``every`` steps and after the last of ``steps``."""
    return (step + 1) % every == 0 or step + 1 == steps

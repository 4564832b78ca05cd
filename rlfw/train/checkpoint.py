"""What a checkpoint holds, in one place: the trainer's state, the engine weight versions an async run
still needs, and the run state that points at both.

Order of writes: trainer state first (DeepSpeed writes a tag folder), then the engine versions into the
same folder, then ``run_state.json`` (atomically). A crash before the last write leaves the previous run
state, and the previous checkpoint, in force.

Engine versions: a resumed async run must generate its next step at the version that step was submitted
at, which the trainer has moved past, and then hold the version the engines held. Both are written next to
the trainer state (``engine-vN.safetensors``); the trainer's own version and version 0 (the initial
checkpoint) need no copy. A sync run's engines always hold the trainer's version, so it writes none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray
from safetensors.torch import load_file, save_file

from rlfw.distributed.groups import RolloutGroup, TrainerGroup
from rlfw.distributed.weight_sync import WeightSync
from rlfw.logging.progress import progress
from rlfw.train.state import RunState, read_state, write_state
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


def save_checkpoint(run_dir: Path, trainer: TrainerGroup, weights: EngineWeights, state: RunState) -> None:
    """Write a resumable checkpoint of ``state`` (the write order is in the module docstring)."""
    tag = f"step{state.step:06d}"
    with progress(total=3, desc=f"checkpoint {tag}") as bar:
        trainer.save(str(run_dir / CHECKPOINTS), tag)
        bar.update()
        weights.save(run_dir / CHECKPOINTS / tag, state)
        bar.update()
        state.tag = tag
        write_state(run_dir, state)
        bar.update()


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

"""The bookkeeping of asynchronous training (``sync.mode=async``): versions, the staleness bound, resyncs.

Pure and Ray-free, so the rules that decide which samples are trained on and when weights move are
tested without a cluster. The driver loop that uses them is :mod:`rlfw.train.async_loop`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfw.algos.resync import should_resync
from rlfw.types import Sample

AHEAD = 1
"""Steps of generation kept in flight ahead of the trainer. One step already hides generation behind
training when the two take comparable time; deeper pipelines only add staleness."""


def pipeline_depth(max_staleness: int) -> int:
    """Steps generated ahead of the trainer: ``AHEAD``, but never more than ``max_staleness``. A sample
    generated ``d`` steps ahead is trained at least ``d`` versions later, so ``max_staleness=0`` must not
    pipeline at all (it makes async mode synchronous rather than dropping every batch)."""
    return min(AHEAD, max_staleness)


def oldest_version(sample: Sample) -> int:
    """The oldest weight version any token of ``sample`` was drawn with (its final version when it has no
    response token)."""
    if sample.version_T.numel() == 0:
        return sample.final_version
    return int(sample.version_T.min())


def spans_versions(sample: Sample) -> bool:
    """Whether a weight update landed while ``sample`` was being generated (its tokens' versions differ)."""
    return sample.version_T.numel() > 0 and int(sample.version_T.min()) != int(sample.version_T.max())


def split_stale(
    samples: list[Sample], trainer_version: int, max_staleness: int
) -> tuple[list[Sample], list[Sample]]:
    """(kept, dropped): a sample is dropped whole when any of its tokens was drawn more than
    ``max_staleness`` versions before ``trainer_version``, the version the trainer holds when it trains on
    the batch. Each sample lands in exactly one list, in its original order, so every generated sample is
    either trained on once or counted as dropped."""
    oldest_allowed = trainer_version - max_staleness
    kept = [s for s in samples if oldest_version(s) >= oldest_allowed]
    dropped = [s for s in samples if oldest_version(s) < oldest_allowed]
    return kept, dropped


@dataclass
class SyncClock:
    """Where trainer and engines stand: the trainer's version, the version the engines hold, optimizer
    steps since the last push and the cumulative number of pushes."""

    trainer_version: int
    engine_version: int
    steps_since_sync: int = 0
    resyncs: int = 0

    @property
    def staleness(self) -> int:
        """Versions the engines are behind the trainer."""
        return self.trainer_version - self.engine_version

    def trained(self) -> None:
        """One optimizer step happened: the trainer moves to the next version."""
        self.trainer_version += 1
        self.steps_since_sync += 1

    def due(
        self, policy: str, interval: int, ess_threshold: float, max_staleness: int, lag_ess: float
    ) -> bool:
        """Whether to push the trainer's weights now (:func:`~rlfw.algos.resync.should_resync`).

        With one step in flight, generation submitted while the engines are ``s`` versions behind is
        trained ``s + 1`` versions later; the rule pushes once ``s`` reaches ``max_staleness``, so after
        every check ``s <= max_staleness - 1`` and no pipelined sample exceeds the bound."""
        return should_resync(
            policy, self.steps_since_sync, lag_ess, interval, ess_threshold, self.staleness, max_staleness
        )

    def pushed(self) -> None:
        """The engines acknowledged the trainer's current version."""
        self.engine_version = self.trainer_version
        self.steps_since_sync = 0
        self.resyncs += 1

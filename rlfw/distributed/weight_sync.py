"""Versioned weight sync from the trainer pool to the rollout pool, one class per transport.

Ordering contract (every transport):

1. The trainer has finished the optimizer step that produced version ``v``: ``train`` returned on every
   rank. No rank is mid-step while weights are read.
2. Every trainer rank takes part in gathering the full weights (a collective under ZeRO-3); rank 0's
   copy is the one published, tagged with ``v`` and the trainer's contract hash.
3. Every engine receives version ``v``, checks the contract hash (a mismatch refuses the update and
   names both hashes), loads it, and drops the cached state the contract lists as invalidated.
4. ``publish`` returns only after every engine acknowledged ``v``: no generation ever runs against a
   mix of versions, and versions only increase.
"""

from __future__ import annotations

from typing import Protocol

from rlfw.distributed.groups import RolloutGroup, TrainerGroup


class WeightSync(Protocol):
    def publish(
        self, trainer: TrainerGroup, rollout: RolloutGroup, version: int, contract_hash: str
    ) -> None: ...


class ObjectStoreSync:
    """One machine (or a small cluster): rank 0's weights go into the Ray object store once and every
    engine reads the same object (zero-copy on the same node)."""

    name = "object_store"

    def publish(self, trainer: TrainerGroup, rollout: RolloutGroup, version: int, contract_hash: str) -> None:
        ref = trainer.publish(version, contract_hash)  # steps 1-2
        rollout.load(ref)  # steps 3-4 (dead engines are replaced and loaded with this version)


TRANSPORTS: dict[str, type] = {"object_store": ObjectStoreSync}


def make_sync(name: str) -> WeightSync:
    if name not in TRANSPORTS:
        raise NotImplementedError(
            f"sync.transport={name!r} is not available in this version; available: {', '.join(TRANSPORTS)}"
        )
    sync: WeightSync = TRANSPORTS[name]()
    return sync

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

import logging
from typing import Any, Protocol

import ray
from ray.exceptions import RayTaskError

from rlfw.distributed.groups import LOST_PEER, RolloutGroup, TrainerGroup
from rlfw.distributed.weight_group import TensorMeta

log = logging.getLogger(__name__)


class WeightSync(Protocol):
    def publish(self, trainer: TrainerGroup, rollout: RolloutGroup, version: int, contract_hash: str) -> Any:
        """Deliver version ``version`` to every engine; returns the object-store reference of the
        :class:`~rlfw.types.WeightUpdate` when the transport keeps one there, else None."""
        ...


class ObjectStoreSync:
    """One machine (or a small cluster): rank 0's weights go into the Ray object store once and every
    engine reads the same object (zero-copy on the same node)."""

    name = "object_store"

    def publish(self, trainer: TrainerGroup, rollout: RolloutGroup, version: int, contract_hash: str) -> Any:
        ref = trainer.publish(version, contract_hash)  # steps 1-2
        rollout.load(ref)  # steps 3-4 (dead engines are replaced and loaded with this version)
        return ref


class CollectiveSync:
    """Across machines: trainer rank 0 broadcasts the weights over a process group of its own with every
    engine (gloo on CPU, NCCL on GPUs), tensor by tensor in sorted-name order. The group is formed at
    the first publish and formed again after an engine was replaced (a new actor is not a member). Rank 0
    also keeps each version in its node's object store, for replacement engines and async resume.

    An engine that dies during a broadcast fails it for rank 0 or for the engines below it in gloo's
    tree; that version then goes through the object store (the dead engine is replaced), and the group is
    formed again at the next publish. (Under NCCL a lost member shows as NCCL's own timeout instead, which
    is raised.)"""

    name = "collective"

    def __init__(self) -> None:
        self.metas: list[TensorMeta] = []
        self.members = -1  # rollout.restarts when the group was formed; -1: not formed

    def _form_group(self, trainer: TrainerGroup, rollout: RolloutGroup) -> None:
        # A dead member would leave rank 0 waiting for it to join until the group's timeout (10 minutes).
        rollout.replace_dead()
        head = trainer.actors[0]
        host, port = ray.get(head.node_address.remote())
        world = 1 + len(rollout.actors)
        joins = [a.join_weight_group.remote(host, port, 1 + i, world) for i, a in enumerate(rollout.actors)]
        self.metas = ray.get(head.join_weight_group.remote(host, port, world))
        ray.get(joins)
        self.members = rollout.restarts

    def publish(self, trainer: TrainerGroup, rollout: RolloutGroup, version: int, contract_hash: str) -> Any:
        if self.members != rollout.restarts:
            self._form_group(trainer, rollout)
        sends = [a.send_weights.remote(version, contract_hash) for a in trainer.actors]  # steps 1-2
        receives = [a.receive_weights.remote(self.metas, version, contract_hash) for a in rollout.actors]
        ref = None
        try:  # a dead trainer rank is named (TrainerRankDied)
            ref = trainer.gather(sends, "a weight sync")[0][0]
        except RayTaskError as err:  # rank 0 lost a partner: an engine died during the broadcast
            if not LOST_PEER.search(str(err)):
                raise
        lost = rollout.lost_receivers(receives)  # steps 3-4
        if ref is None or lost:
            # Every member that saw the loss has left the group (see WeightGroup), so no survivor waits
            # for its timeout. This version goes through the object store instead: dead engines are
            # replaced and loaded, the others load it unless they hold it already. The group is formed
            # again at the next publish.
            log.warning(
                "the weight broadcast of version %d failed (engines that lost it: %s); delivering it "
                "through the object store",
                version,
                ", ".join(map(str, lost)) or "none",
            )
            self.members = -1
            if ref is None:
                ref = trainer.publish(version, contract_hash)
            rollout.load(ref)
        # A replacement engine is not in the group yet: it gets this version through the object store.
        rollout.latest = ref
        return ref


TRANSPORTS: dict[str, type] = {"object_store": ObjectStoreSync, "collective": CollectiveSync}


def make_sync(name: str) -> WeightSync:
    if name not in TRANSPORTS:
        raise NotImplementedError(
            f"sync.transport={name!r} is not available in this version; available: {', '.join(TRANSPORTS)}"
        )
    sync: WeightSync = TRANSPORTS[name]()
    return sync

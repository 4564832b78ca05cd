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
import re
from datetime import timedelta
from typing import Any, Protocol

import ray

from rlfw.distributed.groups import LOST_PEER, RolloutGroup, TrainerGroup
from rlfw.distributed.weight_group import TIMEOUT, TensorMeta

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

    Under gloo, a member whose broadcast fails leaves the group, which fails its partners' waits at once.
    If every member that missed the version died or lost a partner, the version goes through the object
    store instead (a dead engine is replaced) and the group is formed again at the next publish. A member
    that waited out the timeout (a stuck engine, a network too slow) raises :class:`BroadcastStuck`: the
    object store would wait on the same engine with no timeout at all. An engine that dies while the group
    forms makes the others wait for it until the timeout; it is then replaced and the group formed once
    more. Under NCCL a lost member surfaces through NCCL's watchdog instead; that case is not handled here."""

    name = "collective"

    def __init__(self, timeout: timedelta = TIMEOUT) -> None:
        """``timeout``: how long a member waits to join the group, or (gloo) on one broadcast step."""
        self.metas: list[TensorMeta] = []
        self.members = -1  # rollout.restarts when the group was formed; -1: not formed
        self.timeout = timeout

    def _form_group(self, trainer: TrainerGroup, rollout: RolloutGroup, version: int) -> None:
        """Form the group with every engine. An engine that dies while it forms leaves the others waiting
        for it until the timeout; it is then replaced and the group formed once more. Any other failure to
        join (a member that timed out, most likely), and any failure on that second try, raises
        :class:`BroadcastStuck`."""
        head = trainer.actors[0]
        world = 1 + len(rollout.actors)
        for attempt in range(2):
            # A dead member would leave rank 0 waiting for it to join until the timeout.
            rollout.replace_dead()
            host, port = ray.get(head.node_address.remote())
            joins = [
                a.join_weight_group.remote(host, port, i, world, self.timeout)
                for i, a in enumerate(rollout.actors, start=1)
            ]
            head_join = head.join_weight_group.remote(host, port, world, self.timeout)
            metas, failed = trainer.gather([head_join], "forming the weight group")[0]
            why = _members(failed, rollout.broadcast_failures(joins))
            if not why:
                self.metas, self.members = metas, rollout.restarts
                return
            if attempt or "died" not in why.values():
                raise BroadcastStuck(version, why)
            log.warning("the weight group did not form (%s); forming it again", _reasons(why))
        raise AssertionError("unreachable: the second try returns or raises")

    def publish(self, trainer: TrainerGroup, rollout: RolloutGroup, version: int, contract_hash: str) -> Any:
        if self.members != rollout.restarts:
            self._form_group(trainer, rollout, version)
        sends = [a.send_weights.remote(version, contract_hash) for a in trainer.actors]  # steps 1-2
        receives = [a.receive_weights.remote(self.metas, version, contract_hash) for a in rollout.actors]
        ref, failed = trainer.gather(sends, "a weight sync")[0]  # a dead trainer rank is named
        # a stuck rank 0 stops before waiting on the engines
        missed = rollout.broadcast_failures(receives) if failed is None or _lost(failed) else {}
        why = _members(failed, missed)
        if why:  # some member missed the version (steps 3-4)
            self.members = -1  # every member that saw the failure has left: form the group again
            if not all(_lost(reason) for reason in why.values()):
                raise BroadcastStuck(version, why)
            log.warning(
                "the weight broadcast of version %d failed (%s); delivering it through the object store",
                version,
                _reasons(why),
            )
            rollout.load(ref)  # replaces dead engines; an engine that holds the version already keeps it
        # A replacement engine is not in the group yet: it gets this version through the object store.
        rollout.latest = ref
        return ref


class BroadcastStuck(RuntimeError):
    """A member of the weight broadcast failed without a dead or lost partner: it waited out the group's
    timeout, most likely. The message says who and why."""

    def __init__(self, version: int, why: dict[str, str]) -> None:
        super().__init__(
            f"the weight broadcast of version {version} did not complete ({_reasons(why)}); a member that "
            "timed out is stuck, or the network is slower than the group's timeout"
        )


def _members(rank0: str | None, engines: dict[int, str]) -> dict[str, str]:
    """Why each member failed, by name: trainer rank 0's failure (None if it did not fail), then each
    engine's (by index)."""
    why = {} if rank0 is None else {"trainer rank 0": rank0}
    return why | {f"engine {i}": reason for i, reason in engines.items()}


def _lost(reason: str) -> bool:
    """Whether a member missed the broadcast because it died or lost a partner (not a timeout)."""
    return reason == "died" or LOST_PEER.search(reason) is not None


def _reasons(why: dict[str, str]) -> str:
    """``member: reason; ...``, each gloo error without its source location and advice."""
    return "; ".join(f"{member}: {_first_sentence(reason)}" for member, reason in why.items())


def _first_sentence(error: str) -> str:
    """ "Connection closed by peer [host]:port" of gloo's "[.../pair.cc:553] Connection closed by peer
    [host]:port. This is typically caused by ...", and the first line of a multi-line error."""
    lines = error.strip().splitlines()
    first = re.sub(r"^\[[^\]]*\]\s*", "", lines[0] if lines else "").split(". ")[0]
    return first or error


TRANSPORTS: dict[str, type] = {"object_store": ObjectStoreSync, "collective": CollectiveSync}


def make_sync(name: str) -> WeightSync:
    if name not in TRANSPORTS:
        raise NotImplementedError(
            f"sync.transport={name!r} is not available in this version; available: {', '.join(TRANSPORTS)}"
        )
    sync: WeightSync = TRANSPORTS[name]()
    return sync

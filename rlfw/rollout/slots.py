"""Slot rows of the KV cache: which are free, handed out lowest first."""

from __future__ import annotations


class SlotPool:
    """The free rows of a slotted KV cache.

    A sequence holds one row from admission until it finishes; a finished sequence's row is free for
    the next waiting sequence at once (continuous batching). Rows are handed out lowest first, which
    keeps the assignment deterministic; results never depend on it (draws are seeded per sequence and
    the kernels are batch-invariant), but a deterministic engine is easier to debug.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"max_slots={num_slots} must be at least 1")
        self._free = list(range(num_slots))
        self.num_slots = num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV cache slot")
        self._free.sort()
        return self._free.pop(0)

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"slot {slot} is not held")
        self._free.append(slot)

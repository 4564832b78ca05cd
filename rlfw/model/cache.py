"""The slotted KV cache shared by prefill and decode."""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Per-layer K/V in the layout every attention mode reads: ``[slots, S, H_kv, D]``.

    Slot row ``r`` holds one sequence; position ``p`` of that sequence lives at index ``p``, so a token's
    keys sit at the same place whether they were written by a prefill or a decode step. ``lengths[r]``
    is how many positions row ``r`` holds. (Which weight version wrote the entries is the engine's
    bookkeeping, per sequence.)

    ``capacity`` positions per row are allocated up front; :meth:`reserve` grows every row (doubling,
    the old rows copied) up to ``max_capacity`` (default: ``capacity``, a fixed cache). So an engine
    with a long ``max_model_len`` holds memory for the longest sequence it has run, not for the
    longest it could. Where a position lives does not change when the rows grow, so neither do the bits.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        max_capacity: int | None = None,
    ) -> None:
        shape = (num_slots, capacity, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.capacity = capacity
        self.max_capacity = capacity if max_capacity is None else max(capacity, max_capacity)

    def reserve(self, positions: int) -> None:
        """Make every row hold at least ``positions`` positions; refuse past ``max_capacity``."""
        if positions <= self.capacity:
            return
        if positions > self.max_capacity:
            raise ValueError(
                f"sequence needs {positions} KV positions but the cache holds {self.max_capacity}; "
                "raise the engine's max length (engine.max_model_len)"
            )
        grown = min(self.max_capacity, max(positions, 2 * self.capacity))
        self.k = [_grow(t, grown) for t in self.k]
        self.v = [_grow(t, grown) for t in self.v]
        self.capacity = grown

    @property
    def nbytes(self) -> int:
        """Bytes the K/V rows take now."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    def reset(self, slots: Tensor) -> None:
        """Free slot rows for new sequences. Stale K/V stays but is unreachable: lengths say what is valid."""
        self.lengths[slots] = 0


def _grow(rows: Tensor, capacity: int) -> Tensor:
    out = torch.zeros((rows.shape[0], capacity, *rows.shape[2:]), dtype=rows.dtype, device=rows.device)
    out[:, : rows.shape[1]] = rows
    return out

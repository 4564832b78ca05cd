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
    ) -> None:
        shape = (num_slots, capacity, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.capacity = capacity

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    def reset(self, slots: Tensor) -> None:
        """Free slot rows for new sequences. Stale K/V stays but is unreachable: lengths say what is valid."""
        self.lengths[slots] = 0

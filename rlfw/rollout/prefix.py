"""A prompt's prefilled KV rows, shared by the ``n`` samples of its GRPO group.

The prompt (all but its last token, which the first decode step feeds) is prefilled once, into the slot
of the first sample admitted; its K/V rows are then copied into the slots of the other samples instead
of being recomputed. Samples of a group may be admitted in different steps when slots are scarce, so
the rows are kept as a snapshot until the last sample of the group has been admitted.

A weight update invalidates snapshots (the engine drops them): samples not yet started then prefill
the prompt again at the new version, so a sequence never *starts* on stale KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlfw.model import KVCache


@dataclass
class PrefixKV:
    """K/V rows ``[n, H_kv, D]`` per layer for prompt positions ``0 .. n-1``, with their provenance."""

    k: list[Tensor]
    v: list[Tensor]
    routing: Tensor | None  # int64 [n, n_moe_layers, k] expert ids of these positions (MoE)
    version: int  # weight version the rows were computed with

    @property
    def length(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    @classmethod
    def from_slot(
        cls, cache: KVCache, slot: int, length: int, routing: Tensor | None, version: int
    ) -> PrefixKV:
        """Snapshot the first ``length`` positions of cache row ``slot``."""
        k = [layer[slot, :length].clone() for layer in cache.k]
        v = [layer[slot, :length].clone() for layer in cache.v]
        return cls(k, v, routing, version)

    def write_to(self, cache: KVCache, slot: int) -> None:
        """Make cache row ``slot`` hold exactly this prefix (rows and length)."""
        n = self.length
        cache.reserve(n)
        for layer in range(len(cache.k)):
            cache.k[layer][slot, :n] = self.k[layer]
            cache.v[layer][slot, :n] = self.v[layer]
        cache.lengths[slot] = n


@dataclass
class PromptGroup:
    """The samples of one prompt: its tokens, how many are not yet admitted and the shared prefix."""

    prompt_P: Tensor
    waiting: int
    prefix: PrefixKV | None = None

    @property
    def prefix_tokens(self) -> Tensor:
        """The tokens the shared prefill covers: the prompt without its last token."""
        return self.prompt_P[:-1]

    def admitted_one(self) -> None:
        """Count one admission; the snapshot is released once every sample has its rows."""
        self.waiting -= 1
        if self.waiting == 0:
            self.prefix = None


def empty_prefix(cache: KVCache, version: int) -> PrefixKV:
    """The prefix of a one-token prompt: nothing to prefill."""
    shape = (0, *cache.k[0].shape[2:]) if cache.k else (0,)
    k = [torch.empty(shape, dtype=layer.dtype, device=layer.device) for layer in cache.k]
    return PrefixKV(k, [t.clone() for t in k], None, version)

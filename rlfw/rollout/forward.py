"""Batched forwards of the engine: ragged rows in, hidden states and routed expert ids out.

Every engine forward (prompt prefill, decode step, KV recompute, the prefill stream) goes through
:func:`forward_rows`: rows are right-padded (positions come from the mask, so padding changes nothing
under batch-invariant kernels) and written into their cache slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlfw.model import KVCache, RouterTrace, Transformer


@dataclass
class ForwardCounts:
    """What the engine ran, for throughput metrics and for tests that check work is shared."""

    forward_calls: int = 0
    prefill_tokens: int = 0  # prompt tokens prefilled for admission (a group's prompt counts once)
    decode_tokens: int = 0  # tokens fed to decode steps
    recompute_tokens: int = 0  # tokens re-prefilled after an in-flight update (kv_policy=recompute)
    score_tokens: int = 0  # tokens run through the prefill stream of finished sequences


def pad_right(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    """``(ids [B, W], mask [B, W])`` for int64 token rows of different lengths."""
    lengths = [int(r.shape[0]) for r in rows]
    width = max(lengths)
    if min(lengths) == width:  # a decode step: one token per row, nothing to pad
        ids = torch.stack(rows)
        return ids, torch.ones_like(ids)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=rows[0].device)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : row.shape[0]] = row
        mask[i, : row.shape[0]] = 1
    return ids, mask


def forward_rows(
    model: Transformer, rows: list[Tensor], cache: KVCache, slots: list[int]
) -> tuple[Tensor, Tensor | None]:
    """Extend cache rows ``slots`` with ``rows``; return hidden ``[B, W, hidden]`` and, for MoE, the
    routed expert ids ``[B, W, n_moe_layers, k]`` on the CPU (padding positions hold meaningless ids)."""
    ids, mask = (t.to(cache.lengths.device) for t in pad_right(rows))
    trace = RouterTrace() if model.args.is_moe else None
    slot_t = torch.tensor(slots, dtype=torch.long, device=ids.device)
    hidden = model.hidden_states(ids, mask, cache=cache, slots=slot_t, routing=trace)
    return hidden, (trace.stacked().cpu() if trace is not None else None)


def refill_rows(
    model: Transformer, rows: list[Tensor], cache: KVCache, slots: list[int]
) -> tuple[Tensor, Tensor | None]:
    """Empty cache rows ``slots`` and prefill ``rows`` into them from position 0."""
    cache.reset(torch.tensor(slots, dtype=torch.long, device=cache.lengths.device))
    return forward_rows(model, rows, cache, slots)

"""The sampling distribution: declared transforms and the one function that applies them.

:func:`process_logits` turns raw logits into the distribution tokens are drawn from. The engines call it
when sampling and when computing the decode and prefill streams; the trainer calls it to replay the same
distribution. So every stream is a log-prob of the same processed distribution and a transform is never
approximated on one side. It lives at the model's level because both sides import it from below: the
trainer must not reach into the rollout package for the definition of what it is scoring.

Transforms run in fp32 in a declared order: temperature, then top-k, then top-p, then min-p.
Tie rules: top-k keeps every token whose logit equals the k-th largest (ties at the boundary are all
kept); top-p ranks tokens by a stable descending sort (equal probabilities: lower id first).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

ROW_BLOCK_BYTES = 4 << 20
"""fp32 logits taken at a time by per-row work over a distribution (a few rows of a real vocabulary, so
each block's temporaries stay in cache; a small vocabulary's whole batch in one block)."""


def row_blocks(rows: int, vocab: int) -> Iterator[slice]:
    """Consecutive blocks of ``rows`` rows of ``vocab`` fp32 logits, about :data:`ROW_BLOCK_BYTES` each
    (at least one row). Under the invariant kernels a row's result does not depend on its block."""
    step = max(1, ROW_BLOCK_BYTES // (4 * max(vocab, 1)))
    return (slice(a, min(a + step, rows)) for a in range(0, rows, step))


@dataclass(frozen=True)
class Transforms:
    """The declared sampling transforms (``engine.sampler`` in the run config builds one)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


def _top_k(logits: Tensor, k: int) -> Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: Tensor, p: float) -> Tensor:
    if p >= 1.0:
        return logits
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    probs = torch.softmax(logits, dim=-1).gather(-1, order)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p  # keep the smallest prefix whose mass reaches p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _min_p(logits: Tensor, min_p: float) -> Tensor:
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def process_logits(logits: Tensor, t: Transforms) -> Tensor:
    """fp32 processed logits ``[..., V]``: removed tokens are ``-inf``; log_softmax gives the stream."""
    out = logits.float()
    if t.temperature != 1.0:
        out = out / t.temperature
    return _min_p(_top_p(_top_k(out, t.top_k), t.top_p), t.min_p)

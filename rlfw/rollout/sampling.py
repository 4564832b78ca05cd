"""Sampling transforms, sampler precision and seeded draws.

One function, :func:`process_logits`, turns raw logits into the distribution tokens are drawn from. The
engine calls it when sampling and when computing the decode and prefill streams; the trainer calls it to
replay the same distribution. So every stream is a log-prob of the same processed distribution and a
transform is never approximated on one side.

Transforms run in fp32 in a declared order: temperature, then top-k, then top-p, then min-p.
Tie rules: top-k keeps every token whose logit equals the k-th largest (ties at the boundary are all
kept); top-p ranks tokens by a stable descending sort (equal probabilities: lower id first); a draw is
``argmax(logits + gumbel)`` whose ties go to the lowest id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from rlfw.config import SamplerConfig

PRECISIONS = ("fp32", "bf16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class Transforms:
    """The declared sampling transforms (mirrors ``engine.sampler`` in the config)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @classmethod
    def from_config(cls, sampler: SamplerConfig) -> Transforms:
        """The transforms ``engine.sampler`` declares."""
        return cls(sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p)


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


def quantize_fp8(x: Tensor) -> Tensor:
    """Round-trip ``x`` through float8_e4m3fn with one scale per row (last dim), back in fp32."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (xf / scale).to(torch.float8_e4m3fn).float() * scale


def _matmul_t(x: Tensor, weight: Tensor) -> Tensor:
    return x @ weight.T


def sampler_head(
    hidden: Tensor, weight: Tensor, precision: str, linear: Callable[[Tensor, Tensor], Tensor] | None = None
) -> Tensor:
    """LM-head logits as a reduced-precision sampler computes them, returned in fp32.

    ``bf16``: hidden states and head weight in bf16, bf16 matmul. ``fp8``: both quantised through
    float8_e4m3fn (per-row scales), matmul in fp32 on the dequantised values, like a weight-and-activation
    FP8 sampler. ``fp32`` is not handled here: the engine uses its full-precision logits directly.

    ``linear(x, weight) = x @ weight.T`` does the matmul (default: plain torch). The engine passes the
    model's ``ops.linear`` so that under ``kernels=invariant`` the sampler's logits for a row do not depend
    on the batch either: the sampler factor then measures the precision alone, and a seeded draw gives
    the same token whatever sequences share the step.
    """
    mm = linear or _matmul_t
    if precision == "bf16":
        return mm(hidden.bfloat16(), weight.bfloat16()).float()
    if precision == "fp8":
        return mm(quantize_fp8(hidden), quantize_fp8(weight))
    raise ValueError(f"sampler.precision={precision!r} has no reduced-precision head; allowed: bf16, fp8")


def gumbel_noise(seeds: Tensor, vocab: int) -> Tensor:
    """Gumbel noise ``[N, vocab]``, row ``i`` drawn from its own generator seeded with ``seeds[i]``.

    Per-row generators make a draw depend only on (seed, sequence, step), not on the batch around it.
    """
    rows = []
    for s in seeds.tolist():
        g = torch.Generator().manual_seed(int(s))
        u = torch.rand(vocab, generator=g, dtype=torch.float64).clamp_(1e-20, 1.0)
        rows.append(-torch.log(-torch.log(u)).float())
    return torch.stack(rows)


def draw(processed: Tensor, seeds: Tensor) -> Tensor:
    """Sample one token per row of fp32 processed logits ``[N, V]`` (Gumbel-max; ties to the lowest id)."""
    return torch.argmax(processed + gumbel_noise(seeds, processed.shape[-1]).to(processed.device), dim=-1)


def step_seed(seed: int, sequence_id: int, step: int) -> int:
    """A 63-bit seed for one draw, mixing the run seed, the sequence and the step (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + sequence_id * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) % 2**63

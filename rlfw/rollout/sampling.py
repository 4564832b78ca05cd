"""Sampler precision and seeded draws.

The distribution itself (the declared transforms and :func:`~rlfw.model.distribution.process_logits`)
lives with the model, below both trainer and rollout. Here: what only a sampler does with it: a
reduced-precision LM head and a seeded Gumbel-max draw (ties go to the lowest id), so a token depends
only on (seed, sequence, step), not on the batch around it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlfw.model.distribution import row_blocks

PRECISIONS = ("fp32", "bf16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


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
    raise ValueError(
        f"engine.sampler.precision={precision!r} has no reduced-precision head; allowed: bf16, fp8"
    )


def gumbel_noise(seeds: Tensor, vocab: int) -> Tensor:
    """Gumbel noise ``[N, vocab]`` (fp32, CPU), row ``i`` drawn from ``seeds[i]`` alone.

    Element ``j`` of a row is SplitMix64's ``(j + 1)``-th output from the row's seed, its top 52 bits a
    uniform ``u`` in (0, 1), the noise ``-log(-log(u))`` in double (the compiled kernel
    ``kernels/csrc/sampling.cpp``, one pass over the batch). So a draw depends only on (seed, sequence,
    step), not on the batch around it.
    """
    from rlfw.kernels import cpu_native

    noise: Tensor = cpu_native.module().gumbel(seeds.to(device="cpu", dtype=torch.long), vocab)
    return noise


def draw(processed: Tensor, seeds: Tensor) -> Tensor:
    """Sample one token per row of fp32 processed logits ``[N, V]``: Gumbel-max with
    :func:`gumbel_noise`, ties to the lowest id.

    On the CPU the compiled ``gumbel_argmax`` draws the same token without computing every entry's noise
    exactly (it bounds each entry first and evaluates only those that can win; a row with a NaN comes back
    -1 and takes this exact path). Elsewhere, the noise of a block of rows at a time."""
    from rlfw.kernels import cpu_native

    if cpu_native.serves(processed) and processed.shape[-1] > 0:
        tokens: Tensor = cpu_native.module().gumbel_argmax(processed, seeds.to(dtype=torch.long))
        nan = (tokens < 0).nonzero(as_tuple=True)[0]
        if nan.numel():
            tokens[nan] = _exact_draw(processed[nan], seeds[nan])
        return tokens
    return _exact_draw(processed, seeds)


def _exact_draw(processed: Tensor, seeds: Tensor) -> Tensor:
    """``argmax(processed + noise)``, the noise of every entry, a block of rows at a time."""
    vocab = processed.shape[-1]
    blocks = [
        torch.argmax(processed[r] + gumbel_noise(seeds[r], vocab).to(processed.device), dim=-1)
        for r in row_blocks(*processed.shape)
    ]
    return torch.cat(blocks) if blocks else seeds.new_zeros(0, device=processed.device)


def gets_prefill(seed: int, prompt_id: int, sample_index: int, fraction: float) -> bool:
    """Whether a sequence is rescored for the prefill stream under ``engine.prefill_fraction``: a draw
    from (round seed, prompt, sample) alone, so the choice is the same in every engine, batch and actor."""
    if fraction >= 1.0:
        return True
    return step_seed(seed ^ 0x5EED, prompt_id, sample_index) / 2**63 < fraction


def step_seed(seed: int, sequence_id: int, step: int) -> int:
    """A 63-bit seed for one draw, mixing the run seed, the sequence and the step (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + sequence_id * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) % 2**63

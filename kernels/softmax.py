"""Row log-softmax, token log-probs and entropy in fp32.

Every row is shifted by its max (``-0.0`` canonicalised, see :func:`row_max`) and normalised by
``log(row_sum(exp(shifted)))``; ``exp`` and ``log`` give the same bits on torch's SIMD and scalar paths,
and :func:`row_sum` fixes the summation order per row, so a row's result never depends on its batch.
The max is detached: the shift cancels mathematically, and detaching keeps the gradient the textbook
``g - softmax * sum(g)`` instead of adding a cancelling pair through ``amax``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfw.kernels.reduce import row_max, row_sum


def row_stats(logits: Tensor) -> tuple[Tensor, Tensor]:
    """``(shifted [..., V], lse_shifted [...])`` with ``log_softmax = shifted - lse_shifted[..., None]``."""
    x = logits.float()
    shifted = x - row_max(x.detach()).unsqueeze(-1)
    return shifted, row_sum(shifted.exp()).log()


def log_softmax(logits: Tensor, out: Tensor | None = None) -> Tensor:
    """fp32 log-softmax over the last dim (written into ``out`` when given: the same bits)."""
    shifted, lse = row_stats(logits)
    return torch.sub(shifted, lse.unsqueeze(-1), out=out)


def token_logp(logits: Tensor, ids: Tensor) -> Tensor:
    """``log_softmax(logits)[..., ids]``, the same bits as gathering from :func:`log_softmax`.

    The gathered element goes through the identical ``(x - max) - lse`` arithmetic, so there is no
    need to materialise the full ``[..., V]`` log-softmax.
    """
    shifted, lse = row_stats(logits)
    return shifted.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse


def entropy_from_logp(logp: Tensor) -> Tensor:
    """``-sum(exp(logp) * logp)`` of each row, summed by :func:`row_sum`."""
    return -row_sum(logp.exp() * logp)


def entropy(logits: Tensor) -> Tensor:
    """fp32 entropy of each row of ``logits``."""
    return entropy_from_logp(log_softmax(logits))


def softmax(logits: Tensor) -> Tensor:
    """fp32 softmax over the last dim, ``exp(x - max) / row_sum(...)``."""
    x = logits.float()
    e = (x - row_max(x.detach()).unsqueeze(-1)).exp()
    return e / row_sum(e).unsqueeze(-1)

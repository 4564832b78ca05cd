"""Row log-softmax, token log-probs and entropy in fp32.

``log_softmax(x) = (x - m) - lse`` per row, with ``m`` the row's max (``-0.0`` canonicalised, see
:func:`~rlfw.kernels.reduce.row_max`) and ``lse = log(s)``, ``s`` the sum of ``exp(x - m)``. On CPU the
compiled kernel computes ``m`` and ``s`` (``kernels/csrc/softmax.cpp``): the exponentials are the kernels'
own ``exp_f32`` (the attention's and SiLU's, so no log-prob depends on which exp a torch build vectorises
with), summed in double in sixteen lanes in a fixed order, without writing them out. Elsewhere (CUDA
tensors under the torch op set) ``s`` is :func:`~rlfw.kernels.reduce.row_sum` of torch's ``exp``. Either
way a row's result never depends on its batch, and ``log`` is torch's on the ``[...]`` sums (its SIMD and
scalar paths agree). Under autograd the gradient is the closed form of :mod:`rlfw.kernels.grads`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfw.kernels import cpu_native, grads
from rlfw.kernels.reduce import row_max, row_sum


def row_stats(logits: Tensor) -> tuple[Tensor, Tensor]:
    """``(m [...], lse [...])`` of fp32 rows, with ``log_softmax = (x - m[..., None]) - lse[..., None]``."""
    x = logits.detach().float()
    if cpu_native.serves(x) and x.numel() > 0:
        m, s = cpu_native.module().softmax_stats(x.reshape(-1, x.shape[-1]).contiguous())
        return m.view(x.shape[:-1]), s.log_().view(x.shape[:-1])
    m = row_max(x)
    return m, row_sum((x - m.unsqueeze(-1)).exp()).log()


def _log_softmax(logits: Tensor, out: Tensor | None = None) -> Tensor:
    x = logits.detach().float()
    m, lse = row_stats(x)
    out = torch.sub(x, m.unsqueeze(-1), out=out)
    return out.sub_(lse.unsqueeze(-1))


def log_softmax(logits: Tensor, out: Tensor | None = None) -> Tensor:
    """fp32 log-softmax over the last dim (into ``out`` when given, outside autograd: the same bits)."""
    if out is None:
        return grads.log_softmax(_log_softmax, logits)
    return _log_softmax(logits, out)


def _token_logp(logits: Tensor, ids: Tensor) -> Tensor:
    x = logits.detach().float()
    m, lse = row_stats(x)
    return (x.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - m) - lse


def token_logp(logits: Tensor, ids: Tensor) -> Tensor:
    """``log_softmax(logits)[..., ids]``, the same bits as gathering from :func:`log_softmax`.

    The gathered element goes through the identical ``(x - m) - lse`` arithmetic, so there is no
    need to materialise the full ``[..., V]`` log-softmax.
    """
    return grads.token_logp(_token_logp, logits, ids)


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

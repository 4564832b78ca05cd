"""Row log-softmax, token log-probs and entropy in fp32.

``log_softmax(x) = (x - m) - lse`` per row, with ``m`` the row's max (``-0.0`` canonicalised, see
:func:`~rlfw.kernels.reduce.row_max`) and ``lse`` the log of the sum of ``exp(x - m)``.

* On CPU the compiled kernel computes all of it (``kernels/csrc/softmax.cpp``, whose header states the
  arithmetic): the exponentials are the kernels' own ``exp_f32`` (the attention's and SiLU's), summed in
  double in sixteen lanes in a fixed order without being written out, and the log is the kernel's own too.
  No log-prob depends on which exp or log a torch build or C library vectorises with, and a row's three
  passes run while it is in cache.
* Elsewhere (CUDA tensors under the torch op set) the sum is :func:`~rlfw.kernels.reduce.row_sum` of torch's
  ``exp`` and the log torch's.

Either way a row's result never depends on its batch. Under autograd the gradient is the closed form of
:mod:`rlfw.kernels.grads`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfw.kernels import cpu_native, grads
from rlfw.kernels.reduce import row_max, row_sum


def _compiled(x: Tensor) -> bool:
    return cpu_native.serves(x) and x.dim() >= 1 and x.numel() > 0


def _flat_rows(x: Tensor) -> Tensor:
    """``x [..., V]`` as the contiguous ``[R, V]`` the compiled kernel takes."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def row_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(m [...], lse [...])`` of fp32 rows the compiled kernel does not take, in torch ops, with
    ``log_softmax = (x - m[..., None]) - lse[..., None]``."""
    m = row_max(x)
    return m, row_sum((x - m.unsqueeze(-1)).exp()).log()


def _log_softmax(logits: Tensor, out: Tensor | None = None) -> Tensor:
    x = logits.detach().float()
    if _compiled(x):
        if out is not None and out.shape != x.shape:
            raise ValueError(f"log_softmax: out has shape {tuple(out.shape)}; give one of {tuple(x.shape)}")
        if out is not None and cpu_native.serves(out) and out.is_contiguous() and not out.requires_grad:
            target = out
        else:
            target = torch.empty(x.shape, dtype=torch.float32)
        cpu_native.module().log_softmax_into(_flat_rows(x), target.view(-1, x.shape[-1]))
        return target if out is None or target is out else out.copy_(target)
    m, lse = row_stats(x)
    result = torch.sub(x, m.unsqueeze(-1), out=out)
    return result.sub_(lse.unsqueeze(-1))


def log_softmax(logits: Tensor, out: Tensor | None = None) -> Tensor:
    """fp32 log-softmax over the last dim (into ``out`` when given, outside autograd: the same bits)."""
    if out is None:
        return grads.log_softmax(_log_softmax, logits)
    return _log_softmax(logits, out)


def _token_logp(logits: Tensor, ids: Tensor) -> Tensor:
    x = logits.detach().float()
    if _compiled(x):
        if ids.shape != x.shape[:-1]:
            want = tuple(x.shape[:-1])
            raise ValueError(f"token_logp: ids have shape {tuple(ids.shape)}; give one of {want}")
        return cpu_native.module().token_logp(_flat_rows(x), ids.reshape(-1)).view(x.shape[:-1])
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

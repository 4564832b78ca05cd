"""The gradients of a tiny model's summed token log-probs, for comparing op sets' backward passes."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlfw.model import build_preset


def model_grads(
    kernels: str, dtype: torch.dtype, device: str = "cpu", ops: Any = None, length: int = 40
) -> dict[str, Tensor]:
    """fp32 copies of every parameter's gradient of ``sum(logp * mask)`` on ``tiny_dense`` (seed 7), three
    sequences of ``length`` tokens, the second padded after three quarters of them; ``ops`` replaces the
    model's op set when given."""
    ids = torch.randint(4, 96, (3, length), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, 3 * length // 4 :] = 0
    model = build_preset("tiny_dense", dtype=dtype, seed=7, kernels=kernels).to(device).train()
    if ops is not None:
        model.ops = ops
    logp = model.ops.token_logp(model(ids, mask)[:, :-1], ids[:, 1:])
    (logp * mask[:, 1:]).sum().backward()
    return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(ours: dict[str, Tensor], fp32: dict[str, Tensor], dtype: torch.dtype) -> None:
    """``ours`` against the fp32 default op set's gradients ``fp32``: elementwise to 2e-3 for fp32; for bf16
    (whose default op set itself lands 0.7-1.6% away, in norm, on every parameter) within 4% in norm."""
    assert ours.keys() == fp32.keys() and ours
    for name, want in fp32.items():
        if dtype == torch.float32:
            torch.testing.assert_close(ours[name], want, atol=2e-3, rtol=2e-3, msg=name)
        else:
            err = float((ours[name] - want).norm() / want.norm())
            assert err < 0.04, f"{name}: {err:.4f} of the fp32 gradient's norm away"

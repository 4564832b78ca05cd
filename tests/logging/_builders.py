"""A full step of metrics, as the training loop hands it to `RunLogger.log`."""

from __future__ import annotations

from typing import Any

import torch

from rlfw.logging import metrics as m


def full_metrics(step: int, moe: bool = False) -> dict[str, Any]:
    """Every required key: histograms as 1-D tensors of log ratios, scalars as 0-dim tensors, Python
    floats and ints (the three forms the trainer produces); values vary with `step`."""
    gen = torch.Generator().manual_seed(step)
    out: dict[str, Any] = {}
    for i, key in enumerate(m.required_keys(moe)):
        if m.is_hist_key(key):
            out[key] = torch.randn(200, generator=gen) * 10.0 ** -(i % 4)
        elif i % 3 == 0:
            out[key] = torch.tensor(0.25 * step + i)
        elif i % 3 == 1:
            out[key] = float(step) / 3.0 + i
        else:
            out[key] = step + i
    return out

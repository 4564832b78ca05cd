"""Counting the rows a model's LM head computes, for tests of what the head is run over."""

from __future__ import annotations

import pytest
from torch import Tensor

from rlfw.model import Transformer


def head_rows(monkeypatch: pytest.MonkeyPatch, model: Transformer) -> list[int]:
    """A list that receives, from now until ``monkeypatch`` undoes it, the row count of every linear
    ``model`` runs against its output weight (its LM head, tied or not)."""
    rows: list[int] = []
    linear = model.ops.linear

    def counting(x: Tensor, w: Tensor) -> Tensor:
        if w is model.output_weight:
            rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return linear(x, w)

    monkeypatch.setattr(model.ops, "linear", counting)
    return rows

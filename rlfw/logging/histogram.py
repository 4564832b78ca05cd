"""Histograms of log ratios as plain JSON: `{"hist": true, "edges": [...], "counts": [...], "n": N,
"nonfinite": K}`.

Bin layout (the choice): 65 equal bins over [-R, R], R the smallest power of two >= max |x| (at least
2**-20). Log ratios span many scales (exactly 0 under the execution contract, ~1e-3 for bf16 numerics,
~1 for a stale policy), so a fixed range would put a whole run in one bin; a data-chosen symmetric range
keeps every finite value inside (no overflow bins), and rounding it to a power of two keeps the edges
identical across steps of similar spread. The odd bin count centres bin 32 on 0, so a factor that is
exactly 1 shows as one central spike. Non-finite values are counted in `nonfinite`, not binned; `n`
counts every value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

HIST_BINS = 65
MIN_RANGE = 2.0**-20


@dataclass(frozen=True)
class Histogram:
    """A decoded histogram: counts [HIST_BINS] over edges [HIST_BINS + 1]; `n` includes `nonfinite`."""

    edges: list[float]
    counts: list[int]
    n: int
    nonfinite: int


def to_numpy(values: Any) -> np.ndarray:
    """A float64 1-D copy of a tensor (any dtype, any device) or a sequence of floats.

    Tensors are recognised by `.detach` so that reading metrics never needs torch imported.
    """
    if hasattr(values, "detach"):
        values = values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64).reshape(-1)


def symmetric_range(finite: np.ndarray) -> float:
    """The smallest power of two >= max |x|, at least MIN_RANGE."""
    peak = float(np.abs(finite).max()) if finite.size else 0.0
    if peak <= MIN_RANGE:
        return MIN_RANGE
    return 2.0 ** math.ceil(math.log2(peak))


def encode_hist(values: Any) -> dict[str, Any]:
    """The JSON form of the histogram of `values` (a 1-D tensor or a sequence of log ratios)."""
    data = to_numpy(values)
    finite = data[np.isfinite(data)]
    bound = symmetric_range(finite)
    counts, edges = np.histogram(finite, bins=HIST_BINS, range=(-bound, bound))
    return {
        "hist": True,
        "edges": [float(e) for e in edges],
        "counts": [int(c) for c in counts],
        "n": int(data.size),
        "nonfinite": int(data.size - finite.size),
    }


def is_encoded_hist(obj: object) -> bool:
    """Whether `obj` is the JSON form written by `encode_hist`."""
    return isinstance(obj, dict) and obj.get("hist") is True


def decode_hist(obj: dict[str, Any]) -> Histogram:
    """The histogram in `obj`, checking the invariants a reader relies on."""
    if not is_encoded_hist(obj):
        raise ValueError('not a histogram: expected an object with "hist": true')
    edges: Sequence[float] = obj["edges"]
    counts: Sequence[int] = obj["counts"]
    if len(edges) != len(counts) + 1:
        raise ValueError(f"histogram has {len(edges)} edges for {len(counts)} bins; expected bins + 1")
    nonfinite = int(obj.get("nonfinite", 0))
    if sum(counts) + nonfinite != obj["n"]:
        raise ValueError(f"histogram counts sum to {sum(counts)} + {nonfinite} non-finite, not n={obj['n']}")
    return Histogram([float(e) for e in edges], [int(c) for c in counts], int(obj["n"]), nonfinite)

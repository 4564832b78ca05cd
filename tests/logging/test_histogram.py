"""Histograms of log ratios: the bin layout, and a lossless JSON round trip."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlfw.logging.histogram import HIST_BINS, MIN_RANGE, decode_hist, encode_hist


def test_layout_by_hand() -> None:
    # max |x| = 0.5 -> R = 0.5; 65 bins of width 1/65 over [-0.5, 0.5].
    # 0.0 -> bin 32 (the centre bin), -0.25 -> floor(0.25 * 65) = bin 16, 0.5 -> the last bin (closed).
    h = encode_hist([0.0, 0.0, -0.25, 0.5, math.inf, math.nan])
    assert h["hist"] is True and h["n"] == 6 and h["nonfinite"] == 2
    assert len(h["counts"]) == HIST_BINS and len(h["edges"]) == HIST_BINS + 1
    assert h["edges"][0] == -0.5 and h["edges"][-1] == 0.5
    nonzero = {i: c for i, c in enumerate(h["counts"]) if c}
    assert nonzero == {16: 1, 32: 2, 64: 1}


@pytest.mark.parametrize(
    ("peak", "bound"), [(0.3, 0.5), (0.5, 0.5), (3.0, 4.0), (1e-3, 2.0**-9), (0.0, MIN_RANGE)]
)
def test_range_is_the_next_power_of_two(peak: float, bound: float) -> None:
    h = encode_hist([-peak / 2, peak])
    assert (h["edges"][0], h["edges"][-1]) == (-bound, bound)
    assert sum(h["counts"]) == 2


def test_exact_zeros_fall_in_the_centre_bin() -> None:
    h = encode_hist(torch.zeros(7, dtype=torch.bfloat16))
    assert h["counts"][HIST_BINS // 2] == 7 and sum(h["counts"]) == 7


def test_json_round_trip_is_lossless() -> None:
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e-3
    h = encode_hist(values)
    back = decode_hist(json.loads(json.dumps(h)))
    assert back.edges == h["edges"] and back.counts == h["counts"] and back.n == 1000 and back.nonfinite == 0


def test_empty_input_is_an_empty_histogram() -> None:
    back = decode_hist(encode_hist(torch.empty(0)))
    assert back.n == 0 and sum(back.counts) == 0


def test_decode_refuses_inconsistent_counts() -> None:
    h = encode_hist([0.1, 0.2])
    h["n"] = 3
    with pytest.raises(ValueError, match="n=3"):
        decode_hist(h)

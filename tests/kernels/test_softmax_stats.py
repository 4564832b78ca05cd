"""The compiled log-softmax statistics (``kernels/csrc/softmax.cpp``): the function its header states, bit
for bit, on every kind of row the engines and the trainer feed it; the log-softmax built from them; their
accuracy at a real vocabulary; and bits that do not depend on the thread count."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlfw.kernels import cpu_native, softmax
from tests.kernels.bits import assert_same_bits

LENGTHS = [1, 2, 15, 16, 17, 31, 33, 100, 1024, 3001]


def _stats_as_documented(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, s)`` of one fp32 row as the header states them, one lane at a time in numpy float64.

    The exponentials come from the kernels' exp (``tests/kernels/test_attention.py`` checks it against
    its own statement and against the C library's ``expf``)."""
    if row.isnan().any():
        m = torch.tensor(math.nan)
    else:
        m = row.max() + 0.0
    e = cpu_native.module().exp((row - m).contiguous()).double().numpy()
    lanes = np.zeros(16)
    for j0 in range(0, e.shape[0], 16):
        chunk = e[j0 : j0 + 16]
        lanes[: chunk.shape[0]] = lanes[: chunk.shape[0]] + chunk  # elementwise: each lane adds in j order
    for h in (8, 4, 2, 1):
        lanes[:h] = lanes[:h] + lanes[h : 2 * h]
    return m.float(), torch.tensor(np.float32(lanes[0]))


def _rows(v: int, seed: int) -> torch.Tensor:
    """Rows of length ``v``: plain logits, top-k style (mostly -inf), a wide spread (differences past the
    exp's edge cases), signed zeros as the max, an all -inf row, and a row holding a NaN and one an inf."""
    g = torch.Generator().manual_seed(seed)
    plain = torch.randn(v, generator=g) * 4
    masked = torch.full((v,), -math.inf)
    masked[torch.randperm(v, generator=g)[: max(1, v // 20)]] = torch.randn(max(1, v // 20), generator=g)
    spread = torch.randn(v, generator=g) * 120
    zeros = -torch.rand(v, generator=g)
    zeros[0] = -0.0
    zeros[v // 2] = 0.0
    nan, inf = plain.clone(), plain.clone()
    nan[v // 3] = math.nan
    inf[v // 3] = math.inf
    return torch.stack([plain, masked, spread, zeros, torch.full((v,), -math.inf), nan, inf])


@pytest.mark.parametrize("v", LENGTHS)
def test_stats_are_the_documented_function(v: int) -> None:
    x = _rows(v, seed=v)
    m, s = cpu_native.module().softmax_stats(x)
    for r in range(x.shape[0]):
        want_m, want_s = _stats_as_documented(x[r])
        assert_same_bits(m[r], want_m, f"max V={v} row={r}")
        assert_same_bits(s[r], want_s, f"sum V={v} row={r}")


@pytest.mark.parametrize("v", [17, 3001])
def test_log_softmax_and_token_logp_are_built_from_the_stats(v: int) -> None:
    x = _rows(v, seed=v + 1)
    m, s = cpu_native.module().softmax_stats(x)
    want = (x - m[:, None]) - s.log()[:, None]
    assert_same_bits(softmax.log_softmax(x), want, "log_softmax")
    ids = torch.arange(x.shape[0]) * 7 % v
    assert_same_bits(softmax.token_logp(x, ids), want.gather(-1, ids[:, None])[:, 0], "token_logp")
    logits = x[:4].clone().requires_grad_()  # the trainer's forward under autograd keeps the bits
    assert_same_bits(softmax.log_softmax(logits).detach(), want[:4], "log_softmax under autograd")


def test_accurate_at_a_real_vocabulary() -> None:
    """At Qwen's 151,936 entries the fp32 log-softmax is within a few float roundings of the exact one."""
    x = torch.randn(4, 151_936, generator=torch.Generator().manual_seed(3)) * 5
    exact = torch.log_softmax(x.double(), -1)
    err = (softmax.log_softmax(x).double() - exact).abs() / exact.abs().clamp(min=1.0)
    assert float(err.max()) < 4 * 2**-24


def test_bits_do_not_depend_on_the_thread_count() -> None:
    x = torch.randn(24, 5003, generator=torch.Generator().manual_seed(4)) * 6
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_native.module().softmax_stats(x)
        torch.set_num_threads(2)
        two = cpu_native.module().softmax_stats(x)
    finally:
        torch.set_num_threads(before)
    assert_same_bits(one[0], two[0], "max")
    assert_same_bits(one[1], two[1], "sum")


def test_bad_input_is_refused() -> None:
    with pytest.raises(RuntimeError, match="contiguous 2-d fp32 CPU tensor"):
        cpu_native.module().softmax_stats(torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="rows must not be empty"):
        cpu_native.module().softmax_stats(torch.zeros(3, 0))

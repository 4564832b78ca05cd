"""The compiled log-softmax (``kernels/csrc/softmax.cpp``): the function its header states, bit for bit, on
every kind of row the engines and the trainer feed it; the log-softmax and token log-probs built from it;
its exp and its log, each against its own statement and the exact function; its accuracy at a real
vocabulary; and bits that do not depend on the thread count."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from rlfw.kernels import cpu_native, softmax
from tests.kernels.bits import assert_same_bits

LENGTHS = [1, 2, 15, 16, 17, 31, 33, 100, 1024, 3001]


def _log_as_documented(x: float) -> float:
    """The header's ``log_f64``, one double operation at a time in the stated order."""
    if not x > 0.0 or x == math.inf:
        return -math.inf if x == 0.0 else x if x == math.inf else math.nan
    f, e = math.frexp(x)  # x = f 2^e with f in [0.5, 1): as f in [1, 2), e - 1
    f, e = f * 2.0, e - 1
    if f > 1.41421356237309504880:
        f, e = f * 0.5, e + 1
    t = (f - 1.0) / (f + 1.0)
    t2 = t * t
    p = 2.0 / 23
    for k in range(10, -1, -1):
        p = 2.0 / (2 * k + 1) + t2 * p
    return t * p + e * 0.69314718055994530942


def _round32(exact: Fraction) -> float:
    """``exact`` rounded once to fp32, to nearest, ties to the even neighbour (finite results only)."""
    near = np.float32(float(exact))  # within an fp32 ulp of the answer (a double rounding at most)
    cands = [near, np.nextafter(near, np.float32(-math.inf)), np.nextafter(near, np.float32(math.inf))]
    return float(min(cands, key=lambda c: (abs(Fraction(float(c)) - exact), int(c.view(np.uint32)) & 1)))


def _fma32(a: float, b: float, c: float) -> float:
    """fp32 fma, exactly: the rational ``a * b + c`` rounded once to fp32."""
    return _round32(Fraction(a) * Fraction(b) + Fraction(c))


def _exp_neg_as_documented(d: float) -> float:
    """``exp_neg.h``'s function, one fp32 operation at a time in the stated order, for a float32 ``d``."""
    if math.isnan(d):
        return d + d
    if d < -87.0:
        return 0.0
    log2e, shift = float.fromhex("0x1.715476p+0"), float.fromhex("0x1.8p+23")
    ln2_hi, ln2_lo = float.fromhex("0x1.63p-1"), float.fromhex("-0x1.bd0106p-13")
    c = [float(np.float32(v)) for v in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3)]
    c += [float(np.float32(v)) for v in (4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)]
    kd = _fma32(d, log2e, shift)
    n = _round32(Fraction(kd) - Fraction(shift))
    r = _fma32(-n, ln2_hi, d)
    r = _fma32(-n, ln2_lo, r)
    q = _fma32(c[0], r, c[1])
    for ck in c[2:]:
        q = _fma32(q, r, ck)
    y = _round32(Fraction(_fma32(q, _round32(Fraction(r) * Fraction(r)), r)) + 1)
    return _round32(Fraction(y) * Fraction(2) ** int(n))


def _exp_neg_probes() -> torch.Tensor:
    """The differences a row's sum feeds the exp: random ones over its range, the edges around -87 and 0,
    -inf and NaNs (one fp32 tensor whose length is not a multiple of 16, so the one-at-a-time tail runs)."""
    g = torch.Generator().manual_seed(7)
    edges = [0.0, -0.0, -1e-30, -1e-45, -0.34657359, -0.34657362, -87.0, -86.99999, -87.00001, -88.0]
    edges += [-103.0, -1e30, -math.inf, math.nan, -math.nan]
    spread = -(torch.randn(3000, generator=g) * 20).abs()
    near_zero = -torch.rand(1000, generator=g) * 2
    return torch.cat([torch.tensor(edges), spread, near_zero, torch.tensor([-86.5, -3.0, -0.5])])


def test_exp_neg_is_the_documented_function() -> None:
    x = _exp_neg_probes()
    got = cpu_native.module().exp_neg(x)
    want = torch.tensor([_exp_neg_as_documented(float(v)) for v in x], dtype=torch.float32)
    assert_same_bits(got, want, "exp_neg as documented")


def test_exp_neg_is_within_one_ulp_of_exp() -> None:
    """On [-87, 0]: every float there is checked by ``bench/exp_exhaustive.py``; here a sample."""
    x = _exp_neg_probes()
    x = x[(x >= -87.0) & (x <= 0.0)]
    got = cpu_native.module().exp_neg(x).view(torch.int32).long()
    exact = torch.tensor([float(np.float32(math.exp(float(v)))) for v in x]).view(torch.int32).long()
    assert int((got - exact).abs().max()) <= 1


def _stats_as_documented(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, lse)`` of one fp32 row as the header states them, one lane at a time in numpy float64.

    The exponentials come from the kernel's ``exp_neg`` (checked against its statement above)."""
    if row.isnan().any():
        m = torch.tensor(math.nan)
    else:
        m = row.max() + 0.0
    e = cpu_native.module().exp_neg((row - m).contiguous()).double().numpy()
    lanes = np.zeros(16)
    for j0 in range(0, e.shape[0], 16):
        chunk = e[j0 : j0 + 16]
        lanes[: chunk.shape[0]] = lanes[: chunk.shape[0]] + chunk  # elementwise: each lane adds in j order
    for h in (8, 4, 2, 1):
        lanes[:h] = lanes[:h] + lanes[h : 2 * h]
    return m.float(), torch.tensor(np.float32(_log_as_documented(float(lanes[0]))))


def _rows(v: int, seed: int) -> torch.Tensor:
    """Rows of length ``v``: plain logits, top-k style (mostly -inf), a wide spread (differences past the
    exp's edge cases), signed zeros as the max, -0.0 alone as the max, an all -inf row, a NaN inside the row
    and one in its last entry, and an inf."""
    g = torch.Generator().manual_seed(seed)
    plain = torch.randn(v, generator=g) * 4
    masked = torch.full((v,), -math.inf)
    masked[torch.randperm(v, generator=g)[: max(1, v // 20)]] = torch.randn(max(1, v // 20), generator=g)
    spread = torch.randn(v, generator=g) * 120
    zeros = -torch.rand(v, generator=g)
    zeros[0] = -0.0
    zeros[v // 2] = 0.0
    negative_zero = -torch.rand(v, generator=g) - 0.5  # its only max is -0.0
    negative_zero[v // 2] = -0.0
    nan, nan_tail, inf = plain.clone(), plain.clone(), plain.clone()
    nan[v // 3] = math.nan
    nan_tail[-1] = math.nan  # after the vector body when v is not a multiple of 16
    inf[v // 3] = math.inf
    rows = [plain, masked, spread, zeros, negative_zero, torch.full((v,), -math.inf), nan, nan_tail, inf]
    return torch.stack(rows)


@pytest.mark.parametrize("v", LENGTHS)
def test_stats_are_the_documented_function(v: int) -> None:
    x = _rows(v, seed=v)
    m, lse = cpu_native.module().softmax_stats(x)
    for r in range(x.shape[0]):
        want_m, want_lse = _stats_as_documented(x[r])
        assert_same_bits(m[r], want_m, f"max V={v} row={r}")
        assert_same_bits(lse[r], want_lse, f"lse V={v} row={r}")


@pytest.mark.parametrize("v", [17, 3001])
def test_log_softmax_and_token_logp_are_built_from_the_stats(v: int) -> None:
    x = _rows(v, seed=v + 1)
    m, lse = cpu_native.module().softmax_stats(x)
    # numpy subtracts as the kernel does (torch's sub is an add of -1 times the operand, whose NaN differs)
    with np.errstate(invalid="ignore"):  # the all -inf row: -inf - -inf
        want = torch.from_numpy((x.numpy() - m.numpy()[:, None]) - lse.numpy()[:, None])
    assert_same_bits(softmax.log_softmax(x), want, "log_softmax")
    into = torch.empty_like(x)
    softmax.log_softmax(x, out=into)
    assert_same_bits(into, want, "log_softmax into out")
    strided = torch.empty(x.shape[1], x.shape[0]).t()
    softmax.log_softmax(x, out=strided)
    assert_same_bits(strided, want, "log_softmax into a strided out")
    ids = torch.arange(x.shape[0]) * 7 % v
    assert_same_bits(softmax.token_logp(x, ids), want.gather(-1, ids[:, None])[:, 0], "token_logp")
    logits = x[:4].clone().requires_grad_()  # the trainer's forward under autograd keeps the bits
    assert_same_bits(softmax.log_softmax(logits).detach(), want[:4], "log_softmax under autograd")


def test_log_is_the_documented_function_and_near_exact() -> None:
    """The kernel's log on doubles from tiny to huge, edges included: the stated arithmetic bit for bit, and
    within two units of double's last place of the C library's log (which is within one of the exact)."""
    g = torch.Generator().manual_seed(6)
    x = torch.cat(
        [
            torch.rand(20000, generator=g, dtype=torch.float64) * 151_936 + 1.0,  # what the rows' sums hold
            torch.exp(torch.randn(20000, generator=g, dtype=torch.float64) * 200),
            torch.tensor([1.0, 2.0, 0.5, 1.4142135623730951, 1.4142135623730954, 5e-324, 2.2e-308, 1.7e308]),
            torch.tensor([0.0, -0.0, -1.0, math.inf, math.nan], dtype=torch.float64),
        ]
    )
    got = cpu_native.module().log(x)
    want = torch.tensor([_log_as_documented(float(v)) for v in x], dtype=torch.float64)
    assert_same_bits(got.view(torch.int64), want.view(torch.int64), "log as documented")
    finite = (x > 0) & x.isfinite()
    exact = torch.tensor([math.log(float(v)) for v in x[finite]], dtype=torch.float64)
    ulps = (got[finite] - exact).abs() / torch.finfo(torch.float64).eps / exact.abs().clamp(min=1e-300)
    assert float(ulps.max()) <= 2.0


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
    x = torch.randn(2, 6)
    with pytest.raises(ValueError, match=r"out has shape \(3, 4\); give one of \(2, 6\)"):
        softmax.log_softmax(x, out=torch.empty(3, 4))
    with pytest.raises(ValueError, match=r"ids have shape \(3,\); give one of \(2,\)"):
        softmax.token_logp(x, torch.zeros(3, dtype=torch.long))
    with pytest.raises(RuntimeError, match="id 6 is outside the vocabulary of 6"):
        softmax.token_logp(x, torch.tensor([0, 6]))
    with pytest.raises(RuntimeError, match="out must be a contiguous fp32 CPU tensor"):
        cpu_native.module().log_softmax_into(x, torch.empty(6, 2).t())
    with pytest.raises(RuntimeError, match="contiguous 2-d fp32 CPU tensor"):
        cpu_native.module().softmax_stats(torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="rows must not be empty"):
        cpu_native.module().softmax_stats(torch.zeros(3, 0))

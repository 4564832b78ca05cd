"""Attention over the slotted cache: full pass, decode, chunked prefill, cache capacity and batch
neighbours all give a query the same bits. If one of these breaks, prefill and decode log-probs differ."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import struct
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

from rlfw.kernels import attention, cpu_native
from rlfw.kernels.attention import KV_TILE
from rlfw.kernels.default import DefaultOps
from rlfw.kernels.invariant import InvariantOps
from tests.kernels.bits import DTYPES, assert_same_bits

HQ, HKV, D, L = 4, 2, 64, 40
SCALE = D**-0.5


def _seq(dtype: torch.dtype, seed: int, length: int = L) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, length, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))
    return q, k, v


def _cache(k: torch.Tensor, upto: int, capacity: int) -> torch.Tensor:
    """A cache holding slots ``0..upto-1`` of ``k``; later slots hold NaN (never-written memory)."""
    cache = torch.full((k.shape[0], capacity, HKV, D), float("nan"), dtype=k.dtype)
    cache[:, :upto] = k[:, :upto]
    return cache


def _run(ops: InvariantOps, q, k, v, start: int, end: int, capacity: int = 64) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Queries ``start..end-1`` with the cache written up to ``end`` (chunked prefill / decode step)."""
    pos = torch.arange(start, end)[None]
    return ops.attention(q[:, start:end], _cache(k, end, capacity), _cache(v, end, capacity), pos, SCALE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_and_chunks_equal_full_pass(inv: InvariantOps, dtype: torch.dtype) -> None:
    q, k, v = _seq(dtype, 0)
    full = _run(inv, q, k, v, 0, L)
    # In the full pass the call walks 2 tiles; early queries see tile 1 fully masked (the hazard).
    assert (L - 1) // KV_TILE == 1
    for t in range(L):
        assert_same_bits(_run(inv, q, k, v, t, t + 1)[0, 0], full[0, t], f"decode t={t}")
    for split in range(1, L):
        chunked = torch.cat([_run(inv, q, k, v, 0, split), _run(inv, q, k, v, split, L)], dim=1)
        assert_same_bits(chunked, full, f"split={split}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_capacity_does_not_matter(inv: InvariantOps, dtype: torch.dtype) -> None:
    q, k, v = _seq(dtype, 1)
    ref = _run(inv, q, k, v, 0, L, capacity=L)  # last tile cut short by the cache end
    for capacity in (L + 1, 64, 65, 200):
        assert_same_bits(_run(inv, q, k, v, 0, L, capacity), ref, f"S={capacity}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_neighbours_do_not_matter(inv: InvariantOps, dtype: torch.dtype) -> None:
    q, k, v = _seq(dtype, 2)
    alone = _run(inv, q, k, v, 0, L)
    for n, at in [(2, 0), (3, 2), (5, 3)]:
        others = [_seq(dtype, 10 + i, length=L) for i in range(n)]
        qs, ks, vs = (torch.cat([o[i] for o in others]) for i in range(3))
        qs[at], ks[at], vs[at] = q[0], k[0], v[0]
        pos = torch.arange(L).repeat(n, 1)
        pos[(at + 1) % n, 25:] = -1  # a shorter neighbour with padding queries
        out = inv.attention(qs, _cache(ks, L, 64), _cache(vs, L, 64), pos, SCALE)
        assert_same_bits(out[at : at + 1], alone, f"n={n} at={at}")


def test_padding_queries_and_length_one(inv: InvariantOps) -> None:
    q, k, v = _seq(torch.float32, 3, length=1)
    pos = torch.tensor([[-1]])
    out = inv.attention(q, _cache(k, 1, 8), _cache(v, 1, 8), pos, SCALE)
    assert bool((out == 0).all())
    # A length-1 sequence attends to its own slot only: the output is v exactly (softmax weight 1).
    out = inv.attention(q, _cache(k, 1, 8), _cache(v, 1, 8), torch.tensor([[0]]), SCALE)
    assert_same_bits(out[0, 0], v[0, 0].repeat_interleave(HQ // HKV, dim=0))


def test_negative_zero_values_give_same_bits(inv: InvariantOps) -> None:
    # Value column 0 is -0.0 at every visible slot; masked slots past the query hold +5 in the full
    # pass and nothing in decode. Both must produce the same (canonical) zero.
    q, k, v = _seq(torch.float32, 4)
    v[..., 0] = 5.0
    v[:, :10, :, 0] = -0.0
    full = _run(inv, q, k, v, 0, L)
    for t in range(10):
        assert_same_bits(_run(inv, q, k, v, t, t + 1)[0, 0], full[0, t], f"t={t}")
        assert bool((full[0, t, :, 0] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_agrees_with_default(inv: InvariantOps, dtype: torch.dtype) -> None:
    q, k, v = _seq(dtype, 5)
    pos = torch.arange(L)[None].clone()
    pos[0, :2] = -1
    kc, vc = _cache(k, L, 64).nan_to_num(0.0), _cache(v, L, 64).nan_to_num(0.0)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(
        inv.attention(q, kc, vc, pos, SCALE), DefaultOps().attention(q, kc, vc, pos, SCALE), **tol
    )


def _grads(ops, q, k, v) -> tuple[torch.Tensor, ...]:  # type: ignore[no-untyped-def]
    q, kc, vc = q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()
    pos = torch.arange(q.shape[1])[None].clone()
    pos[0, 0] = -1
    out = ops.attention(q, kc, vc, pos, SCALE)
    return torch.autograd.grad(
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum(), (q, kc, vc)
    )


def test_backward_matches_default_and_is_deterministic(inv: InvariantOps) -> None:
    q, k, v = _seq(torch.float32, 6)
    got, want = _grads(inv, q, k, v), _grads(DefaultOps(), q, k, v)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
    for g, again in zip(got, _grads(inv, q, k, v), strict=True):
        assert_same_bits(g, again)
    with torch.no_grad():
        scoring = inv.attention(q, k, v, torch.arange(L)[None], SCALE)
    grad_mode = inv.attention(q.clone().requires_grad_(), k, v, torch.arange(L)[None], SCALE)
    assert_same_bits(grad_mode, scoring, "grad forward vs scoring forward")


def test_tile_grouping_does_not_change_bits(inv: InvariantOps, monkeypatch: pytest.MonkeyPatch) -> None:
    # 5 tiles: processed as one group, or as groups of 1 and 2 whose running max carries across groups.
    q, k, v = _seq(torch.float32, 7, length=5 * KV_TILE - 3)
    n = q.shape[1]
    ref = _run(inv, q, k, v, 0, n, capacity=n + 9)
    for group in (1, 2):
        monkeypatch.setattr(attention, "TILE_GROUP", group)
        assert_same_bits(_run(inv, q, k, v, 0, n, capacity=n + 9), ref, f"TILE_GROUP={group}")


def test_positions_reused_across_calls_and_edited_in_place(inv: InvariantOps) -> None:
    # The layers of one forward pass share the positions tensor (and the plan derived from it); a
    # different cache under the same positions, or positions edited in place, must not see stale state.
    q, k, v = _seq(torch.float32, 8)
    q2, k2, v2 = _seq(torch.float32, 9)
    pos = torch.arange(L)[None].clone()

    def fresh(qq, kk, vv, p):  # type: ignore[no-untyped-def]
        return inv.attention(qq, _cache(kk, L, 64), _cache(vv, L, 64), p.clone(), SCALE)

    first = inv.attention(q, _cache(k, L, 64), _cache(v, L, 64), pos, SCALE)
    second = inv.attention(q2, _cache(k2, L, 64), _cache(v2, L, 64), pos, SCALE)
    assert_same_bits(first, fresh(q, k, v, pos))
    assert_same_bits(second, fresh(q2, k2, v2, pos))
    pos[0, 30:] = -1
    assert_same_bits(inv.attention(q, _cache(k, L, 64), _cache(v, L, 64), pos, SCALE), fresh(q, k, v, pos))


def test_wide_score_gemm_equals_per_tile_gemms() -> None:
    # The score GEMM of a tile group spans c*KV_TILE columns; the design relies on sgemm giving every
    # column the bits it gets in a KV_TILE-wide GEMM (as the linear relies on rows and M). Checked here.
    g = torch.Generator().manual_seed(0)
    for d, m, width in [(32, 16, 96), (64, 128, 512), (128, 48, 160), (256, 32, 64)]:
        q, k = torch.randn(4, m, d, generator=g), torch.randn(4, width, d, generator=g)
        wide = torch.matmul(q, k.transpose(1, 2))
        for lo in range(0, width, KV_TILE):
            tile = torch.matmul(q, k[:, lo : lo + KV_TILE].transpose(1, 2).contiguous())
            assert_same_bits(wide[..., lo : lo + KV_TILE], tile, f"d={d} m={m} width={width} lo={lo}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reading_cache_rows_in_place_gives_the_bits_of_the_gathered_rows(dtype: torch.dtype) -> None:
    """The engine passes its whole cache and the batch's slots; each query must get the bits it gets
    from its own rows gathered out (what every other path and the trainer see)."""
    g = torch.Generator().manual_seed(3)
    cache_k = torch.randn(7, 40, 2, 16, generator=g).to(dtype)
    cache_v = torch.randn(7, 40, 2, 16, generator=g).to(dtype)
    rows = torch.tensor([5, 0, 3])
    q = torch.randn(3, 2, 4, 16, generator=g).to(dtype)
    pos = torch.tensor([[11, 12], [-1, 3], [30, 31]])
    for ops in (InvariantOps(backend="torch"), DefaultOps()):
        in_place = ops.attention(q, cache_k, cache_v, pos, SCALE, rows)
        gathered = ops.attention(q, cache_k[rows], cache_v[rows], pos, SCALE)
        assert_same_bits(in_place, gathered)
    bad_rows = torch.tensor([9, 0, 1])
    with pytest.raises(RuntimeError, match="cache row 9"):
        inv = InvariantOps(backend="torch")
        inv.attention(q.float(), cache_k.float(), cache_v.float(), pos, SCALE, bad_rows)


def _f32(x: float) -> float:
    return float(np.float32(x))


def _fma32(a: float, b: float, c: float) -> float:
    """fp32 fma, up to one case: the product of two floats is exact in a double, but the double sum may
    round, and rounding it again to fp32 differs from the fma's single rounding when that first rounding
    lands exactly halfway between two floats (about one sum in 2^29)."""
    return _f32(a * b + c)


@functools.cache
def _libm_expf() -> Any:
    expf = ctypes.CDLL(ctypes.util.find_library("m")).expf
    expf.restype, expf.argtypes = ctypes.c_float, [ctypes.c_float]
    return expf


def _fma64(a: float, b: float, c: float) -> float:
    """Double fma, exactly: the rational ``a * b + c`` rounded once (int / int division rounds correctly)."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    return exact.numerator / exact.denominator


def _as_bits(x: float) -> int:
    return int.from_bytes(struct.pack("<d", x), "little")


def _from_bits(u: int) -> float:
    return float(struct.unpack("<d", (u % 2**64).to_bytes(8, "little"))[0])


@functools.cache
def _exp2_table() -> tuple[int, ...]:
    """Bits of 2^(i/32), correctly rounded to a double, minus ``i << 47`` (derived here, not copied)."""
    with localcontext() as ctx:
        ctx.prec = 60
        powers = [float(Decimal(2) ** (Decimal(i) / 32)) for i in range(32)]
    return tuple((_as_bits(x) - (i << 47)) % 2**64 for i, x in enumerate(powers))


def _exp_as_documented(x: float) -> float:
    """The kernel's fp32 exp, as its comment states it, for a float32 value ``x``."""
    if x == -math.inf:
        return 0.0
    if math.isnan(x) or x == math.inf:
        return x + x
    if abs(x) >= 88.0:
        if x > float.fromhex("0x1.62e42ep6"):
            return math.inf
        if x < -float.fromhex("0x1.9fe368p6"):
            return 0.0
    inv, shift = float.fromhex("0x1.71547652b82fep+0") * 32, float.fromhex("0x1.8p+52")
    c0 = float.fromhex("0x1.c6af84b912394p-5") / 32**3
    c1 = float.fromhex("0x1.ebfce50fac4f3p-3") / 32**2
    c2 = float.fromhex("0x1.62e42ff0c52d6p-1") / 32
    kd = _fma64(inv, x, shift)
    ki = _as_bits(kd)
    kd -= shift
    r = _fma64(inv, x, -kd)
    s = _from_bits(_exp2_table()[ki % 32] + (ki << 47))
    y = _fma64(_fma64(c0, r, c1), r * r, _fma64(c2, r, 1.0))
    return _f32(y * s)


def _exp_probes() -> torch.Tensor:
    """Random floats over the softmax's range and beyond, and the edges (one fp32 tensor)."""
    g = torch.Generator().manual_seed(5)
    edges = [0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 88.72283, 88.72284, -87.33654, -150.0, 200.0]
    edges += [-103.27893, -103.97208, -103.97209, math.inf, -math.inf, math.nan]
    spread = torch.randn(4000, generator=g) * 30
    bits_ = torch.randint(-(2**31), 2**31 - 1, (4000,), generator=g, dtype=torch.int64).to(torch.int32)
    return torch.cat([torch.tensor(edges), spread, -spread.abs(), bits_.view(torch.float32)])


def test_exp_is_the_documented_function() -> None:
    """The attention's exp (eight lanes at once, and one at a time for the tail and the edges) computes
    the function its comment states, checked float by float against that statement written in exact
    arithmetic."""
    x = _exp_probes()
    x = x[~x.isnan()]
    got = cpu_native.module().exp(x)
    want = torch.tensor([_exp_as_documented(float(v)) for v in x], dtype=torch.float32)
    assert_same_bits(got, want, "exp")


@pytest.mark.skipif(ctypes.util.find_library("m") is None, reason="no C math library to compare with")
def test_exp_gives_the_c_librarys_expf_bits() -> None:
    """The kernel's exp replaced the C library's ``expf`` without changing a bit: it is glibc's algorithm
    with glibc's fma-contracted evaluation (checked on all 2^32 floats by bench/exp_exhaustive.py; here on a
    sample, NaNs included). A C library whose expf rounds differently fails this; the kernel's own
    bits do not depend on it."""
    x = _exp_probes()
    got = cpu_native.module().exp(x)
    expf = _libm_expf()
    want = torch.tensor([float(expf(float(v))) for v in x], dtype=torch.float32)
    assert_same_bits(got, want, "exp against expf")


def _row_as_documented(q: np.ndarray, k: np.ndarray, v: np.ndarray, p: int, scale: float) -> np.ndarray:
    """One query row over positions 0..p in exactly the order kernels/csrc/attention.cpp's header states,
    one float at a time."""
    d = q.shape[0]
    d8 = d - d % 8
    scores = []
    for i in range(p + 1):
        lanes = [0.0] * 8
        for j in range(d8):
            lanes[j % 8] = _fma32(float(q[j]), float(k[i, j]), lanes[j % 8])
        a = _f32(_f32(lanes[0] + lanes[4]) + _f32(lanes[2] + lanes[6]))
        b = _f32(_f32(lanes[1] + lanes[5]) + _f32(lanes[3] + lanes[7]))
        s = _f32(a + b)
        for j in range(d8, d):
            s = _fma32(float(q[j]), float(k[i, j]), s)
        scores.append(_f32(s * scale))
    m = max(scores)
    e = [_exp_as_documented(_f32(s - m)) for s in scores]
    denom = 0.0
    for x in e:
        denom = _f32(denom + x)
    out = []
    for j in range(d):
        acc = 0.0
        for i in range(p + 1):
            acc = _fma32(e[i], float(v[i, j]), acc)
        out.append(_f32(acc / denom))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("d", [12, 64])
def test_each_row_is_the_documented_arithmetic(d: int) -> None:
    """The compiled kernel, whatever it does to be fast (all heads of a token in one walk, eight scores
    and exponentials at once, output rows held in registers), computes every element as the header's
    one order of fma chains and folds: checked float by float against that order written out, for rows
    short and long enough to take every code path."""
    g = torch.Generator().manual_seed(11)
    length, hq, hkv = 21, 2, 1
    q = torch.randn(1, length, hq, d, generator=g) * 2
    k, v = (torch.randn(1, length, hkv, d, generator=g) for _ in range(2))
    pos = torch.arange(length)[None]
    out = InvariantOps(backend="torch").attention(q, k, v, pos, SCALE)
    for p in range(length):
        for h in range(hq):
            want = _row_as_documented(q[0, p, h].numpy(), k[0, :, 0].numpy(), v[0, :, 0].numpy(), p, SCALE)
            assert_same_bits(out[0, p, h], torch.from_numpy(want), f"d={d} p={p} h={h}")


def test_queries_walked_in_blocks_equal_queries_alone(inv: InvariantOps) -> None:
    """The kernel walks up to eight query tokens of a batch entry together. Tokens in any order of
    positions (shuffled, repeated, padding between them) get the bits each gets when asked alone."""
    q, k, v = _seq(torch.float32, 5)
    kc, vc = _cache(k, L, 64), _cache(v, L, 64)
    g = torch.Generator().manual_seed(3)
    pos = torch.randint(0, L, (1, 19), generator=g)
    pos[0, [2, 9, 10, 17]] = -1
    pos[0, 5] = pos[0, 4]
    queries = torch.randn(1, 19, HQ, D, generator=g)
    out = inv.attention(queries, kc, vc, pos, SCALE)
    for t in range(19):
        alone = inv.attention(queries[:, t : t + 1], kc, vc, pos[:, t : t + 1], SCALE)
        assert_same_bits(out[:, t : t + 1], alone, f"t={t} pos={int(pos[0, t])}")
    assert bool((out[0, 2] == 0).all())

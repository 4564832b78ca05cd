"""Triton kernels under ``TRITON_INTERPRET=1``: batch invariance bitwise, agreement with the torch path
to a stated tolerance (the order inside a tile differs: numpy/BLAS there, the library here).

Tolerances: fp32 results within ``atol=rtol=1e-5`` (1e-4 for linear, K up to 300), bf16 outputs within
one bf16 rounding (``2e-2``).
"""

from __future__ import annotations

import pytest
import torch

from rlfw.kernels.invariant import InvariantOps
from tests.kernels.bits import DTYPES, assert_same_bits, embed_row


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear(inv: InvariantOps, tri: InvariantOps, dtype: torch.dtype) -> None:
    weight, row = torch.randn(40, 300).to(dtype), torch.randn(1, 300).to(dtype)
    alone = tri.linear(row, weight)[0]
    for n, at in [(3, 2), (17, 16), (20, 5)]:
        batch = embed_row(row, n, at, seed=n)
        out = tri.linear(batch, weight)
        assert_same_bits(out[at], alone, f"n={n}")
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, inv.linear(batch, weight), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(inv: InvariantOps, tri: InvariantOps, dtype: torch.dtype) -> None:
    weight, row = torch.randn(100).to(dtype), torch.randn(1, 100).to(dtype)
    alone = tri.rms_norm(row, weight, 1e-6)[0]
    batch = embed_row(row, 9, 4, seed=0)
    out = tri.rms_norm(batch, weight, 1e-6)
    assert_same_bits(out[4], alone)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, inv.rms_norm(batch, weight, 1e-6), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_softmax_and_token_logp(inv: InvariantOps, tri: InvariantOps, dtype: torch.dtype) -> None:
    v = 2500  # three vocabulary chunks, the last one partial
    row = (torch.randn(1, v) * 4).to(dtype)
    batch = embed_row(row, 6, 5, seed=1)
    ids = torch.randint(0, v, (6,))
    out = tri.log_softmax(batch)
    assert_same_bits(out[5], tri.log_softmax(row)[0])
    assert_same_bits(tri.token_logp(batch, ids), out.gather(-1, ids[:, None])[:, 0])
    torch.testing.assert_close(out, inv.log_softmax(batch), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tri.entropy(batch), inv.entropy(batch), atol=1e-5, rtol=1e-5)


def test_attention(inv: InvariantOps, tri: InvariantOps) -> None:
    hq, hkv, d, length = 4, 2, 16, 36
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, length, hq, d, generator=g)
    k, v = (torch.randn(1, 48, hkv, d, generator=g) for _ in range(2))
    k[:, length:], v[:, length:] = float("nan"), float("nan")
    full = tri.attention(q, k, v, torch.arange(length)[None], 0.25)
    torch.testing.assert_close(
        full, inv.attention(q, k, v, torch.arange(length)[None], 0.25), atol=1e-5, rtol=1e-5
    )
    for t in (0, 5, 31, 32, 35):
        step = tri.attention(q[:, t : t + 1], k, v, torch.tensor([[t]]), 0.25)
        assert_same_bits(step[0, 0], full[0, t], f"decode t={t}")


def test_attention_rows_keep_their_bits_whatever_tiles_their_program_walks(tri: InvariantOps) -> None:
    """Each program walks the KV tiles up to its own rows' last position (found in the kernel, so the host
    never waits for the device). With positions starting at 5, a program's 16 rows (8 positions x 2
    heads) straddle a tile edge: rows before it must come out of the extra tile with the bits they get
    alone, as one decode query whose program stops a tile earlier. Sequences of different lengths and
    padding queries share the batch; slots after each sequence's last position hold NaN."""
    hq, hkv, d, cap, start, lengths = 4, 2, 16, 90, 5, (70, 20, 5)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(len(lengths), cap, hq, d, generator=g)
    k, v = (torch.randn(len(lengths), cap, hkv, d, generator=g) for _ in range(2))
    pos = torch.full((len(lengths), cap), -1)
    for b, n in enumerate(lengths):
        pos[b, :n] = torch.arange(start, start + n)
        k[b, start + n :], v[b, start + n :] = float("nan"), float("nan")  # past the row's last position
    batch = tri.attention(q, k, v, pos, 0.25)
    for b, n in enumerate(lengths):
        assert bool(torch.isfinite(batch[b]).all()) and not bool(batch[b, n:].any())
        for t in sorted({0, n // 2, n - 1, min(26, n - 1), min(27, n - 1)}):  # 26, 27: positions 31, 32
            one = tri.attention(
                q[b : b + 1, t : t + 1], k[b : b + 1], v[b : b + 1], pos[b : b + 1, t : t + 1], 0.25
            )
            assert_same_bits(one[0, 0], batch[b, t], f"sequence {b}, query {t}")


def test_backward_through_triton_forward(tri: InvariantOps) -> None:
    x = torch.randn(3, 64, requires_grad=True)
    (tri.log_softmax(tri.rms_norm(x, torch.ones(64), 1e-6))[:, 0]).sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all()) and bool((x.grad != 0).any())


def test_linear_row_result_is_the_same_at_every_position_of_a_tile(tri: InvariantOps) -> None:
    """The interpreter's ``tl.dot`` is BLAS's matmul, whose result for a row depends on the row's index
    within the tile; the kernels' tile product must not (``rlfw.kernels.triton_dot``)."""
    weight, row = torch.randn(24, 70), torch.randn(1, 70)
    alone = tri.linear(row, weight)[0]
    for at in range(16):
        assert_same_bits(tri.linear(embed_row(row, 16, at, seed=at), weight)[at], alone, f"row {at} of 16")


def test_linear_row_keeps_its_bits_across_the_launch_tile_bound(tri: InvariantOps) -> None:
    """Products of up to ``MM_SMALL_ROWS`` rows launch smaller tiles than larger ones; a row's result
    must not notice (the K slice, the only tile size in its reduction, is the same)."""
    from rlfw.kernels import triton_config as tc

    weight, row = torch.randn(8, 40), torch.randn(1, 40)
    alone = tri.linear(row, weight)[0]
    assert tc.matmul_tiles(tc.MM_SMALL_ROWS) != tc.matmul_tiles(tc.MM_SMALL_ROWS + 1)
    for n in (tc.MM_SMALL_ROWS, tc.MM_SMALL_ROWS + 1):
        assert_same_bits(tri.linear(embed_row(row, n, n - 1, seed=n), weight)[n - 1], alone, f"n={n}")

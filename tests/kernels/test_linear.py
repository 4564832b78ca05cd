"""Batch invariance of ``linear``: the same row gives the same bits whatever rows surround it.

If a change breaks one of these tests, trainer and engine log-probs stop being bitwise equal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rlfw.kernels.default import DefaultOps
from rlfw.kernels.invariant import InvariantOps
from tests.kernels.bits import DTYPES, assert_same_bits, bits, embed_row, torch_threads

N_ROWS = range(1, 71)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [32, 64, 128, 256, 300, 1000])
def test_row_alone_equals_row_in_any_batch(inv: InvariantOps, dtype: torch.dtype, k: int) -> None:
    # K = 300 and 1000 cross the fixed K tile (256), so the ascending tile accumulation is exercised.
    g = torch.Generator().manual_seed(k)
    weight = torch.randn(48, k, generator=g).to(dtype)
    row = torch.randn(1, k, generator=g).to(dtype)
    alone = inv.linear(row, weight)[0]
    for n in N_ROWS:
        for at in sorted({0, n // 2, n - 1}):
            batch = embed_row(row, n, at, seed=n)
            assert_same_bits(inv.linear(batch, weight)[at], alone, f"K={k} N={n} at={at}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dims_do_not_matter(inv: InvariantOps, dtype: torch.dtype) -> None:
    x = torch.randn(3, 7, 64).to(dtype)
    weight = torch.randn(40, 64).to(dtype)
    assert_same_bits(inv.linear(x, weight)[1, 4], inv.linear(x[1:2, 4:5], weight)[0, 0])


def test_default_linear_is_not_batch_invariant() -> None:
    # Why the switch matters: torch's fp32 GEMM gives a lone row (GEMV) other bits than the same row
    # inside a batch on this build. If this ever stops failing, the default is invariant by luck here.
    torch.manual_seed(0)
    weight, rows = torch.randn(64, 256), torch.randn(16, 256)
    alone = DefaultOps().linear(rows[:1], weight)[0]
    batched = DefaultOps().linear(rows, weight)[0]
    assert (bits(alone) != bits(batched)).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_agrees_with_default(inv: InvariantOps, dtype: torch.dtype) -> None:
    x, weight = torch.randn(5, 9, 300).to(dtype), torch.randn(33, 300).to(dtype)
    out = inv.linear(x, weight)
    assert out.dtype == dtype
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 1e-2}
    torch.testing.assert_close(out, DefaultOps().linear(x, weight), **tol)


def _grads(linear_fn, x: torch.Tensor, weight: torch.Tensor, upstream: torch.Tensor):  # type: ignore[no-untyped-def]
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    (linear_fn(x, weight) * upstream).sum().backward()
    return x.grad, weight.grad


def test_backward_matches_plain_autograd_and_is_deterministic(inv: InvariantOps) -> None:
    torch.manual_seed(1)
    x, weight, up = torch.randn(2, 5, 300), torch.randn(24, 300), torch.randn(2, 5, 24)
    got_x, got_w = _grads(inv.linear, x, weight, up)
    want_x, want_w = _grads(F.linear, x, weight, up)
    torch.testing.assert_close(got_x, want_x, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got_w, want_w, atol=1e-4, rtol=1e-5)
    again_x, again_w = _grads(inv.linear, x, weight, up)
    assert_same_bits(got_x, again_x, "dx")
    assert_same_bits(got_w, again_w, "dW")


def test_grad_forward_equals_no_grad_forward(inv: InvariantOps) -> None:
    x, weight = torch.randn(3, 64), torch.randn(8, 64)
    with torch.no_grad():
        scoring = inv.linear(x, weight)
    assert_same_bits(inv.linear(x.requires_grad_(), weight.requires_grad_()), scoring)


@pytest.mark.parametrize("m,k,n", [(1, 5, 3), (37, 70, 19), (64, 300, 48), (300, 1120, 40)])
def test_weight_given_transposed_gives_the_bits_of_the_weight_as_it_lies(m: int, k: int, n: int) -> None:
    """The backward's kernel (``linear_t``, packing panels from ``W.T`` without a transposed copy)
    computes every element by the forward kernel's fma chain: the same bits as ``linear(x, W)``."""
    from rlfw.kernels import cpu_native

    g = torch.Generator().manual_seed(m * k + n)
    x, wt = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    mod = cpu_native.module()
    assert_same_bits(mod.linear_t(x, wt), mod.linear(x, wt.t().contiguous()), f"{(m, k, n)}")


def test_gradients_do_not_depend_on_the_thread_count_or_on_lent_threads(inv: InvariantOps) -> None:
    """``lend_idle_cores``: a trainer widens its linears' backward while a neighbour idles, at any
    moment, so with a lender installed dx and dW must be the same bits on its own thread, widened to
    four, and on four threads of its own."""
    from rlfw.kernels import threads

    g = torch.Generator().manual_seed(7)
    x, weight = torch.randn(4, 70, 512, generator=g), torch.randn(384, 512, generator=g)
    up = torch.randn(4, 70, 384, generator=g)
    results = []
    for lent, own in ((1, 1), (4, 1), (1, 4)):
        threads.set_lender(lambda lent=lent: lent)  # type: ignore[misc]
        try:
            with torch_threads(own):
                results.append(_grads(inv.linear, x, weight, up))
        finally:
            threads.set_lender(None)
    calls, widened = threads.counts()
    assert widened > 0 and calls >= widened
    for name, a, b, c in zip(("dx", "dW"), *results, strict=True):
        assert_same_bits(a, b, f"{name}: 1 thread vs widened to 4")
        assert_same_bits(a, c, f"{name}: 1 vs 4 own threads")


def _fma_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``y[m, n]``: fp32 fma over k ascending from +0, as the kernel's comment states it. A product of two
    floats is exact in a double; the double sum may round, and rounding it again to fp32 differs from the
    fma's single rounding only when the first rounding lands exactly halfway between two floats (about
    one step in 2^29), which these fixed inputs never hit (the test would say so)."""
    xs, ws = x.double().numpy(), w.double().numpy()
    acc = np.zeros((x.shape[0], w.shape[0]), dtype=np.float32)
    for i in range(x.shape[1]):
        acc = (xs[:, i, None] * ws[None, :, i] + acc.astype(np.float64)).astype(np.float32)
    return torch.from_numpy(acc)


# 1000: several panel groups at n=129, k walked whole; 1300: three stretches of k, the last shorter
@pytest.mark.parametrize("k", [1, 7, 37, 1000, 1300])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_register_block_computes_the_documented_fma_chain(k: int, threads: int) -> None:
    """Every path of the compiled linear (packed panels; the weight read in place for a few rows; packed
    per call; the transposed weight) and every register block shape (rows 1-13 and 70 cover the main
    block and each tail, 140 two row blocks; widths cover whole and partial panels and groups), with k
    walked whole or in stretches that resume the chains stored in y, gives the bits of the fp32 fma
    chain itself. So the 8-lane, 16-lane and portable builds agree with each other, whichever this
    machine compiled."""
    from rlfw.kernels import cpu_native

    mod = cpu_native.module()
    g = torch.Generator().manual_seed(k)
    with torch_threads(threads):
        for n in (1, 15, 16, 17, 63, 65, 129):
            w = torch.randn(n, k, generator=g)
            packed = mod.pack(w)
            for m in (*range(1, 14), 70, 140):
                x = torch.randn(m, k, generator=g)
                want = _fma_chain(x, w)
                where = f"m={m} k={k} n={n}"
                assert_same_bits(mod.linear_packed(x, packed, n), want, f"packed {where}")
                assert_same_bits(mod.linear(x, w), want, f"in place / packed per call {where}")
                assert_same_bits(mod.linear_t(x, w.t().contiguous()), want, f"transposed {where}")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "m,n,k",
    [
        *(
            (m, n, 5)
            for m, n in [(1, 1), (3, 5), (8, 8), (9, 17), (64, 64), (65, 130), (200, 71), (1088, 512)]
        ),
        *[(37, 19, 70), (67, 130, 48), (1040, 70, 33), (1400, 40, 20)],
    ],
)
def test_weight_gradient_gives_the_bits_of_the_transposed_gradient(
    threads: int, m: int, n: int, k: int
) -> None:
    """``linear_tn(g, x)`` (what ``matmul.grad_weight`` calls) transposes ``g`` a block of rows at a time
    inside the kernel: the bits of ``linear_t`` on the whole transposed copy, for reductions walked whole
    and in stretches (``m`` past 1,280), several row blocks, and the transpose's whole 64 x 64 tiles,
    partial tiles and 8 x 8 blocks with their tails, on any thread count."""
    from rlfw.kernels import cpu_native

    mod = cpu_native.module()
    gen = torch.Generator().manual_seed(m * n + k)
    g, x = torch.randn(m, n, generator=gen), torch.randn(m, k, generator=gen)
    with torch_threads(threads):
        assert_same_bits(mod.linear_tn(g, x), mod.linear_t(g.t().contiguous(), x), f"{(m, n, k)}")


@pytest.mark.parametrize("budget", [1 << 30, 0])  # 0: nothing fits, every call packs as outside
def test_weights_held_within_a_step_keep_the_per_call_bits(
    inv: InvariantOps, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A train step holds its weights (``Transformer.weights_held``): each is packed once for the
    forward and once for the input gradient, then reused by every micro-batch. The output, dx and dW
    must keep the bits of the per-call paths; a weight written in place within, or given new storage,
    must be packed again, not read stale (the second half fails with either check removed)."""
    from rlfw.kernels import matmul, threads

    monkeypatch.setattr(matmul, "HELD_BYTES", budget)
    g = torch.Generator().manual_seed(11)
    x, up = torch.randn(2, 37, 300, generator=g), torch.randn(2, 37, 129, generator=g)
    weight = torch.randn(129, 300, generator=g).requires_grad_()

    def step() -> tuple[torch.Tensor, ...]:
        xg = x.clone().requires_grad_()
        weight.grad = None
        y = inv.linear(xg, weight)
        (y * up).sum().backward()
        assert xg.grad is not None and weight.grad is not None
        return y.detach(), xg.grad, weight.grad.clone()

    threads.set_lender(lambda: 1)  # the linears' backward on the compiled kernel, as under lending
    try:
        want = step()
        with matmul.held([weight]):
            first, second = step(), step()
            kept = matmul._HELD is not None and matmul._HELD[id(weight)].panels
            assert set(kept or {}) == ({False, True} if budget else set())
            with torch.no_grad():
                weight.mul_(0.5)
            changed = step()
            weight.data = weight.data * 2.0  # new storage, no version bump
            moved = step()
        assert matmul._HELD is None
        want_moved = step()
        weight.data = weight.data * 0.5
        want_changed = step()
    finally:
        threads.set_lender(None)
    for name, *got in zip(("y", "dx", "dW"), want, first, second, strict=True):
        assert_same_bits(got[0], got[1], f"{name}: first call within held")
        assert_same_bits(got[0], got[2], f"{name}: second call within held")
    for name, a, b in zip(("y", "dx", "dW"), changed, want_changed, strict=True):
        assert_same_bits(a, b, f"{name}: after an in-place write within held")
    for name, a, b in zip(("y", "dx", "dW"), moved, want_moved, strict=True):
        assert_same_bits(a, b, f"{name}: after new storage within held")

"""Row-wise ops (RMSNorm, RoPE, SiLU-mul, log-softmax, token log-probs, entropy): batch invariance,
hazard cases and agreement with the default ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlfw.kernels.default import DefaultOps
from rlfw.kernels.elementwise import silu
from rlfw.kernels.invariant import InvariantOps
from rlfw.kernels.reduce import SUM_CHUNK
from tests.kernels.bits import DTYPES, assert_same_bits, bits, embed_row

BATCHES = [(1, 0), (2, 1), (5, 0), (5, 4), (17, 9), (33, 32)]


def _check_invariant(fn, row: torch.Tensor, what: str) -> None:  # type: ignore[no-untyped-def]
    alone = fn(row)[0]
    for n, at in BATCHES:
        assert_same_bits(fn(embed_row(row, n, at, seed=n))[at], alone, f"{what} n={n} at={at}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [7, 64, 100])
def test_rms_norm_rope_silu_invariant(inv: InvariantOps, dtype: torch.dtype, d: int) -> None:
    # d = 7 and 100 leave a scalar tail after torch's SIMD body, where position in the batch could matter.
    weight = torch.randn(d).to(dtype)
    _check_invariant(lambda x: inv.rms_norm(x, weight, 1e-6), torch.randn(1, d).to(dtype), "rms_norm")
    _check_invariant(lambda x: inv.silu_mul(x, x.flip(-1)), (torch.randn(1, d) * 8).to(dtype), "silu")
    cos, sin = torch.randn(1, 1, 2 * d), torch.randn(1, 1, 2 * d)

    def rope(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return inv.rope(x.reshape(n, 1, 1, 2 * d), cos.expand(n, 1, -1), sin.expand(n, 1, -1)).reshape(n, -1)

    _check_invariant(rope, torch.randn(1, 2 * d).to(dtype), "rope")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_many_rows(inv: InvariantOps, dtype: torch.dtype) -> None:
    # 64 rows of 100: each row's tail lands at a different offset of torch's 32-element SIMD steps.
    gate, up = (torch.randn(64, 100) * 8).to(dtype), torch.randn(64, 100).to(dtype)
    batch = inv.silu_mul(gate, up)
    for r in range(64):
        assert_same_bits(inv.silu_mul(gate[r : r + 1], up[r : r + 1])[0], batch[r], f"row {r}")


def test_torch_silu_hazard_is_real_and_avoided() -> None:
    # torch evaluates contiguous elements with SIMD code and strided ones with scalar code. F.silu's two
    # paths disagree on some inputs (the hazard); our silu and exp agree on all of them.
    x = torch.randn(200_000) * 8
    scalar_path = torch.stack([x, x], 1).reshape(-1)[::2]
    assert (bits(F.silu(x)) != bits(F.silu(scalar_path))).any(), "hazard did not occur"
    assert_same_bits(silu(x), silu(scalar_path), "silu")
    assert_same_bits(torch.exp(x), torch.exp(scalar_path), "exp")
    assert_same_bits(torch.rsqrt(x.abs()), torch.rsqrt(scalar_path.abs()), "rsqrt")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [10, 96, SUM_CHUNK + 37, 3 * SUM_CHUNK])
def test_logprob_ops_invariant(inv: InvariantOps, dtype: torch.dtype, v: int) -> None:
    row = (torch.randn(1, v) * 4).to(dtype)
    _check_invariant(inv.log_softmax, row, "log_softmax")
    _check_invariant(inv.entropy, row, "entropy")

    # The embedded row always asks for token v // 2; its neighbours ask for other tokens.
    def token_logp(x: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(x.shape[0]) % v
        ids[(x == row).all(-1)] = v // 2
        return inv.token_logp(x, ids)

    _check_invariant(token_logp, row, "token_logp")


def test_token_logp_is_gather_of_log_softmax(inv: InvariantOps) -> None:
    logits = torch.randn(3, 5, 2000)
    ids = torch.randint(0, 2000, (3, 5))
    gathered = inv.log_softmax(logits).gather(-1, ids[..., None])[..., 0]
    assert_same_bits(inv.token_logp(logits, ids), gathered)


def test_negative_zero_max_gives_same_bits(inv: InvariantOps) -> None:
    # The row max is 0 with both signs present; the scan order picks a sign, canonicalisation removes it.
    a = torch.tensor([[0.0, -0.0, -3.0, -50.0]])
    b = torch.tensor([[-0.0, 0.0, -3.0, -50.0]])
    assert bits(a[0, 1]) != bits(b[0, 1])
    assert_same_bits(inv.log_softmax(a)[:, 2:], inv.log_softmax(b)[:, 2:])
    assert_same_bits(inv.entropy(a), inv.entropy(b))


def test_subnormals_are_kept(inv: InvariantOps) -> None:
    tiny = torch.full((1, 16), 1e-40)
    assert bool((tiny != 0).all()) and bool((tiny.abs() < torch.finfo(torch.float32).tiny).all())
    weight = torch.ones(16)
    _check_invariant(lambda x: inv.rms_norm(x, weight, 0.0), tiny, "rms_norm subnormal")
    _check_invariant(lambda x: inv.silu_mul(x, x), tiny, "silu subnormal")
    _check_invariant(inv.log_softmax, tiny, "log_softmax subnormal")


@pytest.mark.parametrize("dtype", DTYPES)
def test_agree_with_default(inv: InvariantOps, dtype: torch.dtype) -> None:
    d = DefaultOps()
    x, w = torch.randn(2, 3, 64).to(dtype), torch.randn(64).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(inv.rms_norm(x, w, 1e-6), d.rms_norm(x, w, 1e-6), **tol)
    torch.testing.assert_close(inv.silu_mul(x, x * 2), d.silu_mul(x, x * 2), **tol)
    q, cos, sin = torch.randn(2, 3, 4, 64).to(dtype), torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    torch.testing.assert_close(inv.rope(q, cos, sin), d.rope(q, cos, sin), **tol)
    logits, ids = (torch.randn(2, 3, 3000) * 3).to(dtype), torch.randint(0, 3000, (2, 3))
    fp32 = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(inv.log_softmax(logits), d.log_softmax(logits), **fp32)
    torch.testing.assert_close(inv.token_logp(logits, ids), d.token_logp(logits, ids), **fp32)
    torch.testing.assert_close(inv.entropy(logits), d.entropy(logits), **fp32)


def _grads(ops, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    h = ops.rms_norm(x, w, 1e-6)
    h = ops.silu_mul(h, h.flip(-1))
    loss = ops.token_logp(h, ids).sum() + ops.entropy(h).sum() + ops.log_softmax(h)[..., 0].sum()
    return list(torch.autograd.grad(loss, (x, w)))


def test_backward_matches_default_and_is_deterministic(inv: InvariantOps) -> None:
    torch.manual_seed(0)
    x, w, ids = torch.randn(2, 3, 64), torch.randn(64), torch.randint(0, 64, (2, 3))
    got, want = _grads(inv, x, w, ids), _grads(DefaultOps(), x, w, ids)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
    for g, again in zip(got, _grads(inv, x, w, ids), strict=True):
        assert_same_bits(g, again)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_grad_mode_equals_no_grad(inv: InvariantOps, dtype: torch.dtype) -> None:
    # Without autograd silu_mul runs the same IEEE ops in place; the bits must not depend on the mode.
    gate, up = (torch.randn(33, 100) * 8).to(dtype), torch.randn(33, 100).to(dtype)
    with torch.no_grad():
        scoring = inv.silu_mul(gate, up)
    assert_same_bits(inv.silu_mul(gate.clone().requires_grad_(), up), scoring)

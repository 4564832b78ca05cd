"""The closed-form backward passes of the GPU op sets (``rlfw.kernels.grads``), run here on the Triton
kernels under ``TRITON_INTERPRET=1``: each gradient must match autograd through the plain torch math."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from rlfw.kernels import grads
from rlfw.kernels.attention import attention_reference
from rlfw.kernels.invariant import InvariantOps
from tests.model_grads import assert_grads_close, model_grads


def _grads(fn, *inputs: Tensor) -> list[Tensor]:  # type: ignore[no-untyped-def]
    """Gradients of ``sum(fn(*inputs) * probe)`` for a fixed random ``probe``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    (out * probe).sum().backward()
    return [t.grad for t in leaves]


def _close(ours: list[Tensor], want: list[Tensor], tol: float = 1e-5) -> None:
    for a, b in zip(ours, want, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 4, 16)])  # per-row, and a per-head weight (q/k norm)
def test_rms_norm(tri: InvariantOps, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(shape, generator=g), torch.randn(shape[-1], generator=g)

    def plain(x: Tensor, w: Tensor) -> Tensor:
        return w * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6))

    _close(_grads(lambda x, w: tri.rms_norm(x, w, 1e-6), x, w), _grads(plain, x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_backward_is_the_torch_closed_form(tri: InvariantOps, dtype: torch.dtype) -> None:
    """The Triton backward (one program per row) against :func:`grads.rms_norm_grads`, bf16 included
    (both work in fp32 and round ``dx`` / ``dweight`` once; the sums over a row differ in order)."""
    from rlfw.kernels import triton_norm

    g = torch.Generator().manual_seed(1)
    x, grad = (torch.randn(2, 7, 3, 48, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(48, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for ours, want in zip(
        triton_norm.rms_norm_backward(x, w, grad, 1e-6), grads.rms_norm_grads(x, w, grad, 1e-6), strict=True
    ):
        assert ours.dtype == want.dtype == dtype and ours.shape == want.shape
        torch.testing.assert_close(ours, want, atol=tol, rtol=tol)


def test_log_softmax_and_token_logp(tri: InvariantOps) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 50, generator=g) * 3
    ids = torch.randint(0, 50, (2, 3), generator=g)
    _close(_grads(tri.log_softmax, logits), _grads(lambda x: torch.log_softmax(x, -1), logits))
    _close(
        _grads(lambda x: tri.token_logp(x, ids), logits),
        _grads(lambda x: torch.log_softmax(x, -1).gather(-1, ids[..., None])[..., 0], logits),
    )


def test_attention_with_gqa_and_padding_queries(tri: InvariantOps) -> None:
    hq, hkv, d, t = 4, 2, 16, 9
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, t, hq, d, generator=g)
    k, v = (torch.randn(2, t, hkv, d, generator=g) for _ in range(2))
    q_pos = torch.arange(t).repeat(2, 1)
    q_pos[1, 6:] = -1  # right padding in the second row

    def ours(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return tri.attention(q, k, v, q_pos, 0.25)

    def plain(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attention_reference(q, k, v, q_pos, 0.25)

    _close(_grads(ours, q, k, v), _grads(plain, q, k, v))


def test_triton_attention_backward_is_the_torch_closed_form_over_several_tiles() -> None:
    """The two Triton kernels (rows: dq and the softmax statistics; KV tiles: dk, dv) against
    :func:`grads.attention_grads`, over three KV tiles and several row blocks, with sequences of
    different lengths and one starting at position 3 (a continued prefill); slots after a row's last
    position hold NaN and padding queries' output gradients are inf: neither may reach any gradient."""
    pytest.importorskip("triton")
    from rlfw.kernels import triton_attention

    hq, hkv, d, t, slots = 4, 2, 16, 70, 78
    g = torch.Generator().manual_seed(4)
    q, grad = (torch.randn(3, t, hq, d, generator=g) for _ in range(2))
    k, v = (torch.randn(3, slots, hkv, d, generator=g) for _ in range(2))
    q_pos = torch.arange(t).repeat(3, 1)
    q_pos[0] += 3
    q_pos[1, 40:], q_pos[2, 5:] = -1, -1
    want = grads.attention_grads(q, k, v, q_pos, 0.3, grad)
    for b in range(3):
        last = int(q_pos[b].max())
        k[b, last + 1 :], v[b, last + 1 :] = float("nan"), float("nan")
    grad[q_pos < 0] = float("inf")
    ours = triton_attention.attention_backward(q, k, v, q_pos, 0.3, grad)
    for name, a, b in zip(("dq", "dk", "dv"), ours, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)
    assert not bool(ours[0][2, 5:].any()), "padding queries get no gradient"


def test_no_grad_calls_are_the_kernel_itself() -> None:
    x, w = torch.randn(3, 8), torch.ones(8)
    calls: list[int] = []

    def kernel(x: Tensor, w: Tensor, eps: float) -> Tensor:
        calls.append(1)
        return x * w

    out = grads.rms_norm(kernel, x, w, 1e-6)
    assert calls == [1] and out.grad_fn is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_models_gradients_through_the_triton_op_set(tri: InvariantOps, dtype: torch.dtype) -> None:
    """A whole model's backward on the Triton op set (fused RMSNorm backward, closed forms, padding)
    against the default op set's fp32 gradients."""
    ours = model_grads("invariant", dtype, ops=tri, length=20)  # short: the interpreter is slow
    assert_grads_close(ours, model_grads("default", torch.float32, length=20), dtype)

"""The compiled CPU kernels of the elementwise ops and the attention backward
(``kernels/csrc/elementwise.cpp``, ``attention_backward`` in ``kernels/csrc/attention.cpp``).

What they promise: RMSNorm's and SiLU-mul's forward compute the operations their source states, in its
order (checked against an exact spelling of it here, so every build computes the same bits); the forward
under autograd has the bits of the no-grad forward (the engine's); the gradients are those of the
reference math (checked against float64 autograd); and no bit depends on the thread count (so a trainer
may run them on lent cores)."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor

from rlfw.kernels import attention as attn
from rlfw.kernels import cpu_native, elementwise, norm
from tests.kernels.bits import assert_same_bits, torch_threads


def _grads(fn: Callable[..., Tensor], inputs: list[Tensor], grad: Tensor) -> tuple[Tensor, list[Tensor]]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [leaf.grad for leaf in leaves]  # type: ignore[misc]


def _reference_grads(fn: Callable[..., Tensor], inputs: list[Tensor], grad: Tensor) -> list[Tensor]:
    """Gradients of ``fn`` in float64 under plain autograd, rounded to fp32."""
    return [g.float() for g in _grads(fn, [t.double() for t in inputs], grad.double())[1]]


def _close(got: list[Tensor], want: list[Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-4)


def _rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s


def _rms_ref(x: Tensor, w: Tensor) -> Tensor:
    return w * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6))


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32).astype(np.float64)


def _rms_norm_as_stated(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm in the order ``elementwise.cpp`` states, spelt in float64 and rounded to fp32 after every
    operation: a product of two floats is exact in a double, and one float operation (+, /, sqrt) rounded
    to a double and then to a float gives the correctly rounded float. The fma chains' sums may round
    twice where the fma rounds once; that differs only when the first rounding lands exactly halfway
    between two floats (about one step in 2^29), which these fixed inputs never hit (the test would say
    so)."""
    xs = x.reshape(-1, x.shape[-1]).double().numpy()
    rows, d = xs.shape
    lane = np.zeros((rows, 16))
    for i in range(d):
        lane[:, i % 16] = _f32(xs[:, i] * xs[:, i] + lane[:, i % 16])
    h = 8
    while h:
        lane[:, :h] = _f32(lane[:, :h] + lane[:, h : 2 * h])
        h //= 2
    mean = _f32(_f32(lane[:, 0] / d) + np.float64(np.float32(eps)))
    r = _f32(1.0 / _f32(np.sqrt(mean)))
    y = _f32(w.double().numpy()[None, :] * _f32(xs * r[:, None]))
    return torch.from_numpy(y.astype(np.float32)).view(x.shape)


def _silu_mul_as_stated(g: Tensor, u: Tensor) -> Tensor:
    """``(g / (1 + exp(-g))) * u`` rounded after every operation, the exp the C library's ``expf`` (the
    kernels' exp gives its bits on every float: ``bench/exp_exhaustive.py``)."""
    expf = ctypes.CDLL(ctypes.util.find_library("m")).expf
    expf.restype, expf.argtypes = ctypes.c_float, [ctypes.c_float]
    gs, us = g.reshape(-1).double().numpy(), u.reshape(-1).double().numpy()
    e = np.array([expf(-v) for v in gs], dtype=np.float64)
    out = _f32(_f32(gs / _f32(1.0 + e)) * us)
    return torch.from_numpy(out.astype(np.float32)).view(g.shape)


@pytest.mark.parametrize("d", [1, 7, 16, 17, 64, 100, 512, 1000])
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_kernel_computes_the_stated_order(d: int, threads: int) -> None:
    g = torch.Generator().manual_seed(d)
    x, w = torch.randn(9, d, generator=g) * 3, torch.randn(d, generator=g)
    x[3] = 0.0  # a zero row: r = 1 / sqrt(eps)
    with torch_threads(threads):
        y, r = cpu_native.module().rms_norm(x, w, 1e-6)
    assert_same_bits(y, _rms_norm_as_stated(x, w, 1e-6), f"d={d} threads={threads}")
    assert bool(torch.isfinite(r).all())


@pytest.mark.parametrize("threads", [1, 2])
def test_silu_mul_kernel_computes_the_stated_operations(threads: int) -> None:
    g = torch.Generator().manual_seed(5)
    edges = torch.tensor([0.0, -0.0, 88.5, -88.5, 100.0, -120.0])
    gate = torch.cat([torch.randn(3001, generator=g) * 12, edges])
    gate[-1000:-900] = torch.randn(100, generator=g) * 1e-6  # near 0: where torch's exp and libm's differ
    up = torch.randn(gate.shape, generator=g)
    with torch_threads(threads):
        out, denom = cpu_native.module().silu_mul(gate, up, True)
    assert_same_bits(out, _silu_mul_as_stated(gate, up), f"threads={threads}")
    torch.testing.assert_close(denom, 1 + torch.exp(-gate.double()).float(), rtol=1e-6, atol=0)


def _tables(b: int, t: int, d: int) -> tuple[Tensor, Tensor]:
    angle = torch.randn(b, t, d)
    return angle.cos(), angle.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kernel_has_the_bits_of_the_torch_spelling(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = (torch.randn(3, 7, 5, 64) * 30).to(dtype)
    cos, sin = _tables(3, 7, 64)
    assert_same_bits(elementwise.rope(x, cos, sin), elementwise.rope_reference(x, cos, sin), "rope")
    # tables broadcast over the batch (one [1, T, D] table), as a caller may pass them
    assert_same_bits(
        elementwise.rope(x, cos[:1], sin[:1]), elementwise.rope_reference(x, cos[:1], sin[:1]), "broadcast"
    )


def test_rope_gradient() -> None:
    torch.manual_seed(1)
    x, g = torch.randn(2, 6, 4, 32), torch.randn(2, 6, 4, 32)
    cos, sin = _tables(2, 6, 32)
    out, got = _grads(lambda t: elementwise.rope(t, cos, sin), [x], g)
    assert_same_bits(out, elementwise.rope_reference(x, cos, sin), "forward under autograd")
    _close(got, _reference_grads(lambda t: _rope_ref(t, cos.double(), sin.double()), [x], g))


def test_silu_mul_gradient_and_forward_bits() -> None:
    torch.manual_seed(2)
    gate, up, g = torch.randn(4, 9, 100) * 6, torch.randn(4, 9, 100), torch.randn(4, 9, 100)
    out, got = _grads(elementwise.silu_mul, [gate, up], g)
    with torch.no_grad():
        assert_same_bits(out, elementwise.silu_mul(gate, up), "forward under autograd")
        assert_same_bits(out, _silu_mul_as_stated(gate, up), "the stated operations")
    _close(got, _reference_grads(lambda a, b: a * torch.sigmoid(a) * b, [gate, up], g))


@pytest.mark.parametrize("shape", [(3, 5, 512), (2, 7, 8, 64), (1, 1, 7)])
def test_rms_norm_gradient_and_forward_bits(shape: tuple[int, ...]) -> None:
    torch.manual_seed(3)
    x, w, g = torch.randn(shape) * 3, torch.randn(shape[-1]), torch.randn(shape)
    out, got = _grads(lambda a, b: norm.rms_norm(a, b, 1e-6), [x, w], g)
    with torch.no_grad():
        assert_same_bits(out, norm.rms_norm(x, w, 1e-6), "forward under autograd")
        assert_same_bits(out, _rms_norm_as_stated(x, w, 1e-6), "the stated order")
    _close(got, _reference_grads(_rms_ref, [x, w], g))


def _attention_case(seed: int, hq: int = 4, d: int = 64) -> tuple[list[Tensor], Tensor, Tensor]:
    """GQA (``hq`` query heads on 2 KV heads), left padding, a fully padded tail and a row starting late."""
    torch.manual_seed(seed)
    b, t, s, hkv = 3, 9, 12, 2
    q, k, v = torch.randn(b, t, hq, d), torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d)
    pos = torch.tensor([list(range(9)), list(range(3, 12)), [-1, -1, 0, 1, 2, 3, 4, 5, -1]])
    return [q, k, v], pos, torch.randn(b, t, hq, d)


@pytest.mark.parametrize(("hq", "d"), [(4, 64), (6, 36), (2, 3)])  # d: whole 8-lane blocks, a tail, no block
def test_attention_gradient_and_forward_bits(hq: int, d: int) -> None:
    (q, k, v), pos, g = _attention_case(4, hq, d)

    def compiled(*qkv: Tensor) -> Tensor:
        out: Tensor = attn.CompiledBackward.apply(*qkv, pos, 0.125)
        return out

    out, got = _grads(compiled, [q, k, v], g)
    with torch.no_grad():
        assert_same_bits(out, attn.attention(q, k, v, pos, 0.125), "forward under autograd")
    want = _reference_grads(lambda *qkv: attn.attention_reference(*qkv, pos, 0.125), [q, k, v], g)
    _close(got, want)
    assert not bool(got[0][2, :2].any() or got[0][2, -1].any()), "padding queries must get no gradient"


@pytest.mark.parametrize("threads", [1, 2])
def test_attention_gradient_of_long_rows(threads: int) -> None:
    # 300 positions on 2 query heads per KV head: the backward takes the query rows in several blocks
    # (its softmax rows of one block fill 128 KiB), each continuing the previous block's dk and dv.
    torch.manual_seed(11)
    b, t, hq, hkv, d = 2, 300, 4, 2, 16
    q, g = torch.randn(b, t, hq, d), torch.randn(b, t, hq, d)
    k, v = torch.randn(b, t, hkv, d), torch.randn(b, t, hkv, d)
    pos = torch.arange(t).repeat(b, 1)
    pos[1, :37] = -1  # a row whose queries start late: its first keys are seen by fewer queries

    def compiled(*qkv: Tensor) -> Tensor:
        out: Tensor = attn.CompiledBackward.apply(*qkv, pos, 0.25)
        return out

    with torch_threads(threads):
        got = _grads(compiled, [q, k, v], g)[1]
    _close(got, _reference_grads(lambda *qkv: attn.attention_reference(*qkv, pos, 0.25), [q, k, v], g))


def test_the_invariant_ops_train_through_the_compiled_attention_backward() -> None:
    from rlfw.kernels.invariant import InvariantOps

    (q, k, v), pos, _ = _attention_case(6)
    out = InvariantOps("torch").attention(q.requires_grad_(), k, v, pos, 0.125)
    assert type(out.grad_fn).__name__ == "CompiledBackwardBackward"


def test_silu_mul_gradient_of_a_transposed_gate() -> None:
    torch.manual_seed(7)
    gate, up, g = torch.randn(40, 30).t(), torch.randn(30, 40), torch.randn(30, 40)
    _close(
        _grads(elementwise.silu_mul, [gate, up], g)[1],
        _reference_grads(lambda a, b: a * torch.sigmoid(a) * b, [gate, up], g),
    )


def test_backward_bits_do_not_depend_on_the_thread_count() -> None:
    # Sizes are chosen so that every kernel's work spans several parallel chunks (RoPE: 64 tokens of
    # 4 x 64 per chunk, RMSNorm: 32 rows, SiLU-mul: 16384 elements, attention: one (batch, KV head) each).
    (q, k, v), pos, ga = _attention_case(5)
    cos, sin = _tables(8, 40, 64)
    xr, gr = torch.randn(8, 40, 4, 64), torch.randn(8, 40, 4, 64)
    x, w, gx = torch.randn(6, 40, 512), torch.randn(512), torch.randn(6, 40, 512)
    gate, up, gg = torch.randn(6, 40, 1536), torch.randn(6, 40, 1536), torch.randn(6, 40, 1536)

    def all_grads() -> list[Tensor]:
        out = _grads(lambda *qkv: attn.CompiledBackward.apply(*qkv, pos, 0.125), [q, k, v], ga)[1]
        out += _grads(lambda a: elementwise.rope(a, cos, sin), [xr], gr)[1]
        out += _grads(lambda a, b: norm.rms_norm(a, b, 1e-6), [x, w], gx)[1]
        return out + _grads(elementwise.silu_mul, [gate, up], gg)[1]

    with torch_threads(1):
        one = all_grads()
    with torch_threads(2):
        two = all_grads()
    for i, (a, b) in enumerate(zip(one, two, strict=True)):
        assert_same_bits(a, b, f"gradient {i}")

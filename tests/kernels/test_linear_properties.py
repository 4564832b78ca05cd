"""Property tests of the invariant linear over drawn shapes, positions and neighbours.

Shapes are drawn, not picked: output widths 1-64, inner sizes that are not multiples of 4, 16 or 256,
the row anywhere in a batch, neighbours of any content. A linear that is invariant only "for the tested
shapes" fails here (the BLAS path it replaces gave a row different bits by its index modulo 4 for outputs
2-11 wide with an inner size not a multiple of 4). If one of these breaks, trainer and engine log-probs
stop being bitwise equal on some model shapes.

20 times as many examples: ``RLFW_HYPOTHESIS_PROFILE=long pytest tests/kernels/test_linear_properties.py``.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfw.kernels import matmul
from rlfw.kernels.invariant import InvariantOps
from tests.kernels.bits import NEIGHBOURS, assert_same_bits, surround
from tests.properties import examples

INV = InvariantOps(backend="torch")


@settings(max_examples=examples(120), deadline=None)
@given(
    n=st.integers(1, 64),
    k=st.integers(1, 700),
    m=st.integers(1, 40),
    at=st.integers(0, 39),
    kind=st.sampled_from(NEIGHBOURS),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_row_gets_the_same_bits_whatever_the_batch(
    n: int, k: int, m: int, at: int, kind: str, bf16: bool, seed: int
) -> None:
    at = at % m
    dtype = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).to(dtype)
    row = torch.randn(1, k, generator=g).to(dtype)
    alone = INV.linear(row, weight)[0]
    assert_same_bits(
        INV.linear(surround(row[0], (m,), (at,), kind, seed), weight)[at], alone, f"n={n} k={k} m={m} at={at}"
    )


@settings(max_examples=examples(40), deadline=None)
@given(n=st.integers(1, 64), k=st.integers(1, 700), m=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_the_result_is_a_linear_to_fp32_rounding(n: int, k: int, m: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    want = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(INV.linear(x, weight), want, atol=1e-4 * k**0.5, rtol=1e-4)


def test_hazard_values_keep_their_bits() -> None:
    """-0.0 products, subnormals and exact ties: the fma chain from +0 gives +0 for an all-zero row."""
    weight = torch.tensor([[1.0, -1.0, 0.5], [-0.0, 0.0, 1e-40]])
    x = torch.tensor([[0.0, -0.0, 0.0], [1e-38, 1e-38, 2.0], [3.0, 3.0, 0.0]])
    out = INV.linear(x, weight)
    assert torch.equal(out[0].view(torch.int32), torch.zeros(2, dtype=torch.int32))  # +0, not -0
    for i in range(3):
        assert_same_bits(INV.linear(x[i : i + 1], weight)[0], out[i], f"row {i}")


@settings(max_examples=examples(60), deadline=None)
@given(
    n=st.integers(1, 80),
    k=st.integers(1, 700),
    m=st.integers(1, 80),
    at=st.integers(0, 79),
    kind=st.sampled_from(NEIGHBOURS),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_packed_weight_gives_the_bits_of_the_unpacked_one(
    n: int, k: int, m: int, at: int, kind: str, bf16: bool, seed: int
) -> None:
    """An engine's weights are packed once (``prepare_weights``); every batch size, including the 1-5
    rows that take several panels per block, must give the bits of the per-call paths."""
    at = at % m
    dtype = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).to(dtype)
    row = torch.randn(1, k, generator=g).to(dtype)
    batch = surround(row[0], (m,), (at,), kind, seed)
    alone, unpacked = INV.linear(row, weight)[0], INV.linear(batch, weight)
    INV.prepare_weights([weight])
    assert matmul._packed(weight) is not None
    packed = INV.linear(batch, weight)
    assert_same_bits(packed, unpacked, f"n={n} k={k} m={m}")
    assert_same_bits(packed[at], alone, f"n={n} k={k} m={m} at={at}")


def test_a_packed_weight_changed_in_place_is_not_used_stale() -> None:
    g = torch.Generator().manual_seed(0)
    weight, x = torch.nn.Parameter(torch.randn(20, 33, generator=g)), torch.randn(3, 33, generator=g)
    INV.prepare_weights([weight])
    with torch.no_grad():
        weight.mul_(2.0)  # an optimizer step or load_state_dict: the version counter moves
        assert matmul._packed(weight) is None
        assert_same_bits(INV.linear(x, weight), INV.linear(x, weight.detach().clone()), "in place")
        weight.data = torch.randn(20, 33, generator=g)  # new storage, same object
        assert matmul._packed(weight) is None
        assert_same_bits(INV.linear(x, weight), INV.linear(x, weight.detach().clone()), "new storage")
    INV.prepare_weights([weight])  # packs the new values; a second call finds them current
    panels = matmul._packed(weight)
    INV.prepare_weights([weight])
    assert panels is not None and matmul._packed(weight) is panels
    assert_same_bits(INV.linear(x, weight), INV.linear(x, weight.detach().clone()), "packed again")

"""The sampler's top-k: the first k of a stable descending sort (ties to the lower id), found without
sorting the vocabulary. If this breaks, the top-k ids the rollout records (and every correction that
centres over them) change with the batch or the library's topk tie order."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfw.rollout.streams import COMPILED_TOPK_MAX, _sorted_topk, stable_topk, takes_compiled_topk
from tests.properties import examples


# the compiled one-pass kernel (CPU) and torch's topk with a sort of the boundary ties (other devices)
@pytest.mark.parametrize("topk", [stable_topk, _sorted_topk], ids=["compiled", "torch"])
@settings(max_examples=examples(150), deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.integers(1, 600),
    k_frac=st.floats(0, 1),
    content=st.sampled_from(["distinct", "ties", "masked", "constant", "signed-zeros", "infinite"]),
    seed=st.integers(0, 2**16),
)
def test_stable_topk_is_the_head_of_a_stable_sort(
    topk: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
    rows: int,
    vocab: int,
    k_frac: float,
    content: str,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    if content == "ties":
        x = torch.round(x * 2) / 2  # few distinct values: ties cross the top-k boundary
    elif content == "masked":
        x[torch.rand(rows, vocab, generator=g) < 0.5] = float("-inf")  # top-k/top-p removed tokens
    elif content == "constant":
        x = torch.zeros(rows, vocab)
    elif content == "signed-zeros":  # -0.0 and +0.0 are equal: ties by id
        x = torch.where(torch.rand(rows, vocab, generator=g) < 0.5, -0.0, 0.0)
    elif content == "infinite":
        x[torch.rand(rows, vocab, generator=g) < 0.2] = float("inf")
        x[torch.rand(rows, vocab, generator=g) < 0.2] = float("-inf")
    k = round(k_frac * vocab)
    ids, values = topk(x, k)
    expected = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(ids, expected)
    assert torch.equal(values.view(torch.int32), x.gather(-1, expected).view(torch.int32))


def test_a_row_with_a_nan_takes_the_sort() -> None:
    """The compiled pass gives such a row back to torch's sort, which places NaN first."""
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    x[1, 7] = float("nan")
    ids, _ = stable_topk(x, 4)
    assert torch.equal(ids, torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :4])


def test_a_k_past_the_compiled_kernels_takes_torchs_path() -> None:
    """Past :data:`COMPILED_TOPK_MAX` (the compiled insertion costs O(k) an entry) the same head of a
    stable sort comes from torch's path, ties included."""
    x = torch.randint(0, 50, (3, 3000), generator=torch.Generator().manual_seed(1)).float()  # many ties
    k = COMPILED_TOPK_MAX + 1
    assert not takes_compiled_topk(x, k) and takes_compiled_topk(x, k - 1)
    ids, top = stable_topk(x, k)
    want = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(ids, want.indices[:, :k]) and torch.equal(top, want.values[:, :k])

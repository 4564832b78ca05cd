"""The sampler's top-k: the first k of a stable descending sort (ties to the lower id), found without
sorting the vocabulary. If this breaks, the top-k ids the rollout records (and every correction that
centres over them) change with the batch or the library's topk tie order."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfw.rollout.streams import stable_topk
from tests.properties import examples


@settings(max_examples=examples(150), deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.integers(1, 600),
    k_frac=st.floats(0, 1),
    content=st.sampled_from(["distinct", "ties", "masked", "constant"]),
    seed=st.integers(0, 2**16),
)
def test_stable_topk_is_the_head_of_a_stable_sort(
    rows: int, vocab: int, k_frac: float, content: str, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    if content == "ties":
        x = torch.round(x * 2) / 2  # few distinct values: ties cross the top-k boundary
    elif content == "masked":
        x[torch.rand(rows, vocab, generator=g) < 0.5] = float("-inf")  # top-k/top-p removed tokens
    elif content == "constant":
        x = torch.zeros(rows, vocab)
    k = round(k_frac * vocab)
    ids, values = stable_topk(x, k)
    expected = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(ids, expected)
    assert torch.equal(values.view(torch.int32), x.gather(-1, expected).view(torch.int32))
